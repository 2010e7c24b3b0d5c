"""Save and load a (possibly sharded) state through torch.distributed.checkpoint.

``save`` and ``load`` are collective: every rank of ``process_group`` calls them with the
same arguments (its own shard of the state). Without an initialised process group they run
in one process. ``state`` maps names to either state dicts or objects with
``state_dict()``/``load_state_dict()`` (a model, an optimizer wrapper, a data loader ...).

Their collectives (the lease agreement, DCP's plans, the all-or-nothing load) never run on
the default group, which under NCCL cannot carry them: without a ``process_group``, or with
the default group, they run on the store's gloo group over the world (``ckpt.ranks.groups``; made
at the first such call, collectively, and reused); with a group that has a CPU backend, on
it. A subgroup without one (NCCL) is refused with ``ValueError``: pass a gloo group.

Size: the store's public save and load entry points and the one transaction each runs
(agreement, verification, fallback), which every manager, tier and tool goes through.
"""

from __future__ import annotations

import gc
import logging
import os
import platform
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckpt._version import __version__
from ckpt.dcp.attachments import check_attachments
from ckpt.dcp.plancache import SavePlanCache, Replan
from ckpt.dcp.planners import SafeLoadPlanner, SafeSavePlanner
from ckpt.dcp.reader import CkptReader
from ckpt.dcp.savecost import SaveCost
from ckpt.dcp.staging import StagingBuffers
from ckpt.dcp.writer import CkptWriter
from ckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    PartialCheckpointError,
    RankFailuresError,
    StateMismatchError,
)
from ckpt.format import Manifest, Span, step_dirname
from ckpt.format.span import ranks_text
from ckpt.ranks import Agreement, cpu_group
from ckpt.root import (
    Candidate,
    CheckpointStore,
    Lifecycle,
    Trajectory,
    acquire_for_ranks,
    read_runs,
    release_lease,
    walk_newest,
)
from ckpt.storage import Storage

__all__ = ["save", "save_with", "SaveRequest", "load", "load_latest", "load_with_extra",
           "resolve_state", "apply_state", "unwrap_dcp_error"]

log = logging.getLogger(__name__)


def _is_dist() -> bool:
    """Whether a default process group exists (then every call is collective over
    ``process_group``, the world when None)."""
    return dist.is_available() and dist.is_initialized()


def _rank(group) -> int:
    return dist.get_rank(group) if _is_dist() else 0


def _job_ranks(group) -> tuple[list[int], int]:
    """The job ranks of ``group`` (from ``cpu_group``), in its order, and the job's size."""
    if not _is_dist():
        return [0], 1
    return dist.get_process_group_ranks(group), dist.get_world_size()


def _in_rank_order(state: dict[str, Any]) -> list[str]:
    """``state``'s keys in the one order every rank uses (sorted, whatever the dict's order).

    ``Stateful`` objects may run collectives in ``state_dict``/``load_state_dict`` (on their
    own groups, e.g. a model-parallel one); ranks that visited them in their dicts' orders
    would wait for each other in different collectives forever.
    """
    return sorted(state, key=lambda k: (type(k).__name__, str(k)))


def resolve_state(state: dict[str, Any]) -> dict[str, Any]:
    """Replace each ``Stateful`` value by its ``state_dict()``; leave plain values alone.

    Collective when a ``Stateful`` runs collectives: every rank calls ``state_dict()`` of its
    objects in sorted key order, so objects listed in different orders on different ranks
    do not deadlock. The result keeps ``state``'s order.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict of names to state dicts or Stateful objects, "
                        f"got {type(state).__name__}")
    resolved = {k: (state[k].state_dict() if _is_stateful(state[k]) else state[k])
                for k in _in_rank_order(state)}
    return {k: resolved[k] for k in state}


def apply_state(state: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Hand each loaded value back to its ``Stateful`` owner (``load_state_dict``).

    Owners are visited in sorted key order on every rank (see :func:`resolve_state`). Plain
    top-level values are replaced in ``state`` too: tensors were loaded in place (the same
    objects), but an int or a string can only come back by assignment.
    """
    for k in _in_rank_order(state):
        v = state[k]
        if _is_stateful(v):
            v.load_state_dict(loaded[k])
        elif k in loaded and loaded[k] is not v:
            state[k] = loaded[k]


def _is_stateful(v: Any) -> bool:
    return hasattr(v, "state_dict") and hasattr(v, "load_state_dict") and not isinstance(v, dict)


def unwrap_dcp_error(exc: BaseException) -> BaseException:
    """Turn DCP's per-rank CheckpointException into our errors.

    When every failing rank failed with the same kind of ``CheckpointError`` (or
    ``FileExistsError``), the first one is re-raised as is; otherwise one
    ``RankFailuresError`` lists them all.
    """
    if not isinstance(exc, CheckpointException):
        return exc
    failures = {}
    for rank, err in exc.failures.items():
        inner = err[0] if isinstance(err, tuple) else err
        failures[rank] = inner
    if failures:
        inners = list(failures.values())
        first = inners[0]
        if isinstance(first, (CheckpointError, FileExistsError, TypeError, ValueError)) and all(
                type(e) is type(first) for e in inners):
            return first
    return RankFailuresError("checkpoint operation",
                             {r: f"{type(e).__name__}: {e}" for r, e in failures.items()},
                             failures)


def _all_replan(exc: CheckpointException) -> bool:
    inners = [err[0] if isinstance(err, tuple) else err for err in exc.failures.values()]
    return bool(inners) and all(isinstance(e, Replan) for e in inners)


def _versions() -> dict[str, str]:
    return {"ckpt": __version__, "torch": torch.__version__, "python": platform.python_version()}


def save(state: dict[str, Any], root: str | Storage, step: int, *,
         user_metadata: dict[str, Any] | None = None,
         attachments: dict[str, bytes | str | os.PathLike] | None = None,
         layout: dict[str, Any] | None = None, process_group=None,
         storage_options: dict[str, Any] | None = None, num_threads: int | None = None,
         use_lease: bool = True) -> Manifest | None:
    """Save ``state`` as checkpoint ``step`` under ``root``. Collective over ``process_group``
    (None: the world; which group its collectives run on: the module docstring).

    Returns the committed manifest on the coordinator (rank 0 of the group), None elsewhere.
    Raises ``FileExistsError`` if that step is already committed (nothing is overwritten).

    Like every writer, a save holds the root's write lease while it writes: the coordinator
    takes it (``LeaseHeldError`` on every rank when another live job holds it) and
    releases it after the commit. ``use_lease=False`` opts out of the lease and of fencing.
    ``attachments``: small files kept with the checkpoint, ``{name: bytes or path}``
    (:mod:`ckpt.dcp.attachments`); the coordinator's are written, read back with
    ``ckpt.read_attachment``. ``layout``: the parallel layout the manifest records (e.g.
    ``{"dp": 2, "tp": 2}``). ``num_threads``: parallel file writes per rank (None: the
    storage's default). A job's manager saves through :func:`save_with` instead, with its
    own :class:`SaveRequest` (a save id per attempt, hooks, its cost and cached plans).
    """
    group = cpu_group(process_group)  # first: it may make the group, with every rank
    attached = check_attachments(attachments)  # same on every rank: before the lease
    storage = root if isinstance(root, Storage) else Storage(root, storage_options)
    sd = resolve_state(state)
    lifecycle = _acquire_for_save(storage, group) if use_lease else None
    try:
        return save_with(sd, storage, step,
                         SaveRequest(lifecycle, layout=layout, num_threads=num_threads),
                         user_metadata=user_metadata, attachments=attached,
                         process_group=group)
    finally:
        if lifecycle is not None and lifecycle.lease is not None:
            release_lease(lifecycle)


@dataclass
class SaveRequest:
    """How one save is written, beyond what it saves: the writer's side of a save, which a
    job's manager chooses per attempt (as DCP takes a ``storage_writer``), and
    :func:`save` fills in for a caller's single save.

    ``lifecycle``: write through one that already holds the lease (the manager's); None:
    an unleased one of the save's own. ``save_id``: this attempt's id (None: a fresh random
    one). ``layout``: the parallel layout the manifest records. ``span``: the save holds one
    node's share of a job-wide checkpoint (the local tier of a job of several nodes,
    :mod:`ckpt.format.span`): the save's group must be its ranks; a tensor sharded across
    nodes is then saved in part, and the version loads only on this layout. ``durable``:
    sync files and folders to stable storage (False only where a crash may lose the save).
    ``before_write``: called on every rank before anything of the save is written (inside
    DCP's first collective): raising there fails the save on every rank alike, with no
    collective of its own; ``before_commit``: on the coordinator, right before the commit.
    ``cost``: a :class:`ckpt.dcp.savecost.SaveCost` to add this save's phases to (created
    on this thread). ``save_plan_cache``: a :class:`ckpt.dcp.plancache.SavePlanCache` kept by the
    caller across its saves (every rank its own, each save of the group with one): while the
    state's layout does not change, the save is not planned again (None: every save plans in
    full). ``host_window_bytes``: device
    tensors reach the host at most this many bytes at a time, each batch written before the
    next is copied (a state larger than its staging budget,
    :class:`ckpt.dcp.staging.StagingBuffers`; None: all at once).
    """

    lifecycle: Lifecycle | None = None
    save_id: str | None = None
    layout: dict[str, Any] | None = None
    span: Span | None = None
    num_threads: int | None = None
    durable: bool = True
    before_write: Callable[[], None] | None = None
    before_commit: Callable[[], None] | None = None
    cost: SaveCost | None = None
    save_plan_cache: SavePlanCache | None = None
    host_window_bytes: int | None = None


def save_with(state: dict[str, Any], storage: Storage, step: int, request: SaveRequest, *,
              user_metadata: dict[str, Any] | None = None,
              attachments: dict[str, bytes | str | os.PathLike] | None = None,
              process_group=None) -> Manifest | None:
    """Save ``state`` (resolved: :func:`resolve_state`, or a staged copy of it) as ``step``
    as ``request`` says. Collective over ``process_group``, as :func:`save`, whose engine it
    is; it takes no lease of its own (``request.lifecycle`` holds one, or none is used)."""
    group = cpu_group(process_group)  # first: it may make the group, with every rank
    span, save_plan_cache = request.span, request.save_plan_cache
    if span is not None:
        ranks, job_size = _job_ranks(group)
        if not span.matches(ranks, job_size):
            raise ValueError(f"span {span.to_json()} does not name this save's ranks "
                             f"({ranks_text(ranks)} of {job_size}): give the group's job "
                             f"ranks in its order")
    attached = check_attachments(attachments)
    distributed = _is_dist()
    world = dist.get_world_size(group) if distributed else 1
    extra = {"world_size": world, "layout": dict(request.layout or {}),
             "versions": _versions(), "user_metadata": dict(user_metadata or {}),
             "span": span}
    writer = CkptWriter(storage, step, step_dirname(step), num_threads=request.num_threads,
                        lifecycle=request.lifecycle, manifest_extra=extra,
                        durable=request.durable, before_commit=request.before_commit,
                        before_write=request.before_write, save_id=request.save_id,
                        attachments=attached, cost=request.cost,
                        host_window_bytes=request.host_window_bytes)

    def run(replan: bool) -> None:
        planner = SafeSavePlanner(cost=writer.cost, cache=save_plan_cache, replan=replan,
                                  partial=span is not None)
        dcp.save(state, storage_writer=writer, planner=planner, process_group=group,
                 no_dist=not distributed)

    try:
        with warnings.catch_warnings(), writer.cost.collective_scope():
            warnings.filterwarnings("ignore", message=".*assuming the intent is")
            try:
                run(replan=False)
            except CheckpointException as exc:
                # The coordinator could not use the cached plan (a rank's layout changed,
                # replicas differ): every rank got this alike, and every rank plans again.
                # Nothing was written yet (the attempt begins after the global plan).
                if save_plan_cache is None or not _all_replan(exc):
                    raise
                save_plan_cache.num_replans += 1
                run(replan=True)
    except CheckpointException as exc:
        raise unwrap_dcp_error(exc) from exc
    return writer.manifest


def _acquire_for_save(storage: Storage, group) -> Lifecycle:
    """The coordinator takes the lease; every rank learns whether it could. ``group``: from
    ``cpu_group``."""
    if _rank(group) == 0:
        storage.makedirs("")
    return acquire_for_ranks(storage, Agreement(group), _rank(group) == 0, heartbeat=True)


def load(state: dict[str, Any], root: str | Storage, step: int | Manifest, *,
         verify: str = "full", strict: bool = True, process_group=None,
         storage_options: dict[str, Any] | None = None, num_threads: int | None = None,
         ignore_keys: tuple[str, ...] = (), scratch: StagingBuffers | None = None,
         on_bytes_read: Callable[[int], None] | None = None) -> Manifest:
    """Load checkpoint ``step`` into ``state`` in place, resharding to the state's layout.

    Collective over ``process_group`` (None: the world; see the module docstring for the
    group its collectives run on). ``verify``: 'full' checks every chunk's crc32c,
    'size' only file sizes, 'none' nothing. Checkpoint keys starting with one of
    ``ignore_keys`` may be left unloaded without counting as unexpected. Raises
    ``CorruptCheckpointError`` (naming the file) on any corruption, ``StateMismatchError``
    listing every key/shape/dtype mismatch. ``on_bytes_read(n)``: progress, from any thread
    (bytes this rank read from storage).

    Each byte is read once: a byte range several ranks need (replicated values, HSDP
    replicas, a chunk two ranks' shards straddle after a reshard) is read by one of them,
    balanced, and sent to the others over the group, which check its CRC32C on what they
    received (``ckpt.dcp._coop``; docs/store.md, "Cooperative loads").

    Transactional: every rank first reads and verifies its whole part into scratch memory
    (``CkptReader``); only when every rank succeeded (an all-reduce) are tensors copied into
    ``state``, non-tensor values set and ``load_state_dict`` called. After a failed load,
    every rank's ``state`` is exactly as before. Attachments (which no load reads) are
    checked too, unless ``verify`` is 'none': a version is loaded only when all of it verifies. Peak memory during a load: one extra copy
    of the bytes this rank reads, freed before returning. ``scratch``: staging buffers to
    read into instead (e.g. ``CheckpointManager.staging``, which holds a copy of the state
    for saves anyway); no save may be using them during the load.

    A version that holds one node's share of a job-wide checkpoint (its ``span``) loads
    only on the layout that wrote it (``process_group`` its ranks, the job its size), and
    only where it holds every chunk each rank loads: ``PartialCheckpointError`` otherwise,
    on every rank, nothing loaded.
    """
    group = cpu_group(process_group)  # first: it may make the group, with every rank
    storage = root if isinstance(root, Storage) else Storage(root, storage_options)
    store = CheckpointStore(storage)
    manifest = step if isinstance(step, Manifest) else store.read_manifest(step)
    sd = resolve_state(state)
    where = storage.describe(step_dirname(manifest.step))
    distributed = _is_dist()
    reader = CkptReader(storage, step_dirname(manifest.step), manifest, verify=verify,
                        num_threads=num_threads, scratch=scratch, on_bytes_read=on_bytes_read,
                        state=sd, rank=_rank(group),
                        world_size=dist.get_world_size(group) if distributed else 1,
                        group=group)
    planner = SafeLoadPlanner(strict=strict, source=where, ignore_prefixes=tuple(ignore_keys))
    error: BaseException | None = None
    span, (ranks, world) = manifest.span, _job_ranks(group)
    if span is not None and not span.matches(ranks, world):
        # Every rank reads the same manifest: each refuses alike, agreed below all the same.
        error = PartialCheckpointError(
            f"{where} holds {span.describe()} and loads only on that layout; this load runs "
            f"on ranks {ranks_text(ranks)} of {world}: load it on the layout that wrote it, "
            f"or resume from the durable root")
    if error is None and verify != "none" and manifest.attachments:
        # No load reads the attachments: their checksums are checked once, by the group's
        # first rank, and its verdict is every rank's (a version is taken whole or not).
        agreement = Agreement(group)
        verdict, cause = ["", ""], None
        if agreement.is_first:
            try:
                store.verify_attachments(manifest)
            except CorruptCheckpointError as exc:
                verdict = ["corrupt", str(exc)]
            except Exception as exc:  # noqa: BLE001 - a storage error: every rank fails
                verdict, cause = ["failed", f"{type(exc).__name__}: {exc}"], exc
        kind, text = agreement.broadcast(verdict)
        if kind == "corrupt":
            error = CorruptCheckpointError(text, path=where)
        elif kind == "failed":
            error = cause or RankFailuresError(f"checking the attachments of {where}", {0: text})
    try:
        if error is None:
            with warnings.catch_warnings(), _gc_paused():
                warnings.filterwarnings("ignore", message=".*assuming the intent is")
                dcp.load(sd, storage_reader=reader, planner=planner,
                         process_group=group, no_dist=not distributed)
    except CheckpointException as exc:
        error = unwrap_dcp_error(exc)
        if error is not exc:
            error.__cause__ = exc
    if error is None:
        try:  # what a state's load_state_dict would refuse, refused before anything is applied
            planner.check_loaded(reader.staged_objects())
        except (StateMismatchError, CorruptCheckpointError) as exc:
            error = exc
    # DCP already fails every rank when one fails; agreeing again makes "apply only after
    # every rank verified its whole read" this function's own guarantee.
    if not Agreement(group).all(error is None):
        reader.discard()
        raise error or CorruptCheckpointError(
            f"loading {where} failed on another rank (see that rank's error); nothing was "
            f"loaded here either", path=where)
    with _gc_paused():
        reader.apply()
    # dcp.load plans over a shallow copy of ``sd`` and hands top-level values back before it
    # returns, i.e. before ``apply`` set the non-tensor ones: take them from that copy.
    sd.update(planner.original_state_dict)
    apply_state(state, sd)
    return manifest


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (when it runs) for the duration.

    A load builds a few objects per chunk (DCP's metadata and read items, our staged
    views), none in cycles; at 100k chunks their allocations still set off the collector's
    full passes over every object of the process (torch alone holds hundreds of
    thousands), which doubled a load's CPU time (bench/bench_chunks.py). Collection resumes
    when the load returns; other threads' garbage waits at most that long.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def load_with_extra(state: dict[str, Any], root: str | Storage, manifest: Manifest,
                    extra_state: Callable[[Manifest], dict[str, Any]] | None,
                    **kwargs: Any) -> Manifest:
    """``load`` of ``state`` plus ``extra_state(manifest)``, all or nothing; plain values
    loaded into ``state``'s own keys come back into ``state``."""
    if extra_state is None:
        return load(state, root, manifest, **kwargs)
    merged = {**state, **extra_state(manifest)}
    load(merged, root, manifest, **kwargs)
    for key in state:
        state[key] = merged[key]
    return manifest


def load_latest(state: dict[str, Any], root: str | Storage, *, verify: str = "full",
                strict: bool = True, process_group=None,
                storage_options: dict[str, Any] | None = None,
                num_threads: int | None = None, ignore_keys: tuple[str, ...] = (),
                on_fallback: Callable[[int, str], None] | None = None,
                raise_if_all_damaged: bool = False,
                scratch: StagingBuffers | None = None,
                extra_state: Callable[[Manifest], dict[str, Any]] | None = None
                ) -> Manifest | None:
    """Load the newest committed checkpoint that loads cleanly on every rank.

    The walk is :func:`ckpt.root.walk_newest` (candidates: the committed steps the group's
    first rank lists). A checkpoint that fails verification on any rank is skipped with a
    warning naming the file (also ``on_fallback(step, message)``), and the one before it is
    tried; each failed attempt leaves ``state`` untouched (``load`` is transactional).
    Returns None when the root holds no committed checkpoint. When it holds some and every
    one failed, ``state`` is unchanged and the result is None too, unless
    ``raise_if_all_damaged``: then ``AllCheckpointsDamagedError`` lists each step and why it
    failed, so a caller can tell "nothing there" from "everything damaged". ``scratch``: as
    for :func:`load`.
    ``extra_state(manifest)``: more entries to load from that checkpoint in the same
    transaction, chosen once its manifest is known (e.g. RNG state only on the same layout).
    Collective over ``process_group`` (as for :func:`load`).
    """
    group = cpu_group(process_group)  # first: it may make the group, with every rank
    agreement = Agreement(group)
    storage = root if isinstance(root, Storage) else Storage(root, storage_options)
    store = CheckpointStore(storage)
    # Every rank must walk the same candidate list and judge it by the same run log: the
    # first rank's.
    steps, runs = agreement.broadcast(
        (store.committed_steps(), read_runs(storage)) if agreement.is_first else None)

    def load_one(_: Candidate, manifest: Manifest) -> None:
        load_with_extra(state, storage, manifest, extra_state, verify=verify, strict=strict,
                        process_group=group, num_threads=num_threads,
                        ignore_keys=ignore_keys, scratch=scratch)

    walked = walk_newest(
        [Candidate(step, store) for step in steps],
        # A cheap whole-checkpoint size check first: it catches truncated files this rank
        # would not read. The load checks the checksums (``verify``) of what it reads.
        check="size" if verify in ("full", "size") else "none", load=load_one,
        agreement=agreement, trajectory=Trajectory(runs),
        on_fallback=None if on_fallback is None else lambda c, why: on_fallback(c.step, why))
    if raise_if_all_damaged:
        walked.raise_if_all_damaged(storage.describe())
    return walked.manifest
