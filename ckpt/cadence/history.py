"""The job's failure history under a checkpoint root: ``_history.json``.

Failure times and total uptime (JSON, :class:`ckpt.cadence.young_daly.FailureHistory`), kept
across the job's restarts so the ``auto`` cadence can refine its MTBF prior with what it has
seen, and the job's goodput record (its ``goodput`` object: where its wall time went since
it first started, :class:`ckpt.cadence.goodput.GoodputLedger`), which a restarted job
continues. Advisory data: unreadable or unwritable history is logged and ignored, never
fatal.

The file (docs/format.md, "Layout of a root")::

    {"version": 1, "failure_times": [unix, ...], "uptime_seconds": s,
     "goodput": {"version": 1, "first_start_unix": t, "recorded_unix": t,
                 "seconds": {"productive": s, "startup": s, ...}, "ended": false,
                 "step": n}}

``goodput`` is optional (files written before it have none; readers that predate it ignore
it).
"""

from __future__ import annotations

import logging
import math
import os
import time

from ckpt.cadence.goodput import GoodputLedger
from ckpt.cadence.young_daly import FailureHistory
from ckpt.events import EventBus
from ckpt.format import jsonio
from ckpt.storage import Storage

__all__ = ["HISTORY_NAME", "load_history", "load_goodput", "load_job_history", "read_history",
           "write_history"]

log = logging.getLogger(__name__)
HISTORY_NAME = "_history.json"


def load_history(storage: Storage) -> FailureHistory | None:
    """The stored history as it is, for display (None when there is none); read only.

    Unlike :func:`read_history` a damaged file is an error, a ``ValueError`` naming it."""
    where = storage.describe(HISTORY_NAME)
    try:
        data = storage.read_bytes(HISTORY_NAME, max_bytes=16 << 20)
    except FileNotFoundError:
        return None
    try:
        history = FailureHistory.from_dict(jsonio.loads(data, where, max_bytes=16 << 20))
        if not all(math.isfinite(t) for t in [*history.failure_times, history.uptime_seconds]):
            raise ValueError("failure times and uptime must be finite numbers")
    except (ValueError, TypeError, OverflowError) as exc:
        raise ValueError(f"{where} is unreadable ({exc}); the job ignores it too, and deleting "
                         f"it starts a new history") from None
    return history


def load_goodput(storage: Storage) -> GoodputLedger | None:
    """The stored goodput record, for display (None: no history, or one without a record);
    read only. A damaged record is a ``ValueError`` naming the file and the field."""
    history = load_history(storage)
    if history is None or not history.goodput:
        return None
    try:
        return GoodputLedger.from_dict(history.goodput)
    except ValueError as exc:
        where = storage.describe(HISTORY_NAME)
        raise ValueError(f"{where}: its goodput record is unreadable ({exc}); the job starts "
                         f"a new tally over it") from None


def read_history(storage: Storage, events: EventBus, *, took_over: bool,
                 found_aborted: bool) -> FailureHistory:
    """Rank 0 at start: the stored history, plus one failure if the previous run died.

    A start follows a failure when torchrun restarted this job, when it took the lease
    over from a dead holder, or when it found a dead writer's leftovers.
    """
    history = FailureHistory()
    where = storage.describe(HISTORY_NAME)
    try:
        data = storage.read_bytes(HISTORY_NAME, max_bytes=16 << 20)
        loaded = FailureHistory.from_dict(jsonio.loads(data, where, max_bytes=16 << 20))
        if not all(math.isfinite(t) for t in [*loaded.failure_times, loaded.uptime_seconds]):
            raise ValueError("failure times and uptime must be finite numbers")
        history = loaded
    except FileNotFoundError:
        pass
    except (ValueError, TypeError, OverflowError, OSError) as exc:
        log.warning("ignoring unreadable %s (delete it to start a new history): %s", where, exc)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if restarted or took_over or found_aborted:
        history.record_failure(time.time())
        events.emit("failure_recorded", restarted=restarted, took_over=took_over,
                    num_failures=history.num_failures)
    return history


def load_job_history(storage: Storage, events: EventBus, agreement, *, coordinator: bool,
                     took_over: bool, found_aborted: bool) -> FailureHistory:
    """``read_history`` on the coordinator, the same history on every rank. Collective."""
    data = None
    if coordinator:
        data = read_history(storage, events, took_over=took_over,
                            found_aborted=found_aborted).to_dict()
    return FailureHistory.from_dict(agreement.broadcast(data))


def write_history(storage: Storage, history: FailureHistory) -> None:
    try:
        storage.write_bytes(HISTORY_NAME, jsonio.dumps(history.to_dict()))
    except Exception as exc:  # noqa: BLE001 - advisory data only
        log.warning("could not write %s: %s", storage.describe(HISTORY_NAME), exc)
