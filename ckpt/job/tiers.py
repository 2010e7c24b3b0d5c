"""Two checkpoint tiers: a fast local one (node-local disk or /dev/shm) under the durable one.

``TieredCheckpointManager`` composes two :class:`~ckpt.job.manager.CheckpointManager`: the
durable tier (``root``, every rank of the job, its own cadence and retention) and the local
tier (``local_root``, saved more often, few kept). Each tier is an ordinary checkpoint root:
the same commit protocol, its own write lease and fencing, its own failure history.

Per-node local roots. On a job of several nodes, each node's ``local_root`` is a separate
filesystem: the local tier is one checkpoint *per node*, written by that node's ranks only
(a manager over a node subgroup; the node's first rank holds that root's lease and commits
its manifest). A node's local version is its *share* of the job's step (its manifest's
``span``, :mod:`ckpt.format.span`): its ranks' files, their shards of tensors sharded across
nodes (FSDP over every rank: each node holds its part), replicated state once per node. So
each node's version restores that node's ranks on the layout that wrote it; a step counts
only when every node holds its share from one run. A ``{node}`` in ``local_root`` is
replaced by the node's index (roots that are not node-local, and tests that run several
"nodes" on one host).

Life of a step (every rank calls the same methods at the same points)::

    maybe_save(step) ─► local due? durable due? (each agreed by every rank of the job)
        both  ─► durable stages (the one stall) ─► local persists the same staged copy
        one   ─► that tier stages and persists, as a plain manager does

    load_latest ─► candidate steps: each tier's committed steps; a local step counts only
        if it is committed on every node ─► the walk (``ckpt.root.walk_newest``): newest
        first, local before durable at the same step ─► size check on every rank, agreed
        ─► load (checksums), agreed ─► local steps newer than the one loaded are deleted

A local step present on some nodes only, or whose files fail on one rank, is skipped (all
ranks agreeing) and the walk goes on, into the durable tier. Loads are transactional per
node: a local load whose checksums fail on one node after another node loaded it is
followed by a load of an older checkpoint, which overwrites every key loaded. The
collectives of a resume run on the job-wide tier group (``_world``, main thread only):
which local steps every node has (an all-gather of each node's listing), the durable steps
(rank 0's listing) and each verdict of the walk.

Copies on the next node (``LocalTierOptions.copies=2``, :mod:`ckpt.job._copies`): after a node's
local save commits, its coordinator copies it, in the background, to the next node's
``local_root/peer-{node}/`` (a root of its own, under that node's lease); at a resume a local
step counts when every node holds it itself or through its successor's copy, and a node that
lacks it (a replaced, empty machine) gets it back from that copy before the walk. The
copies ride on the collectives above: whether any node started a local save is agreed in
the same all-reduce as the local lease.

Failure classes (``docs/cadence.md``): the local tier survives a process crash and a
restart on the same nodes, and loses a node's part with the node (with copies on the next
node: only when that node is lost too before the part is copied again). So the local tier's
``auto`` interval uses the rate of all failures (``mtbf_seconds`` of its ``Auto``), the
durable tier's the rate of the failures the local tier does not survive; a restart that
resumed from the local tier is not counted in the durable tier's failure history.

Size: one object composing the two tiers: every decision both tiers must agree on (due,
busy, layout, resume tier, copies) goes through it; the copies themselves are in _copies
and _copy.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch.distributed as dist

from ckpt.cadence import CadencePolicy, FailureHistory
from ckpt.events import LOCAL_PREFIX, Event, EventBus
from ckpt.format import Lineage, Manifest
from ckpt.job._copies import PeerCopies
from ckpt.job._tier_layout import (
    mixed_steps,
    node_groups,
    node_span,
    runs_of_steps,
    same_root,
)
from ckpt.job.checkpointer import Checkpointer, ResumeInfo
from ckpt.job.manager import CheckpointManager, TierLink
from ckpt.job.options import LocalTierOptions, ManagerOptions, with_policies
from ckpt.job.retention import RetentionPolicy
from ckpt.ranks import Agreement, destroy_groups, free_at_exit, freed
from ckpt.root import Candidate, CheckpointStore, Trajectory, read_runs, walk_newest
from ckpt.storage import Storage

__all__ = ["TieredCheckpointManager", "node_local_root"]

log = logging.getLogger(__name__)

def node_local_root(local_root: str, node: int) -> str:
    """``local_root`` with ``{node}`` replaced by ``node`` (unchanged without one)."""
    return str(local_root).replace("{node}", str(int(node)))


class TieredCheckpointManager(Checkpointer):
    """Checkpoint a job to a fast local tier often and to a durable tier less often.

    Args:
        root: the durable tier (local path or fsspec URL), as for ``CheckpointManager``.
        local_root: the local tier: a path on each node (``{node}`` is replaced by the node
            index). Must not be ``root``.
        options: both tiers' :class:`~ckpt.job.options.ManagerOptions` (its ``cadence`` and
            ``retention`` are the durable tier's, ``storage_options`` the durable root's).
        local: the local tier's :class:`~ckpt.job.options.LocalTierOptions` (its cadence,
            retention, copies on the next node, this process's node).
        cadence / local_cadence / retention / busy: ``options.cadence``, ``local.cadence``,
            ``options.retention`` and ``options.busy`` as keywords (give each once).
        events: one bus for both tiers; the local tier's are named ``local_<kind>``
            (``local_save_committed`` ...) and carry ``tier="local"``.

    Contract: every rank of the job constructs it (collective: process groups per node) and
    calls ``maybe_save``/``save``/``load_latest``/``close`` at the same points with the same
    step, as for ``CheckpointManager``. Host memory: one staging arena per tier (two copies
    of the rank's shard, aligned; docs/store.md, "Two tiers"), freed by ``close``.
    """

    def __init__(self, root: str | Storage, local_root: str,
                 options: ManagerOptions | None = None, *,
                 local: LocalTierOptions | None = None,
                 cadence: CadencePolicy | str | None = None,
                 local_cadence: CadencePolicy | str | None = None,
                 retention: Sequence[RetentionPolicy] | None = None,
                 busy: str | None = None, events: EventBus | None = None):
        options = with_policies(options or ManagerOptions(), "TieredCheckpointManager",
                                cadence=cadence, retention=retention, busy=busy)
        local = with_policies(local or LocalTierOptions(), "TieredCheckpointManager",
                              cadence=local_cadence)
        self.options, self.local_options = options, local
        root_url = root.url if isinstance(root, Storage) else str(root)
        node_rank = local.node_rank
        if node_rank is None:
            node_rank = int(os.environ.get("GROUP_RANK", "0") or 0)
        self.node_rank = int(node_rank)
        self.local_root = node_local_root(local_root, self.node_rank)
        if same_root(self.local_root, root_url):
            raise ValueError(f"local_root {self.local_root!r} is the durable root: give the "
                             f"local tier its own folder (e.g. on local NVMe or /dev/shm)")
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.events = events or EventBus(rank=self.rank)
        # The job-wide agreement of the tier logic (main thread only), and where each rank's
        # node is learned: never the default group (``ckpt.ranks.groups``).
        self._group = dist.new_group(backend="gloo", group_desc="ckpt_tiers") \
            if self.distributed else None
        self._world = Agreement(self._group)
        self._node_group = None  # the local tier's ranks: this node's (several nodes only)
        self._copies: PeerCopies | None = None  # copies on the next node (local.copies=2)
        if self._group is not None:
            free_at_exit(self._free_groups)
        try:
            self._node_group, self.num_nodes, self._node_of_rank = node_groups(
                self.node_rank, self._group)
        except BaseException:
            self._free_groups()
            raise
        self._local_lease_lost = False  # some node's local tier lost its lease (agreed)
        t_start = time.time()
        # Each tier's link (``TierLink``): the local tier decides its saves over the whole
        # job (every node saves the same local steps, skips and waits alike), holds its
        # node's share, and persists the durable tier's copy staged in the same step.
        self._durable_link = TierLink("durable")
        self._local_link = TierLink("local", agreement=self._world,
                                    span=node_span(self.node_rank, self._node_of_rank),
                                    source=self._durable_link,
                                    on_started=self._local_started)
        self.durable = CheckpointManager(root, options, events=self.events,
                                         tier=self._durable_link)
        local_events = EventBus(rank=self.rank)
        local_events.subscribe(self._forward_local)
        try:
            self.local = CheckpointManager(
                self.local_root, replace(options, cadence=local.cadence,
                                         retention=local.retention, storage_options=None),
                events=local_events, process_group=self._node_group, tier=self._local_link)
        except BaseException:
            self.durable.close(flush=False)  # its lease is not left behind
            self._free_groups()
            raise
        self.local_copies = local.copies if self.num_nodes > 1 else 1
        if local.copies > 1 and self.num_nodes == 1:
            log.warning("LocalTierOptions.copies=%d on a job of one node: there is no next "
                        "node to hold a copy; the local tier keeps one", local.copies)
        if self.local_copies > 1:
            try:
                self._copies = PeerCopies(
                    self.local, node=self.node_rank,
                    node_of_rank=self._node_of_rank, world=self._world, events=self.events,
                    options=options)
            except BaseException:
                self.local.close(flush=False)
                self.durable.close(flush=False)
                self._free_groups()
                raise
        # Did the durable tier count this start as a failure? (Rank 0's history, the same
        # on every rank.) If the resume loads from the local tier, the local tier survived
        # it: not a failure of the durable tier's class.
        self._started_at = t_start - 1.0
        times = self.durable.history.failure_times
        self._durable_failure_now = bool(self._world.broadcast(  # rank 0's clock recorded it
            bool(times) and times[-1] >= self._started_at))
        self._resumed: ResumeInfo | None = None
        # One run for the whole job (:mod:`ckpt.root.lineage`): every node's local versions
        # and the durable ones record the durable tier's (the same on every rank).
        self._local_link.adopt_run(self.durable.lineage)

    def _forward_local(self, ev: Event) -> None:
        """The local tier's events, renamed ``local_<kind>`` (with ``tier="local"``): the
        durable tier's metrics and alerts (checkpoint age, failed saves) must not be fed by
        local saves, which would hide a durable tier that stopped committing."""
        fields = {k: v for k, v in ev.fields.items() if k != "tier"}
        self.events.emit(LOCAL_PREFIX + ev.kind, ev.step, tier="local", **fields)

    # -- the base's members that are the durable tier's -------------------------------------
    @property
    def store(self) -> CheckpointStore:
        return self.durable.store

    @property
    def storage(self) -> Storage:
        return self.durable.storage

    @property
    def cadence(self) -> CadencePolicy | None:
        return self.durable.cadence

    @property
    def history(self) -> FailureHistory:
        return self.durable.history

    def save_history(self) -> None:
        self.durable.save_history()

    @property
    def lineage(self) -> Lineage:
        """The job's lineage: both tiers' versions record it."""
        return self.durable.lineage

    @property
    def newest_committed_step(self) -> int | None:
        return self.durable.newest_committed_step

    def all_steps(self) -> list[int]:
        """The durable tier's committed steps (a local step lives on its nodes only; this
        node's: ``local.all_steps()``)."""
        return self.durable.all_steps()

    @property
    def resumed(self) -> ResumeInfo | None:
        """Where the newest :meth:`load_latest` loaded from: ``tier`` ``"local"`` (``where``
        this node's local root) or ``"durable"``."""
        return self._resumed

    @property
    def lease_lost(self) -> bool:
        """Either tier lost its lease (agreed by every rank at a save)."""
        return self.durable.lease_lost or self.local.lease_lost or self._local_lease_lost

    def check_lease(self) -> bool:
        """Collective: :meth:`CheckpointManager.check_lease` of both tiers."""
        durable = self.durable.check_lease()
        self._local_lease_lost = self._world.any(self.local.check_lease()
                                                 or self._local_lease_lost)
        return durable or self._local_lease_lost

    def in_flight(self) -> bool:
        return self.durable.in_flight() or self.local.in_flight()

    def prepare(self, state: dict[str, Any]) -> None:
        """Allocate both tiers' staging buffers now."""
        self.durable.prepare(state)
        self.local.prepare(state)

    # -- saving ------------------------------------------------------------------------------
    def maybe_save(self, step: int, state: dict[str, Any], *,
                   user_metadata: dict[str, Any] | None = None,
                   attachments: dict[str, Any] | None = None) -> bool:
        """Call after every training step: saves each tier that is due (one stall when both
        are: the local tier persists the durable tier's copy). Returns True if a save of
        either tier was started."""
        durable = self.durable.maybe_save(step, state, user_metadata=user_metadata,
                                          attachments=attachments)
        local = self.local.maybe_save(step, state, user_metadata=user_metadata,
                                      attachments=attachments)
        return durable or local

    def save(self, step: int, state: dict[str, Any], *, block: bool = False,
             force: bool = False, user_metadata: dict[str, Any] | None = None,
             attachments: dict[str, Any] | None = None) -> bool:
        """Save ``step`` to both tiers now (collective): the durable tier stages and the
        local tier persists the same copy, one stall. ``block`` waits for both to commit.
        Returns True if either save was started. On several nodes each node's local save
        holds its share (a tensor sharded across nodes in part). One tier alone:
        ``durable.save`` or ``local.save``."""
        started_durable = self.durable.save(step, state, user_metadata=user_metadata,
                                            force=force, attachments=attachments)
        started_local = self.local.save(step, state, user_metadata=user_metadata,
                                        force=force, attachments=attachments)
        if block:
            for mgr, started in ((self.local, started_local), (self.durable, started_durable)):
                if started:
                    mgr.wait(raise_errors=mgr.options.raise_on_failure)
        return started_durable or started_local

    def _local_started(self, step: int, outcome) -> None:
        """The local tier started saving ``step`` (on every node alike: its decisions are
        agreed over the job): each node's coordinator queues the copy of it to the next
        node, in the same rounds on every node."""
        if self._copies is not None:
            self._copies.queue(step, outcome)

    @property
    def lease_lost_url(self) -> str | None:
        """The root whose lease this job lost (durable first), or None."""
        if self.durable.lease_lost:
            return self.durable.storage.url
        return self.local.storage.url if self.local.lease_lost or self._local_lease_lost \
            else None

    def wait(self, raise_errors: bool = True) -> Manifest | None:
        """Wait for both tiers' in-flight saves (and the copies of local saves to the next
        node); returns the durable tier's ``wait()``."""
        self.local.wait(raise_errors=False)
        if self._copies is not None:
            self._copies.wait()
        return self.durable.wait(raise_errors=raise_errors)

    # -- loading -----------------------------------------------------------------------------
    def load_latest(self, state: dict[str, Any], *, step: int | None = None,
                    strict: bool = True, ignore_keys: tuple[str, ...] = (),
                    raise_if_all_damaged: bool = False,
                    extra_state: Callable[[Manifest], dict[str, Any]] | None = None
                    ) -> Manifest | None:
        """Resume from the newest checkpoint, of either tier, that verifies on every rank.

        A local step counts only when it is committed on every node and loads on every rank;
        at the same step the local tier is tried first. ``step``: load that durable step
        (as ``CheckpointManager.load_latest``). Afterwards, local steps newer than the one
        loaded are deleted on every node and durable ones un-committed (they could not be
        saved again, and would be resumed from next time), and each tier's cadence counts
        from its newest step not after it. :attr:`resumed` says which tier was loaded. Other
        arguments: as for ``CheckpointManager.load_latest``.
        """
        # Each tier loads without continuing the run: _after_load does it once for both.
        options = dict(strict=strict, ignore_keys=ignore_keys, extra_state=extra_state)
        links = {"local": self._local_link, "durable": self._durable_link}
        self.wait(raise_errors=False)  # no save may persist from buffers a load borrows
        if step is not None:
            manifest = links["durable"].load(state, step, **options)
            self._after_load(manifest, "durable", set(), {step})
            return manifest
        # The durable root's listing and run log (rank 0's): the job's current trajectory
        # judges the versions of both tiers.
        listed, runs = self._world.broadcast(
            ([int(s) for s in self.durable.store.committed_steps()],
             read_runs(self.durable.storage)) if self.rank == 0 else None)
        durable_steps, trajectory = set(listed), Trajectory(runs)
        local_steps = set(self._common_local_steps(max(durable_steps, default=None)))
        walked = walk_newest(
            # Local first: at a step both tiers hold, the local one is tried first. Any error
            # of the local tier falls back (``tolerant``); the durable tier's as for
            # ``ckpt.load_latest``.
            [Candidate(s, self.local.store, "local", tolerant=True) for s in sorted(local_steps)]
            + [Candidate(s, self.durable.store, "durable") for s in sorted(durable_steps)],
            check="size" if self.options.verify in ("full", "size") else "none",
            load=lambda c, _: links[c.tier].load(state, c.step, **options),
            agreement=self._world, trajectory=trajectory,
            on_fallback=lambda c, message: self.events.emit("load_fallback", c.step,
                                                            reason=message, tier=c.tier))
        if raise_if_all_damaged:
            walked.raise_if_all_damaged(
                f"{self.durable.storage.describe()} and local tier {self.local_root}")
        self._after_load(walked.manifest, walked.candidate.tier if walked.candidate else None,
                         local_steps, durable_steps)
        return walked.manifest

    def _common_local_steps(self, newest_durable: int | None) -> list[int]:
        """Local steps committed on every node by one run (the same list on every rank):
        each node's coordinator lists its root once with the run of each step (and, with
        copies on the next node, the copies it holds), the lists are gathered over the tier
        group. A step whose versions on different nodes (or copies) come from different
        runs is no candidate (:func:`ckpt.format.lineage.same_run`): a node whose newer
        steps could not be deleted after a resume went back past them still holds the
        abandoned trajectory's, and must never be combined with the current one's. With
        copies, a node lacking a step that every node holds, itself or through its
        successor, gets it back first (``PeerCopies.restore``: the newest such step not older
        than ``newest_durable``)."""
        mine: dict[str, Any] | None = None  # None: not a node's coordinator, no listing
        if self.local.rank == 0:
            try:
                own = runs_of_steps(self.local.store)
            except Exception as exc:  # noqa: BLE001 - an unreadable local tier is an empty one
                log.warning("local tier %s unreadable, not used: %s", self.local_root, exc)
                own = []
            mine = {"node": self.node_rank, "own": own,
                    "copies": self._copies.listing() if self._copies else None}
        if not self.distributed:
            return [s for s, _ in mine["own"]] if mine else []
        lists = self._world.all_gather(mine)  # live peers' lists, no storage
        nodes = [d for d in lists if d is not None]
        mixed = mixed_steps([d["own"] for d in nodes]
                            + [d["copies"] for d in nodes if d["copies"] is not None])
        for step in sorted(mixed, reverse=True):
            message = (f"checkpoint step {step} of the local tier is not usable (its versions "
                       f"on the nodes come from different runs: {mixed[step]}; a resume "
                       f"went back past one of them); falling back to an earlier one")
            log.warning("%s", message)
            self.events.emit("load_fallback", step, reason=message, tier="local")
        own_steps = {d["node"]: {s for s, _ in d["own"]} - set(mixed) for d in nodes}
        if self._copies is not None:
            own_steps = self._copies.restore(
                own_steps, {d["node"]: None if d["copies"] is None
                            else [s for s, _ in d["copies"] if s not in mixed]
                            for d in nodes},
                newest_durable, on_failed=self._restore_failed)
        return sorted(set.intersection(*own_steps.values()))

    def _restore_failed(self, step: int, message: str) -> None:
        """A local step some node could not get back from its successor's copy: passed
        over on every rank, as the walk passes over a damaged one."""
        log.warning("%s", message)
        self.events.emit("load_fallback", step, reason=message, tier="local")

    def _after_load(self, manifest: Manifest | None, tier: str | None,
                    local_steps: set[int], durable_steps: set[int]) -> None:
        step = manifest.step if manifest is not None else -1
        self._resumed = None if manifest is None else ResumeInfo(
            step, tier, (self.local if tier == "local" else self.durable).storage.url)
        for link in (self._durable_link, self._local_link):
            link.resumed_at(self._resumed)  # not a candidate the walk passed over
        if tier == "local" and self._durable_failure_now:
            # The local tier survived the failure that restarted the job: no node was lost,
            # and the durable tier's interval follows node losses only.
            self._durable_link.retract_failure(since=self._started_at)
            self._durable_failure_now = False
            self.events.emit("failure_reclassified", step, tier="durable",
                             reason="local tier intact: not a node loss")
        # A new run begins, for both tiers: recorded in the durable root before anything
        # newer than ``step`` is un-committed or deleted (so that what cannot be is still
        # never taken for this trajectory's, on any node).
        self.start_run(manifest, tier=tier)
        if manifest is not None:
            self.durable.uncommit_newer(step)
            now = time.monotonic()
            for mgr, steps in ((self.durable, durable_steps), (self.local, local_steps)):
                if mgr.cadence is not None:
                    # A tier's next save is one interval after its own newest checkpoint.
                    # (Without one: from the step resumed.)
                    mgr.cadence.record_saved(max((s for s in steps if s <= step),
                                                 default=step), now)
        self._drop_newer_local(step)

    def start_run(self, parent: Manifest | None, *, tier: str | None = None) -> Lineage:
        """One run for the whole job: recorded in the durable root's run log (the one both
        tiers' resumes read, :meth:`load_latest` here), naming the durable steps newer than
        ``parent`` it goes back past; the local tier saves as the same run on every node
        (its local steps newer than a resumed one are deleted by the resume instead)."""
        lineage = self.durable.start_run(parent, tier=tier)
        self._local_link.adopt_run(lineage)
        return lineage

    def uncommit_newer(self, step: int) -> list[int]:
        """The durable tier's :meth:`CheckpointManager.uncommit_newer` (returned); the local
        steps newer than ``step`` are deleted on every node instead, with their copies on
        the next node (``load_latest`` does both; -1, a deliberate fresh start: all of
        them, so that the new run saves those steps again in both tiers)."""
        done = self.durable.uncommit_newer(step)
        self._drop_newer_local(step)
        return done

    def _drop_newer_local(self, step: int) -> None:
        """Each node's coordinator deletes its local steps newer than ``step``, and the
        copies it holds of them: they could not be saved again, and the next resume would
        jump onto them. Step by step (``Lifecycle.delete_newer``): one that cannot be
        deleted (a damaged manifest, a storage error) is reported and the others still go;
        what is left is of an abandoned run, which the run log and the same-run rule keep
        from ever being resumed from."""
        if self.local.rank == 0:
            since = f"the resumed step {step}" if step >= 0 else "a deliberate fresh start"
            for newer, exc in self.local.life.delete_newer(step):
                if exc is None:
                    self.events.emit("local_retention_deleted", newer, tier="local",
                                     reason=f"newer than {since}")
                elif newer is None:
                    log.warning("could not list local steps newer than %d in %s: %s", step,
                                self.local_root, exc)
                else:
                    log.warning("could not delete local step %d (newer than %s) in %s: %s; "
                                "it belongs to an abandoned run and is never resumed from",
                                newer, since, self.local_root, exc)
        if self._copies is not None:
            self._copies.drop_newer(step)

    # -- shutdown ----------------------------------------------------------------------------
    def close(self, *, flush: bool = True) -> None:
        """Close both tiers (local first: it may persist from the durable tier's buffers)."""
        try:
            try:
                self.local.close(flush=flush)
            finally:
                if self._copies is not None:  # its rounds wait for the local saves
                    self._copies.close()
        finally:
            self.durable.close(flush=flush)
            self._free_groups()

    def _free_groups(self) -> None:
        """Free the job-wide group of the tier logic and the node group (each tier frees
        its own)."""
        groups, self._group, self._node_group = (self._group, self._node_group), None, None
        if self._copies is not None:
            self._copies.free_group()
        self._world.close()
        freed(self)
        destroy_groups(groups)
