"""The decision of a manager's save step, agreed by every rank: is a save due, may it start.

Contract: the manager's training thread calls :meth:`SaveGate.decide` on every rank of the
gate's agreement at the same points: once per step from ``maybe_save``, once per call of
``save``. One code path, at most one collective:

=========================== ==========================================================
``save`` called             due; one all-reduce agrees the checks
no cadence                  not due; no collective
deterministic cadence       its answer (the same on every rank); when due, one
                            all-reduce agrees the checks
time-based cadence          each rank's clock answers, so the answer is agreed, but
                            only every ``check_every`` steps (not due on the steps
                            between); on those steps one all-reduce agrees the answer
                            (any rank's True wins) and the checks together
=========================== ==========================================================

``check_every`` is about 1/20 of a time-based cadence's interval (each rank proposes a
period in every all-reduce and the smallest wins): a save is at most 5% of an interval late.
The checks (:class:`SaveChecks`): whether the previous save is in flight, whether the step is
committed (the coordinator answers without a storage request in the common case:
:class:`CommittedSteps`), whether the lease is lost and whether a failure is pending. A
two-tier job's local tier agrees them over the whole job (every node saves the same local
steps), its durable tier over its ranks.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from ckpt.cadence import CadencePolicy
from ckpt.errors import CheckpointError
from ckpt.format import Manifest
from ckpt.ranks import Agreement
from ckpt.root import Lifecycle

__all__ = ["CommittedSteps", "Decision", "SaveChecks", "SaveGate", "SaveInputs"]


def _check_period(cadence: CadencePolicy | None) -> int:
    """Steps between agreements of a time-based ``cadence``: ~1/20 of its interval (1 when
    it has no estimate; this rank's proposal, the smallest one wins)."""
    steps = cadence.describe().get("interval_steps") if cadence is not None else None
    return max(1, int(steps) // 20) if steps else 1


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


class SaveInputs(NamedTuple):
    """This rank's side of one save decision."""

    cadence: CadencePolicy | None  # what maybe_save follows (None: never due by itself)
    requested: bool  # save() was called: a save is wanted now, whatever the cadence
    busy: bool  # the previous save is in flight here
    lease_lost: bool  # this rank's claim found the write lease taken
    pending_failure: bool  # the previous save failed and is to be raised
    last_committed: Manifest | None  # the newest manifest this manager committed


class SaveChecks(NamedTuple):
    """What every rank agreed at the start of a save (any rank's True wins)."""

    busy: bool  # the previous save is in flight (on some rank)
    exists: bool  # the step is committed already
    lost: bool  # the write lease was lost
    failed: bool  # the previous save failed and is to be raised


class Decision(NamedTuple):
    """A save step's decision, the same on every rank."""

    due: bool
    checks: SaveChecks | None  # agreed when due; None when not


class SaveGate:
    """The agreed save decisions of one manager (see the module docstring)."""

    def __init__(self, agreement: Agreement, life: Lifecycle, coordinator: bool):
        self.agreement = agreement
        self.committed = CommittedSteps(life, coordinator)
        self.check_every = 1

    def decide(self, step: int, inputs: SaveInputs) -> Decision:
        """Whether a save of ``step`` is due, and (when it is) the checks every rank agreed;
        at most one collective (the module docstring's table)."""
        cadence = inputs.cadence
        if inputs.requested:
            want = True
        elif cadence is None:
            return Decision(False, None)
        else:
            want = bool(cadence.should_save(step, time.monotonic()))
            if cadence.deterministic and not want:
                return Decision(False, None)
            if not cadence.deterministic and step % self.check_every:
                return Decision(False, None)
        flags = (want, inputs.busy, self.committed.contains(step, inputs.last_committed),
                 inputs.lease_lost, inputs.pending_failure)
        raised, (period,) = self.agreement.any_and_min(flags, (_check_period(cadence),))
        self.check_every = max(1, period)
        return Decision(True, SaveChecks(*raised[1:])) if raised[0] else Decision(False, None)
