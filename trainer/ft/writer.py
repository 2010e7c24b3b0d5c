"""Which replica group writes durable checkpoints: the one whose rank 0 holds the lease.

The store stays the floor under the replica groups: checkpoints keep their cadence, written
by one group at a time. There is no election of our own: the store's lease (``ckpt.root``)
already makes one writer per root, with a generation and fencing, so every group simply
tries to take it and the one that does writes. Roles::

    standby --(lease takeable at an agreed step, CheckpointManager built)--> writer
    writer  --(lease lost: taken over, e.g. after this group stalled past the TTL)--> standby
    writer  --(the group dies)--> the lease expires or its holder is proven dead -->
            another group's next try takes it over (fencing closes the dead generation)

A group tries at start and then every ``fault_tolerance.lease_retry_steps`` committed steps:
all of its ranks at the same step (building a manager is collective within the group), the
rank 0 first reading the lease record so that a live holder costs one small read, not a
failed construction. On one host a dead holder is proven dead by its pid, so the takeover is
immediate; across hosts it waits for the TTL (``fault_tolerance.lease_ttl_seconds``).
Training never waits for the lease: only durable saves pause.

At the end of the run, a group that does not write waits for the writer's final checkpoint
(or takes the lease and writes it, when the writer is gone): :meth:`WriterRole.finish`.

A group that does not write still reads the store at start (every group resumes from it).
While a new writer closes the generation of a dead one, that generation's checkpoints count
only once listed in its close record, so a reader in that moment would skip them: a
standby group reads only when the root is settled (:meth:`WriterRole.wait_settled`).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from ckpt import Checkpointer, CheckpointError, CheckpointStore, EventBus, LeaseHeldError, Storage
from ckpt.ranks import Agreement
from ckpt.root import Fence, Lease, read_lease

__all__ = ["WriterRole"]

log = logging.getLogger(__name__)


class WriterRole:
    """This group's role towards the checkpoint root: writer (``manager`` set) or standby.

    ``build()`` constructs the job's ``CheckpointManager`` (taking the lease; collective
    over the group, raising ``LeaseHeldError`` on every rank when another group holds it).
    ``fingerprint`` and ``ttl_seconds`` are the ones ``build`` gives the lease.
    """

    def __init__(self, storage: Storage, build: Callable[[], Checkpointer], *,
                 agreement: Agreement, coordinator: bool, events: EventBus, group_id: int,
                 ttl_seconds: float, retry_steps: int, fingerprint: str | None):
        self.storage, self.build, self.agreement = storage, build, agreement
        self.coordinator, self.events, self.group_id = coordinator, events, group_id
        self.retry_steps = retry_steps
        self._probe = Lease(storage, ttl_seconds=ttl_seconds, fingerprint=fingerprint)
        self.manager: Checkpointer | None = None

    @property
    def writing(self) -> bool:
        return self.manager is not None

    def _takeable(self) -> str | None:
        """(Rank 0) why the lease can be taken now, or None while a live holder has it."""
        try:
            info = read_lease(self.storage)
        except Exception as exc:  # noqa: BLE001 - cannot tell: try later
            log.warning("could not read the lease of %s: %s", self.storage.url, exc)
            return None
        if info is None:
            return "no lease yet"
        return self._probe.expired_because(info)

    def try_acquire(self, step: int, *, now: bool = False) -> bool:
        """At ``step`` (every rank of the group, the same step): become the writer if the
        lease is free. Tries only every ``retry_steps`` steps unless ``now``. Returns
        whether this group writes."""
        if self.manager is not None:
            return True
        if not now and step % self.retry_steps:
            return False
        why = self.agreement.broadcast(self._takeable() if self.coordinator else None)
        if why is None:
            return False
        try:
            self.manager = self.build()
        except LeaseHeldError as exc:  # another group was faster
            log.info("replica group %d: the lease went to another group (%s)", self.group_id,
                     str(exc)[:200])
            return False
        log.info("replica group %d holds the lease on %s and writes the checkpoints (%s)",
                 self.group_id, self.storage.url, why)
        self.events.emit("ft_writer", step, role="writer", reason=why)
        return True

    def check_lost(self, step: int) -> None:
        """After a save: a group whose lease was taken over goes back to standby (its
        saves stopped counting the moment it was fenced off; nothing it wrote after is
        visible)."""
        m = self.manager
        if m is None or not m.lease_lost:
            return
        log.warning("replica group %d lost the lease at step %d; another group writes now",
                    self.group_id, step)
        m.close(flush=False)
        self.manager = None
        self.events.emit("ft_writer", step, role="standby", reason="lease lost")

    def _settled(self) -> bool:
        """(Rank 0) no takeover in progress: at most one generation, the newest, is open."""
        try:
            opened, closed = Fence(self.storage).generations()
        except FileNotFoundError:
            return True
        still_open = opened - closed
        return not still_open or still_open == {max(opened)}

    def wait_settled(self, timeout_seconds: float) -> bool:
        """Wait (collectively) until no writer is closing an earlier writer's generation,
        up to ``timeout_seconds``; returns whether it settled."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            settled = self.agreement.broadcast(self._settled() if self.coordinator else None)
            if settled or time.monotonic() > deadline:
                return bool(settled)
            time.sleep(0.2)

    def finish(self, step: int, save: Callable[[Checkpointer], None],
               timeout_seconds: float) -> bool:
        """A standby group at the end of the run: wait until ``step`` is committed by the
        writer, taking the lease and saving it itself (``save(manager)``) if the writer is
        gone. Collective over the group. Returns whether ``step`` is committed."""
        store = CheckpointStore(self.storage)
        deadline = time.monotonic() + timeout_seconds
        while True:
            done = None
            if self.coordinator:
                done = _committed(store, step)
            if self.agreement.broadcast(done):
                return True
            if self.try_acquire(step, now=True):
                save(self.manager)
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)


def _committed(store: CheckpointStore, step: int) -> bool:
    """Is ``step`` committed as readers judge it: its manifest reads (digest, format) and
    counts (not fenced off, not abandoned by a resume)? A manifest file that merely exists
    is not enough: a fenced-off writer's late manifest exists too."""
    try:
        manifest = store.read_manifest(step)
        store.trajectory().check(step, manifest.save_id, manifest.lineage,
                                 f"checkpoint step {step}")
    except CheckpointError:
        return False
    return True
