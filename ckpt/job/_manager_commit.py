"""The bookkeeping after a manager's save is committed: its event, the cadence, retention.

Runs on the manager's persist thread (``CheckpointManager``'s background half), after
``Persister.run`` committed a step. Advisory parts never lose the checkpoint: a failing
cadence policy is logged, a failing retention is logged and reported as
``retention_failed``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

from ckpt.events import EventBus
from ckpt.format import Manifest
from ckpt.job.persist import PersistOutcome
from ckpt.job.retention import RetentionPolicy, apply_retention
from ckpt.root import CheckpointStore

__all__ = ["after_commit", "report_committed", "record_in_cadence", "retain"]

log = logging.getLogger(__name__)


def after_commit(step: int, out: PersistOutcome, *, events: EventBus, cadence: Any,
                 slowdown: float | None, save_history: Callable[[], None],
                 store: CheckpointStore, retention: Sequence[RetentionPolicy],
                 coordinator: bool, stall: float, copy_seconds: float | None, nbytes: int,
                 t_start: float) -> None:
    """Everything after the commit of ``step``, in order: ``save_committed``, the cadence,
    the failure history (``save_history``), retention (coordinator), then ``save_cost``
    with the time each took (``out.cost``'s phases ``bookkeep`` and ``retention``)."""
    cost = out.cost
    report_committed(events, step, out, stall=stall, copy_seconds=copy_seconds,
                     nbytes=nbytes, t_start=t_start)
    record_in_cadence(cadence, events, step, stall=stall, persist=out.persist_seconds,
                      nbytes=nbytes, slowdown=slowdown)
    save_history()
    cost.lap("bookkeep")
    if coordinator and retention:
        retain(store, retention, step, events, out.manifest)
    cost.lap("retention")
    events.emit("save_cost", step, **cost.fields())


def report_committed(events: EventBus, step: int, out: PersistOutcome, *, stall: float,
                     copy_seconds: float | None, nbytes: int, t_start: float) -> None:
    """Emit ``save_committed`` for ``out`` (a committed outcome)."""
    manifest, persist = out.manifest, out.persist_seconds
    events.emit("save_committed", step, outcome="committed", stall_seconds=stall,
                copy_seconds=copy_seconds, persist_seconds=persist,
                total_seconds=time.monotonic() - t_start,
                bytes=nbytes, bytes_per_second=nbytes / persist if persist > 0 else 0.0,
                retries=out.retries, attempts=out.attempts,
                total_bytes=manifest.total_bytes if manifest else None)


def record_in_cadence(cadence: Any, events: EventBus, step: int, *, stall: float,
                      persist: float, nbytes: int, slowdown: float | None) -> None:
    """Tell ``cadence`` (if any) what the save cost; emit its new state as ``cadence``."""
    if cadence is None:
        return
    try:
        cadence.record_save(stall_seconds=stall, persist_seconds=persist, num_bytes=nbytes,
                            slowdown_seconds=slowdown)
        events.emit("cadence", step, **cadence.describe())
    except Exception:  # noqa: BLE001 - a cadence bug must not lose the checkpoint
        log.exception("cadence policy failed to record the save of step %d", step)


def retain(store: CheckpointStore, retention: Sequence[RetentionPolicy], step: int,
           events: EventBus, newest_manifest: Manifest | None) -> None:
    """Coordinator: apply ``retention`` after the commit of ``step`` (never deleting it)."""
    try:
        apply_retention(
            store, retention, protect={step},
            on_deleted=lambda s: events.emit("retention_deleted", s),
            on_failed=lambda s, e: events.emit("retention_failed", s, error=str(e)),
            newest_manifest=newest_manifest)
    except Exception as exc:  # noqa: BLE001 - retention must never crash a job
        log.warning("retention after step %d failed: %s", step, exc)
        events.emit("retention_failed", None, error=f"{type(exc).__name__}: {exc}")
