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
transition goes through :mod:`ckpt.commit`, which fences such a writer off. ``close``
releases the lease and frees the two private groups.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch.distributed as dist

from ckpt import api
from ckpt.agreement import Agreement
from ckpt.attachments import check_attachments
from ckpt.commit import Lifecycle, acquire_for_ranks, release_lease
from ckpt.distributed import warn_if_not_attempt_scoped
from ckpt.errors import CheckpointError
from ckpt.cadence import CadencePolicy
from ckpt.events import EventBus
from ckpt.history import HISTORY_NAME, load_job_history, write_history
from ckpt.lease import Lease
from ckpt.manifest import Manifest
from ckpt.retention import KeepLast, KeepPinned, RetentionPolicy, apply_retention
from ckpt.persist import Persister, SaveAbandoned
from ckpt.staging import StagingBuffers
from ckpt.steptime import StepTimes
from ckpt.storage import Storage
from ckpt.store import CheckpointStore

__all__ = ["CheckpointManager", "SaveAbandoned", "StagedCopy", "HISTORY_NAME"]

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class StagedCopy:
    """A copy of the state staged by a manager at ``step`` (in its staging buffers), which
    another manager may persist too (``save(..., reuse=...)``): one stall for two saves."""

    step: int
    staged: Any
    nbytes: int
    stall_seconds: float
    wait_ready: Callable[[], float | None] = lambda: None


# Managers whose process groups are not freed yet (see CheckpointManager._destroy_groups).
_open_managers: "weakref.WeakSet[CheckpointManager]" = weakref.WeakSet()


@atexit.register
def _free_groups_at_exit() -> None:
    for manager in list(_open_managers):
        manager._destroy_groups()


def _private_groups(process_group) -> tuple[Any, Any]:
    """Two new gloo groups over the ranks of ``process_group`` (None: the world).

    With a subgroup, every rank of the world must construct its manager at the same time
    (each with the group it belongs to): the groups of all members are learned with one
    all-gather over the world and created together (``new_subgroups_by_enumeration``)."""
    if process_group is None:
        return (dist.new_group(backend="gloo", group_desc="ckpt_control"),
                dist.new_group(backend="gloo", group_desc="ckpt_persist"))
    import torch

    world = dist.get_world_size()
    mine = torch.tensor([min(dist.get_process_group_ranks(process_group))], dtype=torch.int64)
    leaders = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(leaders, mine)
    partition: dict[int, list[int]] = {}
    for rank, leader in enumerate(int(t) for t in leaders):
        partition.setdefault(leader, []).append(rank)
    groups = [sorted(ranks) for _, ranks in sorted(partition.items())]
    ctl, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")
    bg, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")
    return ctl, bg


class CheckpointManager:
    """Checkpoint a training job under ``root``; resume it from the newest valid checkpoint.

    Args:
        root: local path or fsspec URL (``s3://bucket/prefix``), or a ``Storage``.
        cadence: a ``CadencePolicy`` (see ``ckpt.cadence``) or an interval string
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
            (``ckpt.tiers``); every rank of the world then constructs a manager at once.

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
        if isinstance(cadence, str):
            from ckpt.cadence import parse_interval

            cadence = parse_interval(cadence)
        self.cadence = cadence
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
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ckpt-persist")
        self._inflight: Future | None = None
        self._inflight_step: int | None = None
        self._abandon = threading.Event()
        self._failure: BaseException | None = None
        self.step_times = StepTimes()
        self.num_skipped = 0
        self.num_saves = 0
        self.last_committed: Manifest | None = None
        self.newest_committed_step: int | None = None  # by this manager, known on every rank
        self.lease_lost = False  # agreed on every rank at a save
        self._closed = False
        # Two private gloo groups: one for main-thread agreement, one for the background
        # persist (DCP's collectives). Never the training group from a background thread.
        # They live in the default group's key space: per torchrun attempt when it was
        # started by ckpt.init_distributed (ckpt.distributed says why that matters).
        if self.distributed:
            warn_if_not_attempt_scoped()
            self._ctl_group, self._bg_group = _private_groups(process_group)
        else:
            self._ctl_group = self._bg_group = None
        self._ctl = Agreement(self._ctl_group)  # the calling (training) thread only
        self._persister = Persister(self.life, self.events, Agreement(self._bg_group),
                                    self._bg_group, rank=self.rank,
                                    max_attempts=max_attempts,
                                    retry_backoff_seconds=retry_backoff_seconds,
                                    num_threads=num_threads, layout=self.layout,
                                    abandon=self._abandon)
        if self.distributed:
            _open_managers.add(self)  # its groups are freed at exit if close() is never called
        self.last_staged: StagedCopy | None = None  # the newest copy this manager staged
        self.num_stages = 0  # copies into the staging buffers (stalls); reused ones not counted
        self.lease: Lease | None = None
        self._found_aborted = False
        self._check_every = 1  # see maybe_save
        self._prepare_started = False
        self._newest_known_step: int | None = None  # see _committed
        if use_lease:
            self._acquire_lease(lease_ttl_seconds, job_name, job_fingerprint)
        self._load_history()
        if self.rank == 0:
            try:  # once, here, so that saves need no listing (see _committed)
                self._newest_known_step = max(self.store.committed_steps(), default=-1)
            except Exception:  # noqa: BLE001 - _committed retries lazily
                self._newest_known_step = None

    # -- failure history (for the auto cadence's MTBF) ---------------------------------------
    def _load_history(self) -> None:
        """The job's failure history, rank 0's view on every rank, shared with the cadence
        (one history per job: the cadence accumulates uptime in it)."""
        took_over = self.lease is not None and self.lease.took_over is not None
        self.history = load_job_history(self.storage, self.events, self._ctl,
                                        coordinator=self.rank == 0, took_over=took_over,
                                        found_aborted=self._found_aborted)
        if self.cadence is not None:
            self.cadence.history = self.history
        self._save_history()

    def save_history(self) -> None:
        """Write the failure history now (rank 0, holding the lease); saves also do. For a
        caller that changed ``history`` (``ckpt.tiers`` takes back a failure that was not a
        node loss)."""
        self._save_history()

    def _save_history(self) -> None:
        if self.rank == 0 and (self.lease is None or self.lease.held):
            write_history(self.storage, self.history)

    def _acquire_lease(self, ttl: float, job_name: str | None,
                       fingerprint: str | None) -> None:
        """Rank 0 takes the lease (fencing off earlier writers) and removes dead attempts'
        leftovers; every rank learns whether it could."""
        acquire_for_ranks(self.storage, self._ctl, self.rank == 0, lifecycle=self.life,
                          ttl_seconds=ttl, job_name=job_name, fingerprint=fingerprint,
                          on_lost=lambda why: self.events.emit("lease_lost", reason=why))
        if self.rank == 0:
            self.lease = self.life.lease
            self.events.emit("lease_acquired", holder=self.lease.holder_id,
                             took_over=self.lease.took_over is not None,
                             generation=self.lease.generation)
            self._cleanup_aborted()

    def _cleanup_aborted(self) -> None:
        """Remove the files of attempts whose writer is gone (every earlier generation)."""
        def removed(step: int, names: list[str]) -> None:
            self._found_aborted = True
            self.events.emit("cleanup_aborted", step, files=len(names))
            log.info("removed %d leftover file(s) of aborted saves at step %d", len(names), step)

        try:
            self.life.cleanup(on_removed=removed)
        except Exception as exc:  # noqa: BLE001 - cleanup is best effort
            log.warning("could not clean up aborted saves under %s: %s", self.storage.url, exc)

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
        return self._inflight is not None and not self._inflight.done()

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
        True (``maybe_save`` does both; ``ckpt.tiers`` decides for two managers first)."""
        now = time.monotonic()
        self._observe_step(now)
        if self.num_saves == 0 and not self._prepare_started:
            # Allocate (and fault in) the staging buffers in the background now, while
            # training runs, so that even the first save's stall is only the copy.
            self._prepare_started = True
            self._executor.submit(self.staging.prepare, api.resolve_state(state))
        want = False
        if self.cadence is not None:
            want = bool(self.cadence.should_save(step, time.monotonic()))
            if not self.cadence.deterministic:
                # A time-based decision differs between ranks, so it is agreed; but only
                # every ``_check_every`` steps (about 1/20 of the interval, agreed at each
                # save), not at every step: a save is at most 5% of an interval late.
                want = step % self._check_every == 0 and self._ctl.any(want)
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
        (``ckpt.tiers``: another node's save of the same tier is still in flight, and every
        node must save the same steps).
        """
        attached = check_attachments(attachments)  # same on every rank: before any collective
        if self._closed:
            raise RuntimeError("CheckpointManager.save() called after close()")
        lease_lost = self.lease is not None and not self.lease.held
        pending_failure = self.raise_on_failure and self._failure is not None
        busy, exists, lost, failed, neg_period = self._ctl.max(
            int(self.in_flight() or busy_elsewhere), int(self._committed(step)), int(lease_lost),
            int(pending_failure), -self._proposed_check_period())
        self._check_every = max(1, -neg_period)  # the smallest any rank proposed
        if failed:
            self._raise_agreed_failure()
        if lost:
            self.lease_lost = True
            self._used_slot(step)  # one skip per due save, not one per step after it
            self.events.emit("save_skipped", step, reason="lease lost", outcome="skipped")
            log.error("not saving step %d: the write lease on %s was lost to another job",
                      step, self.storage.url)
            return False
        if exists:
            self.newest_committed_step = max(step, self.newest_committed_step or step)
            self.events.emit("save_skipped", step, reason="already committed",
                             outcome="skipped")
            return False
        if busy:
            if self.busy == "skip" and not force:
                self._used_slot(step)  # one skip per due save, not one per step after it
                self.num_skipped += 1
                self.events.emit("save_skipped", step, reason="previous save in flight",
                                 outcome="skipped", in_flight_step=self._inflight_step,
                                 num_skipped=self.num_skipped)
                log.warning("checkpoint at step %d skipped: the save of step %s is still "
                            "persisting (%d skipped so far)", step, self._inflight_step,
                            self.num_skipped)
                return False
            t0 = time.monotonic()
            self._wait_inflight()
            self.events.emit("save_waited", step, wait_seconds=time.monotonic() - t0,
                             in_flight_step=self._inflight_step)
            # The save waited for may have failed; its outcome is the same on every rank.
            self._raise_pending_failure()
        t0 = time.monotonic()
        first = self.num_saves == 0
        if reuse is not None:
            if reuse.step != step:
                raise ValueError(f"reuse holds step {reuse.step}, not step {step}: pass the "
                                 f"copy staged at this step")
            # No stall here; the cadence still learns what a save of this state costs.
            staged, nbytes, stall = reuse.staged, reuse.nbytes, reuse.stall_seconds
        else:
            staged, nbytes = self.staging.stage(api.resolve_state(state))
            stall = time.monotonic() - t0
            self.num_stages += 1
            self.last_staged = StagedCopy(step, staged, nbytes, stall, self.staging.wait_ready)
        self.num_saves += 1
        self.events.emit("save_staged", step, stall_seconds=0.0 if reuse else stall,
                         bytes=nbytes, first=first, reused=reuse is not None)
        self._used_slot(step)
        self.step_times.save_started()
        self._failure = None  # wait() reports the outcome of the newest save only
        wait_copies = self.staging.wait_ready if reuse is None else reuse.wait_ready
        job = self._executor.submit(self._persist, step, staged, nbytes, stall,
                                    dict(user_metadata or {}), t0, attached, wait_copies)
        self._inflight, self._inflight_step = job, step
        if block or not self.async_save:
            self._wait_inflight()
            self._raise_pending_failure()
        return True

    def _used_slot(self, step: int) -> None:
        """The save due at ``step`` happened, or was skipped: either way its slot is used,
        so the cadence counts the next interval from here (every rank alike)."""
        if self.cadence is not None:
            self.cadence.record_saved(step, time.monotonic())

    def _proposed_check_period(self) -> int:
        """Steps between agreements of a time-based cadence: ~1/20 of its interval."""
        try:
            steps = (self.cadence.describe() or {}).get("interval_steps") \
                if self.cadence is not None else None
        except Exception:  # noqa: BLE001 - advisory only
            steps = None
        return max(1, int(steps) // 20) if steps else 1

    def _committed(self, step: int) -> bool:
        """Rank 0: is ``step`` committed already? Asks storage only when it could be.

        Only this job writes under the root (the lease), so a step above every step that was
        committed when the job started and every step it committed since cannot exist: no
        storage request on the training thread in the common case.
        """
        if self.rank != 0:
            return False
        if self.last_committed is not None and self.last_committed.step == step:
            return True
        if self._newest_known_step is None:
            try:
                self._newest_known_step = max(self.store.committed_steps(), default=-1)
            except Exception:  # noqa: BLE001 - fall back to asking each time
                self._newest_known_step = 1 << 62
        newest = max(self._newest_known_step,
                     self.last_committed.step if self.last_committed is not None else -1)
        if step > newest:
            return False
        if not self.life.has_manifest(step):
            return False
        try:
            self.life.read_committed(step)
            return True
        except CheckpointError:  # fenced off or damaged: it does not count, save again
            return False

    def _persist(self, step: int, staged: dict, nbytes: int, stall: float,
                 user_metadata: dict, t_start: float,
                 attachments: dict[str, Any] | None = None,
                 wait_copies: Callable[[], float | None] | None = None) -> Manifest | None:
        """Background thread: persist (with retries), then the bookkeeping of a commit:
        events, cadence, history, retention."""
        # On CUDA the copies into the staged buffers were only enqueued: wait for them here,
        # off the training thread, before a byte is read (their device time: copy_seconds).
        copy_seconds = (wait_copies or self.staging.wait_ready)()
        out = self._persister.run(step, staged, nbytes=nbytes, stall=stall,
                                  user_metadata=user_metadata, attachments=attachments)
        if not out.committed:
            if out.error is not None:
                self._failure = out.error
            return None
        manifest, persist = out.manifest, out.persist_seconds
        cost = out.cost
        cost.lap()
        self.newest_committed_step = step
        if self.rank == 0:
            self.last_committed = manifest
        self.events.emit("save_committed", step, outcome="committed", stall_seconds=stall,
                         copy_seconds=copy_seconds, persist_seconds=persist,
                         total_seconds=time.monotonic() - t_start,
                         bytes=nbytes, bytes_per_second=nbytes / persist if persist > 0 else 0.0,
                         retries=out.retries, attempts=out.attempts,
                         total_bytes=manifest.total_bytes if manifest else None)
        if self.cadence is not None:
            try:
                self.cadence.record_save(stall_seconds=stall, persist_seconds=persist,
                                         num_bytes=nbytes,
                                         slowdown_seconds=self.step_times.slowdown())
                self.events.emit("cadence", step, **self.cadence.describe())
            except Exception:  # noqa: BLE001 - a cadence bug must not lose the checkpoint
                log.exception("cadence policy failed to record the save of step %d", step)
        self._save_history()
        cost.lap("bookkeep")
        if self.rank == 0 and self.retention:
            self._apply_retention(step)
        cost.lap("retention")
        self.events.emit("save_cost", step, **cost.fields())
        return manifest

    def _apply_retention(self, step: int) -> None:
        try:
            apply_retention(
                self.store, self.retention, protect={step},
                on_deleted=lambda s: self.events.emit("retention_deleted", s),
                on_failed=lambda s, e: self.events.emit("retention_failed", s, error=str(e)),
                newest_manifest=self.last_committed)
        except Exception as exc:  # noqa: BLE001 - retention must never crash a job
            log.warning("retention after step %d failed: %s", step, exc)
            self.events.emit("retention_failed", None, error=f"{type(exc).__name__}: {exc}")

    def _observe_step(self, now: float) -> None:
        dt = self.step_times.observe(now, busy=self.in_flight())
        if dt is None:
            return
        if self.cadence is None:
            self.history.add_uptime(dt)
        else:  # the cadence adds the uptime to the shared history itself
            self.cadence.record_step(dt)

    def _wait_inflight(self) -> None:
        if self._inflight is not None:
            self._inflight.result()

    def _raise_pending_failure(self) -> None:
        if self.raise_on_failure and self._failure is not None:
            exc, self._failure = self._failure, None
            raise exc

    def _raise_agreed_failure(self) -> None:
        """Some rank saw the last save fail: every rank did (or will), so all raise here."""
        self._wait_inflight()
        exc, self._failure = self._failure, None
        raise exc if exc is not None else CheckpointError(
            "the previous checkpoint save failed on another rank")

    def wait(self, raise_errors: bool = True) -> Manifest | None:
        """Block until the in-flight save (if any) is committed or failed.

        Returns the committed manifest (on rank 0; None elsewhere or on failure). Re-raises
        the newest save's failure when ``raise_errors``.
        """
        result = self._inflight.result() if self._inflight is not None else None
        if raise_errors and self._failure is not None:
            exc, self._failure = self._failure, None
            raise exc
        return result

    # -- loading -----------------------------------------------------------------------------
    def load_latest(self, state: dict[str, Any], *, step: int | None = None,
                    strict: bool = True, ignore_keys: tuple[str, ...] = (),
                    raise_if_all_damaged: bool = False,
                    extra_state: Callable[[Manifest], dict[str, Any]] | None = None
                    ) -> Manifest | None:
        """Resume: load ``step`` if given, else the newest checkpoint that verifies.

        Returns the manifest loaded, or None when there is nothing to resume from
        (``raise_if_all_damaged``, ``extra_state``: see :func:`ckpt.api.load_latest`).
        """
        if self._closed:
            raise RuntimeError("CheckpointManager.load_latest() called after close()")
        t0 = time.monotonic()
        fallbacks: list[int] = []

        def fell_back(skipped: int, reason: str) -> None:
            fallbacks.append(skipped)
            self.events.emit("load_fallback", skipped, reason=reason)

        # Read into the staging buffers (saves need them anyway, already touched) unless a
        # save is persisting from them.
        scratch = None if self.in_flight() else self.staging
        if scratch is not None:
            scratch.prepare(api.resolve_state(state))
        if step is not None:
            manifest = api.load_with_extra(
                state, self.storage, self.store.read_manifest(step), extra_state,
                verify=self.verify, strict=strict, process_group=self._ctl_group,
                num_threads=self.num_threads, ignore_keys=ignore_keys, scratch=scratch)
        else:
            manifest = api.load_latest(state, self.storage, verify=self.verify, strict=strict,
                                       process_group=self._ctl_group,
                                       num_threads=self.num_threads, ignore_keys=ignore_keys,
                                       on_fallback=fell_back,
                                       raise_if_all_damaged=raise_if_all_damaged,
                                       scratch=scratch, extra_state=extra_state)
        if manifest is not None:
            # Resumed at manifest.step: the cadence counts the next interval from there
            # (a resumed run saves at 40 and 50 after resuming at 30 with a cadence of 10).
            self._used_slot(manifest.step)
            seconds = time.monotonic() - t0
            self.events.emit("load_done", manifest.step, outcome="loaded", seconds=seconds,
                             bytes=manifest.total_bytes, verify=self.verify,
                             bytes_per_second=manifest.total_bytes / seconds if seconds > 0
                             else 0.0, num_fallbacks=len(fallbacks))
        return manifest

    # -- shutdown ----------------------------------------------------------------------------
    def close(self, *, flush: bool = True) -> None:
        """Finish (``flush``) or abandon the in-flight save, then release the lease.

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
            if self._inflight is not None:
                try:
                    self._inflight.result()
                except BaseException as exc:  # noqa: BLE001
                    log.error("in-flight save failed during close: %s", exc)
        finally:
            self._executor.shutdown(wait=True)
            if self.lease is not None:
                release_lease(self.life)
            self._destroy_groups()
        if flush:
            self._raise_pending_failure()

    def _destroy_groups(self) -> None:
        """Free the two private groups (a job may build several managers over its life).

        Destroying is not enough: a gloo group's worker threads stop only when the last
        reference to the group goes, so every holder lets go here. A group still alive at
        the interpreter's teardown can abort the process: a worker thread that releases a
        finished collective's tensors then needs the interpreter ("terminate called without
        an active exception"). That is also why an unclosed manager does this at exit.
        """
        groups, self._ctl_group, self._bg_group = (self._ctl_group, self._bg_group), None, None
        self._ctl.close()
        self._persister.agreement.close()
        self._persister.group = None
        _open_managers.discard(self)
        if not self.distributed:
            return
        for group in groups:
            try:
                if group is not None and dist.is_initialized():
                    dist.destroy_process_group(group)
            except Exception as exc:  # noqa: BLE001 - only a leak
                log.debug("could not destroy a checkpoint process group: %s", exc)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close(flush=exc[0] is None)
