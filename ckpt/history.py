"""The job's failure history under a checkpoint root: ``_history.json``.

Failure times and total uptime (JSON, :class:`ckpt.cadence.FailureHistory`), kept across the
job's restarts so the ``auto`` cadence can refine its MTBF prior with what it has seen.
Advisory data: unreadable or unwritable history is logged and ignored, never fatal.
"""

from __future__ import annotations

import json
import logging
import os
import time

from ckpt.cadence import FailureHistory
from ckpt.events import EventBus
from ckpt.storage import Storage

__all__ = ["HISTORY_NAME", "read_history", "write_history"]

log = logging.getLogger(__name__)
HISTORY_NAME = "_history.json"


def read_history(storage: Storage, events: EventBus, *, took_over: bool,
                 found_aborted: bool) -> FailureHistory:
    """Rank 0 at start: the stored history, plus one failure if the previous run died.

    A start follows a failure when torchrun restarted this job, when it took the lease
    over from a dead holder, or when it found a dead writer's leftovers.
    """
    history = FailureHistory()
    try:
        history = FailureHistory.from_dict(json.loads(storage.read_bytes(HISTORY_NAME)))
    except FileNotFoundError:
        pass
    except (ValueError, OSError) as exc:
        log.warning("ignoring unreadable %s: %s", storage.describe(HISTORY_NAME), exc)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if restarted or took_over or found_aborted:
        history.record_failure(time.time())
        events.emit("failure_recorded", restarted=restarted, took_over=took_over,
                    num_failures=history.num_failures)
    return history


def write_history(storage: Storage, history: FailureHistory) -> None:
    try:
        storage.write_bytes(HISTORY_NAME, json.dumps(history.to_dict()).encode())
    except Exception as exc:  # noqa: BLE001 - advisory data only
        log.warning("could not write %s: %s", storage.describe(HISTORY_NAME), exc)
