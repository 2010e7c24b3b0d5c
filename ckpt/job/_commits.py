"""A manager's commits: what it knows of them, and the bookkeeping after each one.

What it knows: ``newest_step``, the newest step this manager committed or found committed
(the same on every rank), and ``last_manifest``, the newest manifest it committed (the
coordinator's; the save gate answers "is this step committed?" from it). The bookkeeping
(:meth:`Commits.record`) runs on the manager's persist thread after ``Persister.run``
committed a step, in order: the ``save_committed`` event, the cadence, the failure history
(written at most every ``HISTORY_SECONDS``), retention (coordinator: the policies decide from
the committed steps its life-cycle knows, no listing; the deletions are carried out here or,
in process mode, by the writer process), then ``save_cost`` with the time each took.
Advisory parts never lose the checkpoint: a failing cadence policy is logged, a failing retention is logged and
reported as ``retention_failed``.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

from ckpt.cadence import CadencePolicy
from ckpt.events import EventBus
from ckpt.format import Manifest
from ckpt.job._claim import RootClaim
from ckpt.job._inflight import StagedCopy
from ckpt.job.persist import PersistOutcome
from ckpt.job.retention import (
    RetentionPlan,
    RetentionPolicy,
    carry_out_retention,
    plan_retention,
)
from ckpt.root import CheckpointStore

__all__ = ["Commits", "HISTORY_SECONDS"]

log = logging.getLogger(__name__)

HISTORY_SECONDS = 60.0
"""After a commit the failure history is written only if its last write is older than this
(one request fewer per save; the manager writes it at close too)."""


class Commits:
    """The commits of one manager under ``store`` (see the module docstring). ``claim``:
    the manager's claim on the root, whose failure history is written after each commit.
    ``carry_out``: another who may carry out retention's plans, ``carry_out(plan,
    newest_manifest)`` (it emits ``retention_deleted``/``retention_failed`` and keeps
    ``store``'s life-cycle knowing which steps are committed), False when it cannot (then
    this process does, through ``store``); None: always this process."""

    def __init__(self, events: EventBus, store: CheckpointStore, claim: RootClaim,
                 retention: Sequence[RetentionPolicy], *, coordinator: bool,
                 carry_out: Callable[[RetentionPlan, Manifest | None], bool] | None = None):
        self.events, self.store, self.claim = events, store, claim
        self.retention = list(retention)
        self.coordinator = coordinator
        self.carry_out = carry_out
        self.newest_step: int | None = None  # known on every rank
        self.last_manifest: Manifest | None = None  # the coordinator's

    def found(self, step: int) -> None:
        """``step`` turned out committed already (a save of it was skipped)."""
        self.newest_step = max(step, self.newest_step if self.newest_step is not None else step)

    def record(self, out: PersistOutcome, copy: StagedCopy, *, cadence: CadencePolicy | None,
               copy_seconds: float | None, t_start: float, slowdown: float | None) -> None:
        """Persist thread: the save of ``copy`` was committed (``out``); do everything that
        follows, in order (module docstring). ``cadence``: the manager's policy (or None);
        ``copy_seconds``: the device time of the copies into the staged buffers, if known;
        ``t_start``: when the save began; ``slowdown``: what persisting cost each step."""
        step, cost = copy.step, out.cost
        cost.lap()
        self.newest_step = step
        if self.coordinator:
            self.last_manifest = out.manifest
        self._report(out, copy, copy_seconds=copy_seconds, t_start=t_start)
        if cadence is not None:
            self._tell_cadence(cadence, out, copy, slowdown)
        self.claim.save_history(at_most_every=HISTORY_SECONDS)
        cost.lap("bookkeep")
        if self.coordinator and self.retention:
            self._retain(step, out.manifest)
        if self.coordinator:  # what retention's deletions did not take along
            self.store.life.remove_committed_markers()
        cost.lap("retention")
        self.events.emit("save_cost", step, **cost.fields())

    def _report(self, out: PersistOutcome, copy: StagedCopy, *, copy_seconds: float | None,
                t_start: float) -> None:
        """Emit ``save_committed``."""
        manifest, persist, nbytes = out.manifest, out.persist_seconds, copy.nbytes
        self.events.emit(
            "save_committed", copy.step, outcome="committed", stall_seconds=copy.stall_seconds,
            copy_seconds=copy_seconds, persist_seconds=persist,
            total_seconds=time.monotonic() - t_start,
            bytes=nbytes, bytes_per_second=nbytes / persist if persist > 0 else 0.0,
            retries=out.retries, attempts=out.attempts,
            total_bytes=manifest.total_bytes if manifest else None)

    def _tell_cadence(self, cadence: CadencePolicy | None, out: PersistOutcome, copy: StagedCopy,
                      slowdown: float | None) -> None:
        """Tell ``cadence`` what the save cost; emit its new state as ``cadence``."""
        try:
            cadence.record_save(stall_seconds=copy.stall_seconds,
                                persist_seconds=out.persist_seconds, num_bytes=copy.nbytes,
                                slowdown_seconds=slowdown)
            self.events.emit("cadence", copy.step, **cadence.describe())
        except Exception:  # noqa: BLE001 - a cadence bug must not lose the checkpoint
            log.exception("cadence policy failed to record the save of step %d", copy.step)

    def _retain(self, step: int, newest_manifest: Manifest | None) -> None:
        """Coordinator: apply retention after the commit of ``step`` (never deleting it)."""
        try:
            plan = plan_retention(self.store, self.retention, protect={step},
                                  newest_manifest=newest_manifest,
                                  committed=self.store.life.known_committed())
            if plan is not None and (self.carry_out is None
                                     or not self.carry_out(plan, newest_manifest)):
                self._carry_out_here(plan, newest_manifest)
        except Exception as exc:  # noqa: BLE001 - retention must never crash a job
            log.warning("retention after step %d failed: %s", step, exc)
            self.events.emit("retention_failed", None, error=f"{type(exc).__name__}: {exc}")

    def _carry_out_here(self, plan: RetentionPlan, newest_manifest: Manifest | None) -> None:
        carry_out_retention(
            self.store, plan, newest_manifest=newest_manifest,
            on_deleted=lambda s: self.events.emit("retention_deleted", s),
            on_failed=lambda s, e: self.events.emit("retention_failed", s, error=str(e)))
