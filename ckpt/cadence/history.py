"""The job's failure history under a checkpoint root: ``_history.json``.

Failure times and total uptime (JSON, :class:`ckpt.cadence.policies.FailureHistory`), kept across the
job's restarts so the ``auto`` cadence can refine its MTBF prior with what it has seen.
Advisory data: unreadable or unwritable history is logged and ignored, never fatal.
"""

from __future__ import annotations

import logging
import math
import os
import time

from ckpt.cadence.young_daly import FailureHistory
from ckpt.events import EventBus
from ckpt.format import jsonio
from ckpt.storage import Storage

__all__ = ["HISTORY_NAME", "load_history", "load_job_history", "read_history", "write_history"]

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
