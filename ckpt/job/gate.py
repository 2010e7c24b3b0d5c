"""The decisions of a manager's save step, agreed by every rank: is a save due, may it start.

Contract: the manager's training thread calls :class:`SaveGate` on every rank of the
manager's control group at the same points (``due`` or ``due_with_checks`` once per step,
``agree`` once per save unless ``due_with_checks`` agreed its checks already).
A time-based cadence decides differently on each rank, so it is agreed, but only every
``check_every`` steps (about 1/20 of the interval: each rank proposes a period at each save
and the smallest wins): a save is at most 5% of an interval late. That rule is
:class:`DueAgreement`, the one definition of an agreed due check (``ckpt.job.tiers`` agrees
its local tier across nodes with one too). Whether the previous save is in flight, whether
the step is committed (the coordinator answers without a storage request in the common case:
:class:`CommittedSteps`), whether the lease is lost and whether a failure is pending are
agreed in one all-reduce; when the due check of a time-based cadence runs a collective
anyway, the same all-reduce carries them (``due_with_checks``): a due save then costs one
collective on the training thread, not two. Also here: what feeds the decision (each
step's time, :func:`observe_step`; each used save slot, :func:`use_slot`) and the report of
a skipped save.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

from ckpt.cadence import FailureHistory, StepTimes
from ckpt.errors import CheckpointError
from ckpt.events import EventBus
from ckpt.format import Manifest
from ckpt.ranks import Agreement
from ckpt.root import Lifecycle

__all__ = ["CommittedSteps", "DueAgreement", "SaveChecks", "SaveGate", "observe_step",
           "use_slot", "report_lease_lost", "report_busy_skip"]

log = logging.getLogger(__name__)


def _check_period(cadence: Any) -> int:
    """Steps between agreements of a time-based ``cadence``: ~1/20 of its interval (1 when
    it has no estimate; this rank's proposal, the smallest one wins)."""
    try:
        steps = (cadence.describe() or {}).get("interval_steps") if cadence is not None else None
    except Exception:  # noqa: BLE001 - advisory only
        steps = None
    return max(1, int(steps) // 20) if steps else 1


class DueAgreement:
    """Whether a cadence's save is due, decided alike on every rank of ``agreement``.

    A deterministic cadence (a step count) answers the same on every rank: no collective.
    A time-based one answers by each rank's clock, so its answer is agreed (any rank's True
    wins), but only on every ``check_every``-th step; on the steps between, it is not due.
    ``check_every`` is agreed at each save (:meth:`agree`): the smallest period any rank
    proposes, ~1/20 of the cadence's interval. Contract: every rank of the agreement's group
    calls :meth:`decide` and :meth:`agree` at the same points, from the agreement's thread.
    """

    def __init__(self, agreement: Agreement):
        self.agreement = agreement
        self.check_every = 1

    def decide(self, cadence: Any, step: int, want: bool) -> bool:
        """This rank's ``want`` (does ``cadence`` want a save at ``step``?) as every rank
        decides it (see the class docstring; ``cadence`` None: ``want`` as it is)."""
        if cadence is None or cadence.deterministic:
            return want
        return step % self.check_every == 0 and self.agreement.any(want)

    def agree(self, cadence: Any, *flags: bool) -> list[bool]:
        """One all-reduce, at a save: for each of ``flags``, whether some rank raised it;
        with it ``check_every`` for ``cadence`` is agreed."""
        raised, (period,) = self.agreement.any_and_min(flags, (_check_period(cadence),))
        self.check_every = max(1, period)
        return raised

    def decide_and_agree(self, cadence: Any, step: int, want: bool,
                         flags: Any) -> tuple[bool, list[bool] | None]:
        """:meth:`decide`, and when it runs its collective (a time-based ``cadence`` on a
        check step), :meth:`agree` of ``flags()`` in the same all-reduce. Returns the
        decision and the agreed flags, or None for them when no collective ran (then
        ``agree`` before a save, as after ``decide``)."""
        if cadence is None or cadence.deterministic:
            return want, None
        if step % self.check_every:
            return False, None
        due, *raised = self.agree(cadence, want, *flags())
        return due, raised


def observe_step(step_times: StepTimes, cadence: Any, history: FailureHistory, now: float,
                 busy: bool) -> None:
    """One training step ended at ``now`` (``busy``: while a save persisted): its time goes
    to ``step_times`` and, as uptime, to the cadence (or, without one, to ``history``)."""
    dt = step_times.observe(now, busy=busy)
    if dt is None:
        return
    if cadence is None:
        history.add_uptime(dt)
    else:  # the cadence adds the uptime to the shared history itself
        cadence.record_step(dt)


def use_slot(cadence: Any, step: int) -> None:
    """The save due at ``step`` happened, or was skipped: either way its slot is used, so
    the cadence counts the next interval from here (every rank alike)."""
    if cadence is not None:
        cadence.record_saved(step, time.monotonic())


class CommittedSteps:
    """The coordinator's view of which steps are committed under one root.

    Only one job writes under the root (the lease), so the steps its life-cycle knows
    (:meth:`ckpt.root.Lifecycle.known_committed`: listed once when the lease is taken, then
    kept by every commit, deletion and un-commit) are all there is: a step it does not know
    needs no storage request, on the training thread or in the commit's ``begin``.
    """

    def __init__(self, life: Lifecycle, coordinator: bool):
        self.life = life
        self.coordinator = coordinator
        if coordinator:
            try:  # once, here (free after the claim's cleanup), so that saves need none
                life.known_committed()
            except Exception:  # noqa: BLE001 - unknown: contains() asks about each step
                pass

    def contains(self, step: int, last_committed: Manifest | None) -> bool:
        """Coordinator: is ``step`` committed already (``last_committed``: the newest this
        manager committed)? Asks storage only when it could be. False on other ranks."""
        if not self.coordinator:
            return False
        if not self.life.may_hold_manifest(step):
            return False  # never committed, or un-committed since (a resume)
        if last_committed is not None and last_committed.step == step:
            return True
        try:
            self.life.read_committed(step)
            return True
        except CheckpointError:  # gone, fenced off or damaged: it does not count, save again
            return False


class SaveChecks(NamedTuple):
    """What every rank agreed at the start of a save (any rank's True wins)."""

    busy: bool  # the previous save is in flight (here or, for ``busy_elsewhere``, elsewhere)
    exists: bool  # the step is committed already
    lost: bool  # the write lease was lost
    failed: bool  # the previous save failed and is to be raised


class SaveGate:
    """The agreed save decisions of one manager (see the module docstring)."""

    def __init__(self, ctl: Agreement, life: Lifecycle, coordinator: bool):
        self.committed = CommittedSteps(life, coordinator)
        self.timing = DueAgreement(ctl)

    def due(self, cadence: Any, step: int) -> bool:
        """Does ``cadence`` (None: never) want a save at ``step``? Agreed when it is not
        deterministic (:class:`DueAgreement`)."""
        if cadence is None:
            return False
        want = bool(cadence.should_save(step, time.monotonic()))
        return self.timing.decide(cadence, step, want)

    def agree(self, step: int, *, cadence: Any, busy: bool, lease_lost: bool,
              pending_failure: bool, last_committed: Manifest | None) -> SaveChecks:
        """One all-reduce: the checks of a save of ``step``; also agrees ``check_every``."""
        committed = self.committed.contains(step, last_committed)
        return SaveChecks(*self.timing.agree(cadence, busy, committed, lease_lost,
                                             pending_failure))

    def due_with_checks(self, cadence: Any, step: int, *, busy: bool, lease_lost: bool,
                        pending_failure: bool, last_committed: Manifest | None
                        ) -> tuple[bool, SaveChecks | None]:
        """:meth:`due`, and the checks of a save of ``step`` (as :meth:`agree` returns them)
        when they were agreed in the same all-reduce: a time-based cadence on a check step.
        None for the checks otherwise (call :meth:`agree` before saving)."""
        if cadence is None:
            return False, None
        want = bool(cadence.should_save(step, time.monotonic()))

        def flags() -> tuple[bool, ...]:
            return (busy, self.committed.contains(step, last_committed), lease_lost,
                    pending_failure)

        due, raised = self.timing.decide_and_agree(cadence, step, want, flags)
        return due, (SaveChecks(*raised) if due and raised is not None else None)


def report_lease_lost(events: EventBus, step: int, url: str, *, log_it: bool) -> None:
    """The save of ``step`` is skipped: the write lease on ``url`` went to another job.
    ``log_it``: also say so in the log (the first skip; later ones are events only)."""
    events.emit("save_skipped", step, reason="lease lost", outcome="skipped")
    if log_it:
        log.error("not saving step %d nor any later step: the write lease on %s was lost to "
                  "another job, whose checkpoints count there now (this job's would not)",
                  step, url)


def report_busy_skip(events: EventBus, step: int, in_flight_step: int | None,
                     num_skipped: int) -> None:
    """The save of ``step`` is skipped: the save of ``in_flight_step`` still persists."""
    events.emit("save_skipped", step, reason="previous save in flight", outcome="skipped",
                in_flight_step=in_flight_step, num_skipped=num_skipped)
    log.warning("checkpoint at step %d skipped: the save of step %s is still persisting "
                "(%d skipped so far)", step, in_flight_step, num_skipped)
