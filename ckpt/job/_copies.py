"""Copies of each node's local checkpoints on the next node: a local tier that survives the
loss of a node (``LocalTierOptions(copies=2)``).

Nodes form a ring by index. Node ``n``'s local checkpoints are copied to its successor, into
``peer-{n}/`` under that node's local root (``ckpt.job._tier_layout.peer_root``; never
through a link planted there: refused, naming it): a root of its own, whose lease the
successor's first rank holds (fencing, cleanup of torn copies included). Only the first
rank of each node (its *coordinator*, which commits the node's local checkpoints) takes
part; bytes travel point to point (``ckpt.ranks.swap_bytes``) on a gloo group of the
coordinators, used by one thread at a time, never the training group.

Life of a copy (one background thread per coordinator; every coordinator runs the same
rounds in the same order)::

    a local save of step S started on some node (agreed by the save's own all-reduce)
        ─► each coordinator queues round S (the training thread only queues: no stall)
    round S ─► skip it on every node if some node has a newer round queued (agreed:
               only the newest step is copied when copies are slower than saves)
            ─► wait for this node's local save of S: its manifest, or nothing
            ─► swap: my version to the successor while the predecessor's comes in:
               header (step, files, sizes, the steps its owner keeps), manifest, then each
               file in chunks of at most 64 MiB
    receiver:  begin (marker, the version's own save id) ─► each file written as it
               arrives, its size and CRC32C checked, synced ─► all verified: commit_copy
               (the manifest re-issued under the peer root's lease) ─► the steps the owner
               no longer keeps are deleted     | anything wrong: abandon (files removed)
    ack ─► the sender learns its step is held on two nodes (``copy_committed``)

A copy is complete or invisible: its manifest is created last, and a copy torn by a crash
has none (the next holder of the peer root removes its files). Memory per coordinator, in
host memory: the chunk it sends, and the chunk arriving plus the one being written (on local
disk a file is written chunk by chunk as it arrives; on other storage a file is held until
its last chunk, then written while the next one arrives).

Resume (:meth:`PeerCopies.restore`, every rank, on the training thread, before the two-tier
walk): a local step counts when every node holds it, itself or through its successor's
copy. A node lacking the newest such step (not older than the durable tier's newest) gets it
back from its successor (the files, verified, committed into its own local root under its
own lease, the manifest re-issued again); if that fails the next older such step is tried,
and a step some node still lacks after that is no candidate: the walk goes on, to older local
steps and the durable tier.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ckpt.errors import CheckpointError, CorruptCheckpointError, LeaseHeldError
from ckpt.events import EventBus
from ckpt.format import Manifest
from ckpt.job._copy import Incoming, Outgoing, swap_versions
from ckpt.job._tier_layout import peer_root, ring_neighbours, runs_of_steps
from ckpt.job.manager import CheckpointManager
from ckpt.job.options import ManagerOptions
from ckpt.ranks import Agreement, destroy_groups, swap_bytes
from ckpt.root import CheckpointStore, Lifecycle, acquire_lease, release_lease
from ckpt.storage import Storage

__all__ = ["PeerCopies", "COPY_TIMEOUT_SECONDS", "MAX_COPIES"]

log = logging.getLogger(__name__)

MAX_COPIES = 2
"""Copies of a node's local checkpoint: its own, and one on the next node."""

COPY_TIMEOUT_SECONDS = 300.0
"""How long a coordinator waits for a neighbour's bytes before the copy fails (a neighbour
that died: the job is torn down by then anyway)."""


def _ack(ok: bool) -> torch.Tensor:
    return torch.tensor([1 if ok else 0], dtype=torch.uint8)


class PeerCopies:
    """The copies of node-local checkpoints on the next node, for one rank of a tiered job.

    Construction is collective over the job (every rank: the coordinators' group); each
    coordinator takes the lease of the peer root it holds inside its node's local root
    (``local.storage``), and removes torn copies; when one cannot, every rank raises
    (``LeaseHeldError``, or there the ``CorruptCheckpointError`` naming a link planted where
    the peer root lives). ``queue``/``wait`` on the training thread;
    ``restore`` and ``drop_newer`` at a resume (every rank; ``wait`` first); ``close`` once.
    """

    def __init__(self, local: CheckpointManager, *, node: int,
                 node_of_rank: list[int], world: Agreement, events: EventBus,
                 options: ManagerOptions):
        self.local, self.events, self.node, self.world = local, events, node, world
        nodes = sorted(set(node_of_rank))
        first = {n: node_of_rank.index(n) for n in nodes}  # each node's coordinator
        self.coordinator_of = first
        self.pred_node, self.succ_node = ring_neighbours(node, nodes)
        self.nodes = nodes
        self.coordinator = local.rank == 0
        self.group = dist.new_group(ranks=[first[n] for n in nodes], backend="gloo",
                                    timeout=timedelta(seconds=COPY_TIMEOUT_SECONDS),
                                    group_desc="ckpt_copies")
        self.peer_life: Lifecycle | None = None  # the coordinator's: its predecessor's copies
        self.peer_store: CheckpointStore | None = None
        self._pending: deque[int] = deque()  # rounds queued, not begun
        self._lock = threading.Lock()
        self._last: Future | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ckpt-copy")
        error = self._claim(local.storage, options.use_lease,
                            ttl_seconds=options.lease_ttl_seconds, job_name=options.job_name,
                            fingerprint=options.job_fingerprint) \
            if self.coordinator else None
        if world.any(error is not None):
            self.close()
            raise error or LeaseHeldError("another node could not take the copies it holds "
                                          "(its lease, or a link in their folder: its log "
                                          "says which)")

    def _claim(self, local: Storage, use_lease: bool, **lease_options: Any
               ) -> CheckpointError | None:
        """Coordinator: take the root of the copies held here, inside ``local`` (its lease,
        fencing off earlier holders; then remove torn copies). Returns why it could not
        (``LeaseHeldError``, or ``CorruptCheckpointError`` naming a link planted where the
        root lives), or None."""
        try:
            storage = peer_root(local, self.pred_node)
        except CorruptCheckpointError as exc:
            log.error("%s", exc)
            return exc
        life = Lifecycle(storage)
        if use_lease:
            try:
                acquire_lease(storage, lifecycle=life, on_lost=lambda why: self.events.emit(
                    "local_lease_lost", reason=why, tier="local"), **lease_options)
            except LeaseHeldError as exc:
                return exc
            try:
                life.cleanup()  # torn copies of an earlier holder
            except Exception as exc:  # noqa: BLE001 - best effort, as a manager's
                log.warning("could not clean up %s: %s", storage.url, exc)
        self.peer_life, self.peer_store = life, CheckpointStore(storage, lifecycle=life)
        return None

    # -- rounds (training thread queues, the copy thread runs) --------------------------
    def queue(self, step: int, outcome: Future | None) -> None:
        """Copy this node's local save of ``step`` (``outcome``: its future, None when it
        was not started here) once it is done. Every rank calls it when some node started
        a local save of ``step``; only coordinators act."""
        if not self.coordinator:
            return
        with self._lock:
            self._pending.append(step)
            self._last = self._executor.submit(self._round, step, outcome)

    def wait(self) -> None:
        """Until every round queued is done (they never raise)."""
        last = self._last
        if last is not None:
            last.result()

    def _round(self, step: int, outcome: Future | None) -> None:
        with self._lock:
            self._pending.popleft()
            newer = bool(self._pending)
        try:
            if Agreement(self.group).any(newer):  # this thread's group: the coordinators'
                self.events.emit("copy_skipped", step,
                                 reason="a newer local step is queued: only it is copied")
                return
            manifest = None
            if outcome is not None:
                try:
                    manifest = outcome.result()
                except Exception:  # noqa: BLE001 - the save reported its own failure
                    manifest = None
            self._copy(step, manifest)
        except Exception as exc:  # noqa: BLE001 - a copy never stops the job
            log.error("copy of local step %d to node %d failed: %s", step, self.succ_node, exc)
            self.events.emit("copy_failed", step, node=self.node, peer_node=self.succ_node,
                             error=f"{type(exc).__name__}: {exc}")

    def _copy(self, step: int, manifest: Manifest | None) -> None:
        """One round: mine to the successor, the predecessor's into the peer root."""
        t0 = time.monotonic()
        keep = self.local.life.known_committed() if manifest is not None else None
        outgoing = Outgoing(self.local.storage, manifest, self.node, keep)
        incoming = Incoming(self.peer_life, self.pred_node, mirror=True) \
            if self.peer_life is not None else None
        swap_versions(self.group, send_to=self.coordinator_of[self.succ_node],
                       outgoing=outgoing, recv_from=self.coordinator_of[self.pred_node],
                       incoming=incoming)
        verdict = True
        received = incoming is not None and incoming.announced
        if received:
            try:
                incoming.finish()
            except CheckpointError as exc:
                verdict = False
                log.error("%s", exc)
                self.events.emit("copy_failed", incoming.step, node=self.pred_node,
                                 peer_node=self.node, error=str(exc))
        sent_step = outgoing.step is not None  # not when its files do not match it
        got = swap_bytes(self.group,
                         send_to=self.coordinator_of[self.pred_node] if received else None,
                         payload=_ack(verdict),
                         recv_from=self.coordinator_of[self.succ_node] if sent_step else None)
        if manifest is not None and not sent_step:
            self.events.emit("copy_failed", step, node=self.node, peer_node=self.succ_node,
                             error=outgoing.error)
        if not sent_step:
            return
        if got is not None and got.numel() == 1 and int(got[0]) == 1:
            self.events.emit("copy_committed", step, peer_node=self.succ_node,
                             bytes=outgoing.nbytes, seconds=time.monotonic() - t0,
                             lag_seconds=max(0.0, time.time() - manifest.created_unix))
        else:
            self.events.emit("copy_failed", step, node=self.node, peer_node=self.succ_node,
                             error=outgoing.error or f"node {self.succ_node} refused the copy "
                                                     f"(its log says why)")

    # -- resume (every rank, training thread) -------------------------------------------------
    def listing(self) -> list[tuple[int, str | None]] | None:
        """``(step, run)`` of the predecessor's copies held here (coordinator; None
        elsewhere, or when the peer root cannot be read: then none count). A copy keeps
        the lineage of the version it copies."""
        if self.peer_store is None:
            return None
        try:
            return runs_of_steps(self.peer_store)
        except Exception as exc:  # noqa: BLE001 - an unreadable copy is no copy
            log.warning("copies in %s unreadable, not used: %s", self.peer_store.storage.url,
                        exc)
            return []

    def restore(self, own: dict[int, set[int]], copies: dict[int, list[int] | None],
                at_least: int | None, on_failed) -> dict[int, set[int]]:
        """Give back to each node the newest step every node holds (itself, or through
        its successor's copy) that it lacks, not older than ``at_least``; older ones in
        turn when that fails. ``own``: each node's own committed local steps; ``copies``:
        the steps of its predecessor's that each node holds (its :meth:`listing`); both
        the same on every rank. Returns ``own`` with the steps given back. Collective over
        the job; ``on_failed(step, message)`` reports a step given up (every rank)."""
        held = {ring_neighbours(n, self.nodes)[0]: set(steps or ())
                for n, steps in copies.items()}
        common = set.intersection(*(own.get(n, set()) | held.get(n, set())
                                    for n in self.nodes))
        own = {n: set(own.get(n, set())) for n in self.nodes}
        whole = set.intersection(*(own[n] for n in self.nodes))
        for step in sorted((s for s in common - whole
                            if at_least is None or s >= at_least), reverse=True):
            lacking = [n for n in self.nodes if step not in own[n]]
            error = self._give_back(step, lacking) if self.coordinator else None
            errors = self.world.all_gather(error)
            if not any(errors):
                for n in lacking:
                    own[n].add(step)
                break
            why = "; ".join(e for e in errors if e)
            on_failed(step, f"checkpoint step {step} of the local tier is not usable (the "
                            f"copy of node(s) {lacking} could not be fetched back: {why}); "
                            f"falling back to an earlier one")
        return own

    def _give_back(self, step: int, lacking: list[int]) -> str | None:
        """Coordinator: send my copy of my predecessor's ``step`` if it lacks it; receive
        mine from my successor if I lack it. Returns why receiving failed, or None."""
        t0 = time.monotonic()
        outgoing = incoming = None
        if self.pred_node in lacking:
            manifest = None
            try:
                manifest = self.peer_store.read_manifest(step)
            except Exception as exc:  # noqa: BLE001 - sent as nothing: the receiver fails
                log.warning("cannot send back node %d's step %d: %s", self.pred_node, step, exc)
            outgoing = Outgoing(self.peer_store.storage, manifest, self.pred_node)
        if self.node in lacking:
            incoming = Incoming(self.local.life, self.succ_node, mirror=False)
        swap_versions(self.group,
                       send_to=self.coordinator_of[self.pred_node] if outgoing else None,
                       outgoing=outgoing,
                       recv_from=self.coordinator_of[self.succ_node] if incoming else None,
                       incoming=incoming)
        if incoming is None:
            return None
        try:
            if incoming.finish() is None:
                raise CheckpointError(f"node {self.succ_node} could not read its copy")
        except CheckpointError as exc:
            log.error("%s", exc)
            self.events.emit("copy_failed", step, node=self.node,
                             peer_node=self.succ_node, error=str(exc))
            return f"node {self.node}: {exc}"
        self.events.emit("copy_restored", step, peer_node=self.succ_node,
                         bytes=incoming.nbytes, seconds=time.monotonic() - t0)
        log.warning("node %d: local step %d fetched back from node %d's copy (%d bytes, "
                    "%.2f s)", self.node, step, self.succ_node, incoming.nbytes,
                    time.monotonic() - t0)
        return None

    def drop_newer(self, step: int) -> None:
        """Coordinator: delete the copies of steps newer than ``step`` (resumed there: the
        owner deletes its own, and will save those steps again). Step by step: a copy that
        cannot be deleted is reported and the others still go; what is left is of an
        abandoned run, never combined with the current one's (the same-run rule)."""
        if self.peer_life is None:
            return
        for newer, exc in self.peer_life.delete_newer(step):
            if newer is None:
                log.warning("could not list copies newer than step %d in %s: %s", step,
                            self.peer_life.storage.url, exc)
            elif exc is not None:
                log.warning("could not delete the copy of step %d (newer than step %d) in "
                            "%s: %s; it belongs to an abandoned run and is never combined "
                            "with the current one", newer, step, self.peer_life.storage.url,
                            exc)

    def close(self) -> None:
        """Finish the rounds queued, release the peer root's lease, free the group."""
        try:
            self._executor.shutdown(wait=True)
        finally:
            if self.peer_life is not None:
                release_lease(self.peer_life)
                self.peer_life = None
            self.free_group()

    def free_group(self) -> None:
        """Free the coordinators' group (its owner, the two-tier manager, frees it with its
        own groups, also at exit when never closed)."""
        group, self.group = self.group, None
        destroy_groups([group])

