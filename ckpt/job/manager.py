"""CheckpointManager: cadence, asynchronous saves, retention, lease and resume for one job.

Contract (which ranks call what): every rank of the job constructs the manager (it creates
two gloo process groups, collectively) and calls ``maybe_save``/``save``/``load_latest``/
``close`` at the same points with the same step. Decisions that could differ between ranks
(a time-based cadence, whether the previous save is still in flight) are agreed with a tiny
all-reduce on the manager's own control group, on the calling (main) thread. Background
persistence runs ``torch.distributed.checkpoint`` on a second, separate group, used only by
the background thread, so it never interleaves with collectives of the training loop.

A save: ``stage`` (copy into reused host buffers; the only stall) -> background ``persist``
(parallel per-rank file writes with checksums) -> coordinator commits the manifest ->
retention. At most one save is in flight; when another is due first, ``busy`` decides:
``"skip"`` (counted, reported) or ``"wait"``.

Failures: a storage error on any rank fails that attempt on every rank (DCP gathers each
rank's outcome before the commit and broadcasts the result), so all ranks retry or give up
together; nothing is committed unless every rank wrote its files. The commit is refused
(``SaveAbandoned``, on every rank alike) after ``close(flush=False)``, and does not count
(``LeaseLostError``) when the write lease was taken by another job: every folder
transition goes through :mod:`ckpt.root.lifecycle`, which fences such a writer off. ``close``
releases the lease and frees the two private groups.

This module orchestrates, stages and resumes; each other part has its own home: the agreed
decisions of a save step (:mod:`ckpt.job.gate`), the staged copy and the persist thread
(:mod:`ckpt.job._inflight`), the background write (:mod:`ckpt.job.persist`), the commits and
the bookkeeping after each (:mod:`ckpt.job._commits`), the claim on the root: lease, cleanup
and failure history (:mod:`ckpt.job._claim`), the walk to the newest checkpoint that
verifies (:func:`ckpt.root.walk_newest`, through :func:`ckpt.dcp.api.load_latest`) and the
private groups (:mod:`ckpt.ranks.groups`).

Size: one object, the manager of one root: its save path (gate, staging, persist), its
resume path (walk, un-commit newer) and its lease share its fields; the one-caller helpers
were folded back into it on purpose, and what stands alone is in its own module (gate,
persist, retention, _claim, _commits, _inflight). :class:`TierLink`, the one way a
``TieredCheckpointManager`` reaches a manager's save and resume state, lives beside it for
that reason.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import torch.distributed as dist

from ckpt.cadence import CadencePolicy, FailureHistory, StepTimes, parse_interval
from ckpt.dcp import SavePlanCache, SaveRequest, StagingBuffers, api, check_attachments
from ckpt.errors import CheckpointError, LeaseLostError
from ckpt.events import EventBus
from ckpt.format import Lineage, Manifest, Span, new_run_id, parent_of, step_dirname
from ckpt.job._claim import RootClaim
from ckpt.job._commits import Commits
from ckpt.job._inflight import InflightSave, StagedCopy
from ckpt.job._writer_process import WriterProcess
from ckpt.job.checkpointer import Checkpointer, ResumeInfo
from ckpt.job.gate import Decision, SaveGate, SaveInputs
from ckpt.job.options import ManagerOptions, with_policies
from ckpt.job.persist import Persister
from ckpt.job.retention import KeepLast, RetentionPolicy, record_retention
from ckpt.ranks import Agreement, destroy_groups, free_at_exit, freed, private_groups
from ckpt.root import CheckpointStore, Lease, Lifecycle, record_run
from ckpt.storage import Storage

__all__ = ["CheckpointManager", "TierLink"]

log = logging.getLogger(__name__)


class CheckpointManager(Checkpointer):
    """Checkpoint a training job under ``root``; resume it from the newest valid checkpoint.

    Args:
        root: local path or fsspec URL (``s3://bucket/prefix``), or a ``Storage``.
        options: how it saves, keeps and loads (:class:`~ckpt.job.options.ManagerOptions`:
            each field with its default and its check; default ``ManagerOptions()``).
        cadence, retention, busy: ``options.cadence``, ``options.retention`` and
            ``options.busy`` as keywords (give each once: here or in ``options``).
        events: the bus its events go to (default: a new one).
        process_group: the ranks whose state this manager checkpoints under ``root``
            (default: the world). Its first rank coordinates (lease, commit, retention). A
            subgroup is how each node checkpoints its own ranks to a node-local root
            (``ckpt.job.tiers``); every rank of the world then constructs a manager at once.
        tier: given by a ``TieredCheckpointManager`` to each of its two managers (its link
            to them, :class:`TierLink`); None for a manager of its own.

    Failures are never silent: a save that fails after ``options.max_attempts`` emits a
    final ``save_failed`` event and an error log line; its folder is never committed.
    """

    def __init__(self, root: str | Storage, options: ManagerOptions | None = None, *,
                 cadence: CadencePolicy | str | None = None,
                 retention: Sequence[RetentionPolicy] | None = None,
                 busy: str | None = None, events: EventBus | None = None,
                 process_group=None, tier: TierLink | None = None):
        options = with_policies(options or ManagerOptions(), "CheckpointManager",
                                cadence=cadence, retention=retention, busy=busy)
        self.options = options
        self.storage = root if isinstance(root, Storage) else Storage(
            root, dict(options.storage_options) if options.storage_options else None)
        self.storage.makedirs("")  # the lease and the first save need the root to exist
        # A commit's marker goes with the next retention's deletions (Commits.record).
        self.life = Lifecycle(self.storage, defer_marker_removal=True)
        self.store = CheckpointStore(self.storage, lifecycle=self.life)
        self.distributed = dist.is_available() and dist.is_initialized()
        # The rank within the checkpointed group: rank 0 of it coordinates (lease, commit).
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.world_size = dist.get_world_size(process_group) if self.distributed else 1
        self.events = events or EventBus(rank=dist.get_rank() if self.distributed else 0)
        self.cadence: CadencePolicy | None = (
            parse_interval(options.cadence) if isinstance(options.cadence, (str, int))
            else options.cadence)
        self.staging = StagingBuffers(budget_bytes=options.staging_budget_bytes)
        self._slot = InflightSave()  # the persist thread and the save it runs
        self._abandon = threading.Event()
        self.step_times = StepTimes()
        self.num_skipped = 0
        self.num_saves = 0
        self.lease_lost = False  # agreed on every rank at a save
        self._tier = tier
        # Where the state was loaded from (``load_latest``), and the steps this manager
        # committed: a committed step among these holds this run's state, so a forced save
        # of it has nothing to do; any other committed step belongs to an earlier run.
        self._resumed: ResumeInfo | None = None
        self._saved_steps: set[int] = set()
        self._warned_no_cadence = False
        self._closed = False
        # Two private gloo groups: one for main-thread agreement, one for the background
        # persist (DCP's collectives). Never the training group from a background thread.
        self._ctl_group, self._bg_group = private_groups(process_group, self.distributed)
        self._ctl = Agreement(self._ctl_group)  # the calling (training) thread only
        # This manager's own save plans, reused while the state's layout does not change
        # (ckpt.dcp.plancache); another manager in the process (the other tier) has its own.
        self.save_plan_cache = SavePlanCache()
        self._persister = Persister(
            SaveRequest(self.life, layout=dict(options.layout or {}),
                        span=tier.span if tier is not None else None,
                        num_threads=options.num_threads, save_plan_cache=self.save_plan_cache),
            self.events, self._bg_group, rank=self.rank, max_attempts=options.max_attempts,
            retry_backoff_seconds=options.retry_backoff_seconds, abandon=self._abandon)
        if options.writer == "process":  # the same saves, in a writer process
            self._persister = WriterProcess(self._persister, world_size=self.world_size,
                                            agreement=self._ctl, staging=self.staging,
                                            rendezvous_seconds=options.lease_ttl_seconds)
        if self.distributed:
            free_at_exit(self._free_groups)  # freed at exit if close() is never called
        self.last_staged: StagedCopy | None = None  # the newest copy this manager staged
        self._staged_now: StagedCopy | None = None  # the copy staged by this save call
        self.num_stages = 0  # copies into the staging buffers (stalls); reused ones not counted
        self._prepare_started = False
        # Rank 0 takes the lease (fencing off earlier writers), removes dead attempts'
        # leftovers and reads the job's failure history; every rank learns both. One history
        # per job, shared with the cadence (which accumulates uptime in it).
        self._claim = RootClaim(self.life, self._ctl, self.events, coordinator=self.rank == 0,
                                use_lease=options.use_lease,
                                ttl_seconds=options.lease_ttl_seconds,
                                job_name=options.job_name, fingerprint=options.job_fingerprint)
        if self.cadence is not None:
            self.cadence.history = self.history
        self.save_history()
        retention = [KeepLast(3)] if options.retention is None else list(options.retention)
        self._commits = Commits(self.events, self.store, self._claim, retention,
                                coordinator=self.rank == 0,
                                carry_out=self._persister.carry_out
                                if options.writer == "process" else None)
        if self.rank == 0 and (self.lease is None or self.lease.held):
            record_retention(self.store, retention)  # for `ckpt list` (best-k reasons)
        # A two-tier job's local tier decides over the whole job (every node saves the same
        # local steps); any other manager over its own ranks.
        self._gate = SaveGate(tier.agreement if tier is not None and tier.agreement
                              else self._ctl, self.life, self.rank == 0)
        if tier is not None:
            tier.manager = self
        # The run this manager saves as (:mod:`ckpt.root.lineage`): a fresh one, until a
        # load begins another (``start_run``). The same id on every rank.
        self._run_base = self._ctl.broadcast(new_run_id() if self.rank == 0 else None)
        self._num_runs = 0
        self.life.lineage = Lineage(self._run_base)

    # -- the claim on the root and the commits, as callers see them ---------------------------
    @property
    def lease(self) -> Lease | None:
        """The write lease (rank 0, with ``use_lease``; else None)."""
        return self._claim.lease

    @property
    def owner(self) -> str | None:
        return self._claim.owner

    @property
    def history(self) -> FailureHistory:
        """The job's failure history (for the auto cadence's MTBF), the same on every rank."""
        return self._claim.history

    def save_history(self) -> None:
        """Write the failure history now (rank 0, holding the lease); saves also do. For a
        caller that changed ``history`` (``ckpt.job.tiers`` takes back a failure that was not a
        node loss)."""
        self._claim.save_history()

    def check_lease(self) -> bool:
        """Collective: is the write lease lost? Agreed by every rank now, not at the next
        save: a save's checks found it held, and then its commit found it taken (the last
        save of a run). Sets :attr:`lease_lost`; returns it."""
        if self._ctl.any(self._claim.lost):
            self.lease_lost = True
        return self.lease_lost

    @property
    def lease_lost_url(self) -> str | None:
        """The root whose lease this job lost, or None (as ``TieredCheckpointManager``'s)."""
        return self.storage.url if self.lease_lost else None

    @property
    def retention(self) -> list[RetentionPolicy]:
        """The retention policies applied after each commit (rank 0)."""
        return self._commits.retention

    @property
    def newest_committed_step(self) -> int | None:
        """The newest step this manager committed or found committed (every rank)."""
        return self._commits.newest_step

    @property
    def last_committed(self) -> Manifest | None:
        """The newest manifest this manager committed (rank 0; None elsewhere)."""
        return self._commits.last_manifest

    # -- saving ------------------------------------------------------------------------------
    def prepare(self, state: dict[str, Any]) -> None:
        """Allocate staging buffers for ``state`` now (``maybe_save`` also does it, in the
        background, on its first call), so the first save only copies."""
        self._prepare_started = True
        self.staging.prepare(api.resolve_state(state))

    def in_flight(self) -> bool:
        """A save is persisting in the background (local)."""
        return self._slot.running()

    def maybe_save(self, step: int, state: dict[str, Any], *,
                   user_metadata: dict[str, Any] | None = None,
                   attachments: dict[str, Any] | None = None) -> bool:
        """Call after every training step; saves when the cadence policy says so.

        Returns True if a save was started (or completed, when not async). ``attachments``:
        as for :meth:`save`. Without a cadence it never saves, and says so once.
        """
        if self._closed:
            raise RuntimeError("CheckpointManager.maybe_save() called after close()")
        if self.cadence is None and not self._warned_no_cadence:
            self._warned_no_cadence = True
            log.warning("CheckpointManager(%s) has no cadence, so maybe_save() never saves: "
                        "pass cadence= (e.g. '500' steps, '10m', 'auto'), or call save() "
                        "yourself", self.storage.url)
        self._observe_step(state)
        decision = self._decide(step, requested=False)
        if not decision.due:
            # No collective follows, so a rank-local re-raise cannot leave a peer waiting.
            self._raise_pending_failure()
            return False
        return self._start(step, state, decision, user_metadata=user_metadata,
                           attachments=attachments)

    def save(self, step: int, state: dict[str, Any], *, block: bool = False,
             force: bool = False, user_metadata: dict[str, Any] | None = None,
             attachments: dict[str, Any] | None = None) -> bool:
        """Save now (collective). ``force`` waits for an in-flight save instead of skipping.

        Returns True when a save was started, False when it was skipped (reported as a
        ``save_skipped`` event). With ``force`` a save is never skipped: it returns True when
        it started, or when ``step`` is already committed by this manager (saved by it, or
        the step it resumed from: its state is this run's), and otherwise raises
        ``FileExistsError`` when ``step`` is committed by an earlier run (resume from it with
        ``load_latest``, which also un-commits newer steps, or save another step) and
        ``LeaseLostError`` when another job took the write lease. Every rank takes the same
        branch: whether the previous save is in flight, whether ``step`` is committed,
        whether the lease is lost and whether a failure is pending are agreed in one
        all-reduce first (:class:`~ckpt.job.gate.SaveGate`, as for ``maybe_save``).
        ``attachments``: small files kept with the checkpoint (``ckpt.save``'s); bytes are
        taken now, a path is read when the save persists.
        """
        if self._closed:
            raise RuntimeError("CheckpointManager.save() called after close()")
        check_attachments(attachments)  # the same on every rank: before any collective
        return self._start(step, state, self._decide(step, requested=True), block=block,
                           force=force, user_metadata=user_metadata, attachments=attachments)

    def _observe_step(self, state: dict[str, Any]) -> None:
        """One training step ended: its time goes to the step times and, as uptime, to the
        cadence (or, without one, to the history); the first one starts allocating the
        staging buffers in the background, so that even the first save only copies."""
        dt = self.step_times.observe(time.monotonic(), busy=self.in_flight())
        if dt is not None:
            if self.cadence is None:
                self.history.add_uptime(dt)
            else:  # the cadence adds the uptime to the shared history itself
                self.cadence.record_step(dt)
        if self.num_saves == 0 and not self._prepare_started:
            self._prepare_started = True
            self._slot.executor.submit(self.staging.prepare, api.resolve_state(state))

    def _decide(self, step: int, *, requested: bool) -> Decision:
        """The gate's decision for ``step`` (collective as :meth:`SaveGate.decide` says)."""
        self._staged_now = None  # a copy another tier may persist: only this call's
        decision = self._gate.decide(step, SaveInputs(
            self.cadence, requested, busy=self.in_flight(), lease_lost=self._claim.lost,
            pending_failure=self.options.raise_on_failure and self._slot.failure is not None,
            last_committed=self.last_committed))
        if self._tier is not None:
            self._tier.due_step = step if decision.due else None
        return decision

    def _use_slot(self, step: int) -> None:
        """The save due at ``step`` happened, or was skipped: either way its slot is used, so
        the cadence counts the next interval from here (every rank alike)."""
        if self.cadence is not None:
            self.cadence.record_saved(step, time.monotonic())

    def _start(self, step: int, state: dict[str, Any], decision: Decision, *,
               block: bool = False, force: bool = False,
               user_metadata: dict[str, Any] | None = None,
               attachments: dict[str, Any] | None = None) -> bool:
        """Act on a due ``decision``: skip, wait or start the save of ``step``."""
        assert decision.checks is not None
        attached = check_attachments(attachments)
        busy, exists, lost, failed = decision.checks
        if failed:
            self._slot.raise_agreed_failure()
        if lost:
            # Said once (by the coordinator), at the first save skipped: each later one is
            # an event only.
            said, self.lease_lost = self.lease_lost, True
            self._use_slot(step)  # one skip per due save, not one per step after it
            self.events.emit("save_skipped", step, reason="lease lost", outcome="skipped")
            if not said and self.rank == 0:
                log.error("not saving step %d nor any later step: the write lease on %s was "
                          "lost to another job, whose checkpoints count there now (this "
                          "job's would not)", step, self.storage.url)
            if force:
                raise LeaseLostError(f"step {step} not saved: another job took over the "
                                     f"write lease on {self.storage.url}, so this job's "
                                     f"saves no longer count")
            return False
        ours = step in self._saved_steps or (  # the same on every rank
            self._resumed is not None and step == self._resumed.step)
        if exists:
            self._commits.found(step)
            if force and ours:  # this run's state is committed at this step: done
                return True
            self.events.emit("save_skipped", step, reason="already committed",
                             outcome="skipped")
            if force:
                raise FileExistsError(
                    f"step {step} not saved: {self.storage.describe(step_dirname(step))} is "
                    f"committed by an earlier run, and checkpoints are never overwritten. "
                    f"Resume from it (load_latest, which also un-commits newer steps), save "
                    f"under another step, or roll it back first (`ckpt rollback`)")
            return False
        if busy:
            if self.options.busy == "skip" and not force:
                self._use_slot(step)  # one skip per due save, not one per step after it
                self.num_skipped += 1
                self.events.emit("save_skipped", step, reason="previous save in flight",
                                 outcome="skipped", in_flight_step=self._slot.step,
                                 num_skipped=self.num_skipped)
                log.warning("checkpoint at step %d skipped: the save of step %s is still "
                            "persisting (%d skipped so far)", step, self._slot.step,
                            self.num_skipped)
                return False
            t0 = time.monotonic()
            self._slot.join()
            self.events.emit("save_waited", step, wait_seconds=time.monotonic() - t0,
                             in_flight_step=self._slot.step)
            # The save waited for may have failed; its outcome is the same on every rank.
            self._raise_pending_failure()
            if step in self._saved_steps:  # the save waited for was this step's: committed
                if not force:
                    self.events.emit("save_skipped", step, reason="already committed",
                                     outcome="skipped")
                return force
        t0 = time.monotonic()
        first = self.num_saves == 0
        # Another tier's copy staged in this same call costs no stall here (two tiers);
        # the cadence still learns what staging cost.
        reuse = self._tier.reusable(step) if self._tier is not None else None
        copy = self._stage(state, step) if reuse is None else reuse
        self.num_saves += 1
        self.events.emit("save_staged", step, stall_seconds=0.0 if reuse else copy.stall_seconds,
                         bytes=copy.nbytes, first=first, reused=reuse is not None)
        self._use_slot(step)
        self.step_times.save_started()
        self._slot.start(step, self._persist, copy, dict(user_metadata or {}), attached, t0)
        if self._tier is not None:
            self._tier.started(step)
        # Over the staging budget the copy holds live tensors: training waits for the save.
        if block or not self.options.async_save or copy.window_bytes is not None:
            self._slot.join()
            self._raise_pending_failure()
        return True

    def _stage(self, state: dict[str, Any], step: int) -> StagedCopy:
        """Copy ``state`` into the staging buffers (the stall, measured): the newest copy."""
        if self._tier is not None:
            self._tier.reclaim()  # another tier's save may still persist from the buffers
        t0 = time.monotonic()
        staged, nbytes = self.staging.stage(api.resolve_state(state))
        self.num_stages += 1
        self.last_staged = StagedCopy(step, staged, nbytes, time.monotonic() - t0,
                                      self.staging.wait_ready, self.staging.window_bytes)
        self._staged_now = self.last_staged
        return self.last_staged

    def _persist(self, copy: StagedCopy, user_metadata: dict[str, Any],
                 attachments: dict[str, Any] | None, t_start: float) -> Manifest | None:
        """Background thread: persist ``copy`` (with retries), then the bookkeeping of a
        commit (``Commits.record``)."""
        # On CUDA the copies into the staged buffers were only enqueued: wait for them here,
        # off the training thread, before a byte is read (their device time: copy_seconds).
        copy_seconds = copy.wait_ready()
        out = self._persister.run(copy.step, copy.staged, nbytes=copy.nbytes,
                                  stall=copy.stall_seconds, user_metadata=user_metadata,
                                  attachments=attachments,
                                  host_window_bytes=copy.window_bytes)
        if not out.committed:
            if out.error is not None:
                self._slot.failure = out.error
            return None
        self._saved_steps.add(copy.step)  # every rank learns the commit alike
        self._commits.record(out, copy, cadence=self.cadence, copy_seconds=copy_seconds,
                             t_start=t_start, slowdown=self.step_times.slowdown())
        return out.manifest

    def _raise_pending_failure(self) -> None:
        if self.options.raise_on_failure:
            self._slot.raise_failure()

    def wait(self, raise_errors: bool = True) -> Manifest | None:
        """Block until the in-flight save (if any) is committed or failed.

        Returns the committed manifest (on rank 0; None elsewhere or on failure). Re-raises
        the newest save's failure when ``raise_errors``.
        """
        return self._slot.wait(raise_errors)

    # -- loading -----------------------------------------------------------------------------
    @property
    def resumed(self) -> ResumeInfo | None:
        """Where the newest :meth:`load_latest` loaded from (None before one, or when it
        found nothing)."""
        return self._resumed

    def load_latest(self, state: dict[str, Any], *, step: int | None = None,
                    strict: bool = True, ignore_keys: tuple[str, ...] = (),
                    raise_if_all_damaged: bool = False,
                    extra_state: Callable[[Manifest], dict[str, Any]] | None = None
                    ) -> Manifest | None:
        """Resume: load ``step`` if given, else the newest checkpoint that verifies and
        belongs to the current trajectory (``ckpt.root.lineage``: never one a resume went
        back past).

        Returns the manifest loaded, or None when there is nothing to resume from
        (``raise_if_all_damaged``, ``extra_state``: see :func:`ckpt.dcp.api.load_latest`).
        Then the run continues from the step loaded: committed steps newer than it (damaged
        ones the walk fell back past, or all newer ones when ``step`` rewinds) are
        un-committed (:meth:`uncommit_newer`), so that this run saves those steps again and
        the next resume does not jump onto them; before that a new run is recorded
        (:meth:`start_run`), so that those steps cannot be taken for this trajectory's even
        when they cannot be un-committed. (A two-tier job does both once for both tiers.)
        """
        return self._load(state, step=step, strict=strict, ignore_keys=ignore_keys,
                          raise_if_all_damaged=raise_if_all_damaged,
                          extra_state=extra_state, continue_run=True)

    def _load(self, state: dict[str, Any], *, step: int | None, strict: bool,
              ignore_keys: tuple[str, ...], raise_if_all_damaged: bool,
              extra_state: Callable[[Manifest], dict[str, Any]] | None,
              continue_run: bool) -> Manifest | None:
        """:meth:`load_latest`; ``continue_run`` False: the caller records the run and
        un-commits newer steps (a two-tier job, once for both tiers)."""
        if self._closed:
            raise RuntimeError("CheckpointManager.load_latest() called after close()")
        t0 = time.monotonic()
        fallbacks: list[int] = []

        def fell_back(skipped: int, message: str) -> None:
            fallbacks.append(skipped)
            self.events.emit("load_fallback", skipped, reason=message)

        # Read into the staging buffers (saves need them anyway, already touched) unless a
        # save is persisting from them.
        scratch = None if self.in_flight() else self.staging
        if scratch is not None:
            self._staged_now = None  # the load overwrites what was staged
            scratch.prepare(api.resolve_state(state))
        options = dict(verify=self.options.verify, strict=strict,
                       process_group=self._ctl_group, num_threads=self.options.num_threads,
                       ignore_keys=ignore_keys, scratch=scratch)
        if step is not None:
            manifest = api.load_with_extra(state, self.storage, self.store.read_manifest(step),
                                           extra_state, **options)
        else:
            manifest = api.load_latest(state, self.storage, on_fallback=fell_back,
                                       raise_if_all_damaged=raise_if_all_damaged,
                                       extra_state=extra_state, **options)
        if manifest is None:
            self._resumed = None
            if continue_run:
                self.start_run(None)
            return None
        self._resumed = ResumeInfo(manifest.step, self._tier.name if self._tier else "durable",
                                   self.storage.url)
        if continue_run:
            self.start_run(manifest, tier="durable")
            self.uncommit_newer(manifest.step)
        # Resumed at a step, the cadence counts the next interval from there (a resumed run
        # saves at 40 and 50 after resuming at 30 with a cadence of 10).
        self._use_slot(manifest.step)
        seconds = time.monotonic() - t0
        self.events.emit("load_done", manifest.step, outcome="loaded", seconds=seconds,
                         bytes=manifest.total_bytes, verify=self.options.verify,
                         bytes_per_second=manifest.total_bytes / seconds if seconds > 0
                         else 0.0, num_fallbacks=len(fallbacks))
        return manifest

    @property
    def lineage(self) -> Lineage:
        """The lineage the versions this manager saves now record (the same on every rank)."""
        return self.life.lineage

    def start_run(self, parent: Manifest | None, *, tier: str | None = None) -> Lineage:
        """Begin a new run (``ckpt.root.lineage``): the state was just loaded from ``parent``
        (None: a fresh start); :meth:`load_latest` does it. Collective over the manager's
        group.

        Every version saved from now on records the new run and ``parent``. The coordinator
        first appends the run to the root's run log (``_lineage.json``; ``tier``: where
        ``parent`` was loaded from, as the log records it), naming the committed steps newer
        than ``parent`` that this run goes back past (``abandoned``): from then on no resume
        takes them, whether or not they can be un-committed or deleted. A failure to record
        raises on every rank: a run whose versions could not be told from an abandoned
        trajectory's must not save. Returns the new lineage.
        """
        self._num_runs += 1
        run = hashlib.sha256(f"{self._run_base}:{self._num_runs}".encode()).hexdigest()[:16]
        lineage = Lineage(run, None if parent is None
                          else parent_of(parent.step, parent.save_id, parent.lineage))
        self.life.lineage = lineage
        failed: Exception | None = None
        if self.rank == 0:
            try:
                record_run(self.storage, {
                    "run": lineage.run, "parent": lineage.parent, "job": self.options.job_name,
                    "tier": tier, "abandoned": self._abandoned_by(parent)})
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                failed = exc
        if self._ctl.any(failed is not None):
            raise failed or CheckpointError(
                f"rank 0 could not record the run in {self.storage.url} (its log says why)")
        return lineage

    def _abandoned_by(self, parent: Manifest | None, limit: int = 64) -> list[dict[str, Any]]:
        """Coordinator: the committed versions newer than ``parent`` (for the run log; a
        manifest that cannot be read is named by its step alone)."""
        since = parent.step if parent is not None else -1
        out = []
        for step in [s for s in self.store.committed_steps() if s > since][-limit:]:
            try:
                m = self.store.read_manifest(step)
                out.append({"step": step, "save_id": m.save_id,
                            "run": m.lineage.run if m.lineage is not None else None})
            except CheckpointError as exc:
                out.append({"step": step, "save_id": None, "run": None,
                            "problem": str(exc)[:300]})
        return out

    def uncommit_newer(self, step: int) -> list[int]:
        """Un-commit every committed step newer than ``step`` (-1: all of them, a deliberate
        fresh start); returns those un-committed (on the coordinator; [] elsewhere).
        Collective: the coordinator acts and every rank waits for it, so that no rank reads
        the store while it still shows them; a failure raises on every rank.

        Called after a resume (:meth:`load_latest` does it): left committed, a newer step
        would be wrong twice, since this run could not save it again (a committed step is
        never overwritten, so a finished run would end on a damaged or stale checkpoint) and
        the next resume would jump onto it. As with ``ckpt rollback`` nothing is deleted:
        each becomes a rolled-back version that ``ckpt restore --id`` brings back (a warning
        and a ``checkpoint_uncommitted`` event each); one damaged beyond reading is left as
        it is (it does not count anyway).
        """
        self._saved_steps = {s for s in self._saved_steps if s <= step}
        since = f"the step {step} resumed from" if step >= 0 else "a deliberate fresh start"
        done: list[int] = []
        failed: Exception | None = None
        if self.rank == 0:
            try:
                for newer, kept, exc in self.life.uncommit_newer(step):
                    if exc is not None:
                        log.warning("left checkpoint step %d as it is (%s)", newer, exc)
                        continue
                    log.warning("un-committed checkpoint step %d (newer than %s; kept as "
                                "rolled-back id %s): this run writes that step again", newer,
                                since, kept)
                    self.events.emit("checkpoint_uncommitted", newer, resumed_step=step)
                    done.append(newer)
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                failed = exc
        if self._ctl.any(failed is not None):
            raise failed or CheckpointError(
                f"rank 0 could not un-commit the checkpoints newer than step {step} under "
                f"{self.storage.url} (its log says why)")
        return done

    def all_steps(self) -> list[int]:
        """The committed steps under the root, ascending (any rank; reads storage, no
        collective). As ``ckpt list`` lists them: nothing is verified."""
        return self.store.committed_steps()

    def latest_step(self) -> int | None:
        """The newest committed step, or None (any rank; reads storage, no collective). The
        step :meth:`load_latest` resumes from unless it fails verification."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # -- shutdown ----------------------------------------------------------------------------
    def close(self, *, flush: bool = True) -> None:
        """Finish (``flush``) or abandon the in-flight save, then release the lease and
        free the staging buffers.

        An abandoned save is never committed: its leftovers are removed by a later run.
        Collective when a save is in flight (its remaining attempts involve every rank).
        With ``raise_on_failure``, a flushed save that failed is re-raised after cleanup.
        """
        if self._closed:
            return
        self._closed = True
        if not flush:
            self._abandon.set()
        try:
            self._slot.close()
        finally:
            try:  # the uptime since the last commit's write (written at most once a minute)
                self._claim.save_history()
            finally:
                self._claim.release()
            self._free_groups()
            # The persist thread is done with the staged copy (and so is another tier
            # that persisted ``last_staged``): free the host memory it took.
            self.last_staged = None
            self._persister.close()  # a writer process exits before its memory is freed
            self.staging.close()
        if flush:
            self._raise_pending_failure()

    def _free_groups(self) -> None:
        """Free the two private groups (a job may build several managers over its life):
        destroy them and drop every reference (``ckpt.ranks.groups`` says why both)."""
        groups, self._ctl_group, self._bg_group = (self._ctl_group, self._bg_group), None, None
        self._ctl.close()
        self._persister.group = None
        freed(self)
        if self.distributed:
            destroy_groups(groups)



class TierLink:
    """What a :class:`~ckpt.job.tiers.TieredCheckpointManager` and one of its two managers
    need of each other, and nothing of it on either's public surface.

    The tiered manager makes one per tier and passes it to the manager's constructor, which
    binds it (:attr:`manager`). ``name``: ``"durable"`` or ``"local"``. ``agreement``: what
    the manager's save gate decides over (the local tier: the whole job, so that every node
    saves the same local steps; None: the manager's own ranks). ``span``: the share of a
    job-wide checkpoint the local tier's versions hold on a job of several nodes
    (``ckpt.format.span``). ``source``: the durable tier's link, whose copy staged in the
    same step the local tier persists instead of staging its own (one stall for two saves).
    ``on_started(step, outcome)``: called when a save started (the copies on the next node
    follow the local tier's commits). Main thread only.
    """

    def __init__(self, name: str, *, agreement: Agreement | None = None,
                 span: Span | None = None, source: "TierLink | None" = None,
                 on_started: Callable[[int, Future | None], None] | None = None):
        self.name, self.agreement, self.span, self.source = name, agreement, span, source
        self.on_started = on_started
        self.manager: CheckpointManager | None = None  # bound by the manager
        self.due_step: int | None = None  # the newest step the gate found due
        self.borrower: CheckpointManager | None = None  # persists from this tier's buffers

    def reusable(self, step: int) -> StagedCopy | None:
        """The source tier's copy of ``step``, staged in this same call, to persist instead
        of staging (its owner then waits for this save before it stages again)."""
        src = self.source.manager if self.source is not None else None
        copy = src._staged_now if src is not None else None
        if copy is None or copy.step != step:
            return None
        self.source.borrower = self.manager
        return copy

    def reclaim(self) -> None:
        """Before this tier stages again: the other tier's save that persists from its
        buffers finishes first."""
        if self.borrower is not None and self.borrower.in_flight():
            self.borrower.wait(raise_errors=False)
        self.borrower = None

    def started(self, step: int) -> None:
        """A save of ``step`` started: tell the tiered manager."""
        if self.on_started is not None:
            self.on_started(step, self.manager._slot.future)

    def outcome(self) -> Future | None:
        """The newest save started, as a ``Future`` of its committed manifest (on the
        coordinator; None elsewhere and when it failed)."""
        return self.manager._slot.future

    def load(self, state: dict[str, Any], step: int, **options: Any) -> Manifest | None:
        """Load ``step`` of this tier without continuing the run from it (the tiered
        manager records the run and un-commits once, for both tiers)."""
        return self.manager._load(state, step=step, raise_if_all_damaged=False,
                                  continue_run=False, **options)

    def adopt_run(self, lineage: Lineage) -> None:
        """Save as the run ``lineage`` from now on (the other tier's, recorded in its run
        log: one run for both tiers), recording nothing here."""
        self.manager.life.lineage = lineage

    def resumed_at(self, info: ResumeInfo | None) -> None:
        """The job resumed from ``info`` (None: from nothing): this tier holds this run's
        state at its step too (a forced save of it is done), whichever tier it came from."""
        self.manager._resumed = info

    def retract_failure(self, since: float) -> bool:
        """Take back the failure this tier's history recorded at this start (at or after
        ``since``, Unix time) and write the history: it was not of this tier's class."""
        if not self.manager.history.retract_last_failure(since):
            return False
        self.manager.save_history()
        return True
