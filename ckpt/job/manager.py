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

This module orchestrates; each step is its own unit: the agreed decisions of a save step
(:mod:`ckpt.job.gate`), staging and reuse (:mod:`ckpt.job._manager_staging`), the persist
thread (:mod:`ckpt.job._inflight`, :mod:`ckpt.job.persist`), the bookkeeping after a commit
(:mod:`ckpt.job._manager_commit`), the lease (:mod:`ckpt.job._manager_lease`), the failure history
(:mod:`ckpt.cadence.history`), resume (:mod:`ckpt.job._manager_load`) and the private groups
(:mod:`ckpt.ranks.groups`).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import torch.distributed as dist

from ckpt.cadence import CadencePolicy, StepTimes, parse_interval, write_history
from ckpt.dcp import StagingBuffers, api, check_attachments
from ckpt.events import EventBus
from ckpt.format import Manifest
from ckpt.job._inflight import InflightSave
from ckpt.job._manager_commit import after_commit
from ckpt.job._manager_lease import claim_root
from ckpt.job._manager_load import load_for_manager
from ckpt.job._manager_staging import StagedCopy, stage_copy
from ckpt.job.gate import SaveGate, observe_step, report_busy_skip, report_lease_lost, use_slot
from ckpt.job.persist import Persister
from ckpt.job.retention import KeepLast, KeepPinned, RetentionPolicy
from ckpt.ranks import Agreement, destroy_groups, free_at_exit, freed, private_groups
from ckpt.root import CheckpointStore, Lifecycle, release_lease
from ckpt.storage import Storage

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Checkpoint a training job under ``root``; resume it from the newest valid checkpoint.

    Args:
        root: local path or fsspec URL (``s3://bucket/prefix``), or a ``Storage``.
        cadence: a ``CadencePolicy`` (see ``ckpt.cadence.policies``) or an interval string
            (``"auto"``, ``"100"`` steps, ``"300s"``); None saves only when asked.
        retention: policies deciding which older checkpoints to delete (default: keep last 3
            plus pinned); an empty list keeps everything.
        async_save: persist in the background (default) or block until committed.
        busy: ``"skip"`` or ``"wait"`` when a save is due while the previous one is in flight.
        verify: checksum mode on load: ``"full"``, ``"size"`` or ``"none"``.
        raise_on_failure: re-raise a background failure at the next call (default: only
            report it through events, logs and ``wait()``).
        max_attempts: attempts per save before it is reported failed.
        retry_backoff_seconds: pause before the second attempt (doubling, at most 5 s).
        process_group: the ranks whose state this manager checkpoints under ``root``
            (default: the world). Its first rank coordinates (lease, commit, retention). A
            subgroup is how each node checkpoints its own ranks to a node-local root
            (``ckpt.job.tiers``); every rank of the world then constructs a manager at once.

    Failures are never silent: a save that fails after ``max_attempts`` emits a final
    ``save_failed`` event and an error log line; its folder is never committed.
    """

    def __init__(self, root: str | Storage, *, storage_options: dict[str, Any] | None = None,
                 cadence: CadencePolicy | str | None = None, retention: Sequence[RetentionPolicy] | None = None,
                 async_save: bool = True, busy: str = "skip", verify: str = "full",
                 num_threads: int | None = None, use_lease: bool = True, lease_ttl_seconds: float = 60.0,
                 raise_on_failure: bool = False, max_attempts: int = 3,
                 retry_backoff_seconds: float = 0.5,
                 layout: dict[str, Any] | None = None, job_name: str | None = None,
                 job_fingerprint: str | None = None, process_group=None,
                 events: EventBus | None = None):
        if busy not in ("skip", "wait"):
            raise ValueError(f"busy={busy!r}: expected 'skip' or 'wait'")
        if max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        self.storage = root if isinstance(root, Storage) else Storage(root, storage_options)
        self.storage.makedirs("")  # the lease and the first save need the root to exist
        self.life = Lifecycle(self.storage)
        self.store = CheckpointStore(self.storage, lifecycle=self.life)
        self.distributed = dist.is_available() and dist.is_initialized()
        # The rank within the checkpointed group: rank 0 of it coordinates (lease, commit).
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.world_size = dist.get_world_size(process_group) if self.distributed else 1
        self.events = events or EventBus(rank=dist.get_rank() if self.distributed else 0)
        self.cadence = parse_interval(cadence) if isinstance(cadence, str) else cadence
        if retention is None:
            retention = [KeepLast(3), KeepPinned(self.store)]
        self.retention = list(retention)
        self.async_save = async_save
        self.busy = busy
        self.verify = verify
        self.num_threads = num_threads
        self.raise_on_failure = raise_on_failure
        self.layout = dict(layout or {})
        self.staging = StagingBuffers()
        self._slot = InflightSave()  # the persist thread and the save it runs
        self._abandon = threading.Event()
        self.step_times = StepTimes()
        self.num_skipped = 0
        self.num_saves = 0
        self.last_committed: Manifest | None = None
        self.newest_committed_step: int | None = None  # by this manager, known on every rank
        self.lease_lost = False  # agreed on every rank at a save
        self.resumed_tier: str | None = None  # a plain manager has one tier ("durable")
        self._closed = False
        # Two private gloo groups: one for main-thread agreement, one for the background
        # persist (DCP's collectives). Never the training group from a background thread.
        self._ctl_group, self._bg_group = private_groups(process_group, self.distributed)
        self._ctl = Agreement(self._ctl_group)  # the calling (training) thread only
        self._persister = Persister(
            self.life, self.events, Agreement(self._bg_group), self._bg_group, rank=self.rank,
            max_attempts=max_attempts, retry_backoff_seconds=retry_backoff_seconds,
            num_threads=num_threads, layout=self.layout, abandon=self._abandon)
        if self.distributed:
            free_at_exit(self)  # its groups are freed at exit if close() is never called
        self.last_staged: StagedCopy | None = None  # the newest copy this manager staged
        self.num_stages = 0  # copies into the staging buffers (stalls); reused ones not counted
        self._prepare_started = False
        # Rank 0 takes the lease (fencing off earlier writers), removes dead attempts'
        # leftovers and reads the job's failure history; every rank learns both. One history
        # per job, shared with the cadence (which accumulates uptime in it).
        self.lease, self.history = claim_root(
            self.storage, self._ctl, self.life, self.events, coordinator=self.rank == 0,
            use_lease=use_lease, ttl_seconds=lease_ttl_seconds, job_name=job_name,
            fingerprint=job_fingerprint)
        if self.cadence is not None:
            self.cadence.history = self.history
        self.save_history()
        self._gate = SaveGate(self._ctl, self.store, self.life, self.rank == 0)

    # -- failure history (for the auto cadence's MTBF) ---------------------------------------
    def save_history(self) -> None:
        """Write the failure history now (rank 0, holding the lease); saves also do. For a
        caller that changed ``history`` (``ckpt.job.tiers`` takes back a failure that was not a
        node loss)."""
        if self.rank == 0 and (self.lease is None or self.lease.held):
            write_history(self.storage, self.history)

    @property
    def lease_lost_url(self) -> str | None:
        """The root whose lease this job lost, or None (as ``TieredCheckpointManager``'s)."""
        return self.storage.url if self.lease_lost else None

    @property
    def owner(self) -> str | None:
        return self.lease.holder_id if self.lease is not None else None

    # -- saving ------------------------------------------------------------------------------
    def prepare(self, state: dict[str, Any]) -> None:
        """Allocate staging buffers for ``state`` now (``maybe_save`` also does it, in the
        background, on its first call), so the first save only copies."""
        self._prepare_started = True
        self.staging.prepare(api.resolve_state(state))

    def in_flight(self) -> bool:
        return self._slot.running()

    def maybe_save(self, step: int, state: dict[str, Any], *,
                   user_metadata: dict[str, Any] | None = None,
                   attachments: dict[str, Any] | None = None) -> bool:
        """Call after every training step; saves when the cadence policy says so.

        Returns True if a save was started (or completed, when not async). ``attachments``:
        as for :meth:`save`.
        """
        if not self.due(step, state):
            return False
        return self.save(step, state, user_metadata=user_metadata, attachments=attachments)

    def due(self, step: int, state: dict[str, Any]) -> bool:
        """The decision half of :meth:`maybe_save` (collective; same result on every rank):
        observe the step, then ask the cadence. Call once per step, then :meth:`save` when
        True (``maybe_save`` does both; ``ckpt.job.tiers`` decides for two managers first)."""
        observe_step(self.step_times, self.cadence, self.history, time.monotonic(),
                     busy=self.in_flight())
        if self.num_saves == 0 and not self._prepare_started:
            # Allocate (and fault in) the staging buffers in the background now, while
            # training runs, so that even the first save's stall is only the copy.
            self._prepare_started = True
            self._slot.executor.submit(self.staging.prepare, api.resolve_state(state))
        want = self._gate.due(self.cadence, step)  # agreed when time-based (ckpt.job.gate)
        if not want:
            # No collective follows, so a rank-local re-raise cannot leave a peer waiting.
            self._raise_pending_failure()
        return want

    def save(self, step: int, state: dict[str, Any], *,
             user_metadata: dict[str, Any] | None = None, block: bool = False,
             force: bool = False, attachments: dict[str, Any] | None = None,
             reuse: "StagedCopy | None" = None, busy_elsewhere: bool = False) -> bool:
        """Save now (collective). ``force`` waits for an in-flight save instead of skipping.

        Returns True when a save was started. Every rank takes the same branch: whether the
        previous save is in flight, whether ``step`` is committed, whether the lease is lost
        and whether a failure is pending are agreed in one all-reduce first.
        ``attachments``: small files kept with the checkpoint (``ckpt.save``'s); bytes are
        taken now, a path is read when the save persists. ``reuse``: persist this copy,
        staged by another manager at this step (its ``last_staged``), instead of staging
        again: no stall. Its owner must not stage again before this save is done.
        ``busy_elsewhere``: count as busy although this manager's previous save is done
        (``ckpt.job.tiers``: another node's save of the same tier is still in flight, and every
        node must save the same steps).
        """
        attached = check_attachments(attachments)  # same on every rank: before any collective
        if self._closed:
            raise RuntimeError("CheckpointManager.save() called after close()")
        busy, exists, lost, failed = self._gate.agree(
            step, cadence=self.cadence, busy=self.in_flight() or busy_elsewhere,
            lease_lost=self.lease is not None and not self.lease.held,
            pending_failure=self.raise_on_failure and self._slot.failure is not None,
            last_committed=self.last_committed)
        if failed:
            self._slot.raise_agreed_failure()
        if lost:
            self.lease_lost = True
            use_slot(self.cadence, step)  # one skip per due save, not one per step after it
            report_lease_lost(self.events, step, self.storage.url)
            return False
        if exists:
            self.newest_committed_step = max(step, self.newest_committed_step or step)
            self.events.emit("save_skipped", step, reason="already committed",
                             outcome="skipped")
            return False
        if busy:
            if self.busy == "skip" and not force:
                use_slot(self.cadence, step)  # one skip per due save, not one per step after it
                self.num_skipped += 1
                report_busy_skip(self.events, step, self._slot.step, self.num_skipped)
                return False
            t0 = time.monotonic()
            self._slot.join()
            self.events.emit("save_waited", step, wait_seconds=time.monotonic() - t0,
                             in_flight_step=self._slot.step)
            # The save waited for may have failed; its outcome is the same on every rank.
            self._raise_pending_failure()
        t0 = time.monotonic()
        first = self.num_saves == 0
        copy = stage_copy(self.staging, state, step, reuse)
        if reuse is None:
            self.num_stages += 1
            self.last_staged = copy
        self.num_saves += 1
        self.events.emit("save_staged", step, stall_seconds=0.0 if reuse else copy.stall_seconds,
                         bytes=copy.nbytes, first=first, reused=reuse is not None)
        use_slot(self.cadence, step)
        self.step_times.save_started()
        self._slot.start(step, self._persist, step, copy.staged, copy.nbytes, copy.stall_seconds,
                         dict(user_metadata or {}), t0, attached, copy.wait_ready)
        if block or not self.async_save:
            self._slot.join()
            self._raise_pending_failure()
        return True

    def _persist(self, step: int, staged: dict, nbytes: int, stall: float,
                 user_metadata: dict, t_start: float, attachments: dict[str, Any] | None,
                 wait_copies: Callable[[], float | None]) -> Manifest | None:
        """Background thread: persist (with retries), then the bookkeeping of a commit:
        events, cadence, history, retention."""
        # On CUDA the copies into the staged buffers were only enqueued: wait for them here,
        # off the training thread, before a byte is read (their device time: copy_seconds).
        copy_seconds = wait_copies()
        out = self._persister.run(step, staged, nbytes=nbytes, stall=stall,
                                  user_metadata=user_metadata, attachments=attachments)
        if not out.committed:
            if out.error is not None:
                self._slot.failure = out.error
            return None
        out.cost.lap()
        self.newest_committed_step = step
        if self.rank == 0:
            self.last_committed = out.manifest
        after_commit(step, out, events=self.events, cadence=self.cadence,
                     slowdown=self.step_times.slowdown(), save_history=self.save_history,
                     store=self.store, retention=self.retention, coordinator=self.rank == 0,
                     stall=stall, copy_seconds=copy_seconds, nbytes=nbytes, t_start=t_start)
        return out.manifest

    def _raise_pending_failure(self) -> None:
        if self.raise_on_failure:
            self._slot.raise_failure()

    def wait(self, raise_errors: bool = True) -> Manifest | None:
        """Block until the in-flight save (if any) is committed or failed.

        Returns the committed manifest (on rank 0; None elsewhere or on failure). Re-raises
        the newest save's failure when ``raise_errors``.
        """
        return self._slot.wait(raise_errors)

    # -- loading -----------------------------------------------------------------------------
    def load_latest(self, state: dict[str, Any], *, step: int | None = None,
                    strict: bool = True, ignore_keys: tuple[str, ...] = (),
                    raise_if_all_damaged: bool = False,
                    extra_state: Callable[[Manifest], dict[str, Any]] | None = None
                    ) -> Manifest | None:
        """Resume: load ``step`` if given, else the newest checkpoint that verifies.

        Returns the manifest loaded, or None when there is nothing to resume from
        (``raise_if_all_damaged``, ``extra_state``: see :func:`ckpt.dcp.api.load_latest`).
        """
        if self._closed:
            raise RuntimeError("CheckpointManager.load_latest() called after close()")
        # Read into the staging buffers (saves need them anyway, already touched) unless a
        # save is persisting from them. Resumed at a step, the cadence counts the next
        # interval from there (a resumed run saves at 40 and 50 after resuming at 30 with a
        # cadence of 10).
        manifest = load_for_manager(
            state, storage=self.storage, store=self.store, events=self.events,
            process_group=self._ctl_group, verify=self.verify, num_threads=self.num_threads,
            scratch=None if self.in_flight() else self.staging, step=step, strict=strict,
            ignore_keys=ignore_keys, raise_if_all_damaged=raise_if_all_damaged,
            extra_state=extra_state, on_loaded=lambda loaded: use_slot(self.cadence, loaded))
        self.resumed_tier = "durable" if manifest is not None else None
        return manifest

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
            if self.lease is not None:
                release_lease(self.life)
            self.free_groups()
            # The persist thread is done with the staged copy (and so is another tier
            # that persisted ``last_staged``): free the host memory it took.
            self.last_staged = None
            self.staging.close()
        if flush:
            self._raise_pending_failure()

    def free_groups(self) -> None:
        """Free the two private groups (a job may build several managers over its life):
        destroy them and drop every reference (``ckpt.ranks.groups`` says why both)."""
        groups, self._ctl_group, self._bg_group = (self._ctl_group, self._bg_group), None, None
        self._ctl.close()
        self._persister.agreement.close()
        self._persister.group = None
        freed(self)
        if self.distributed:
            destroy_groups(groups)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close(flush=exc[0] is None)
