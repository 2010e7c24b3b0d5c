"""Plan caching: a save whose layout did not change is not planned again.

Planning a save (every rank lists its write items, the coordinator gathers them all,
deduplicates replicas, builds the global plan and its metadata) costs the same at every
save of a run, because a run's layout does not change: only the values do. A
:class:`SavePlanCache` keeps what that planning produced, for its owner (a
``CheckpointManager``, one per tier; a ``SaveRequest(save_plan_cache=...)`` of
:func:`ckpt.dcp.api.save_with` for a caller's own saves), and the save planner (:class:`ckpt.dcp.planners.SafeSavePlanner`) reuses it:

========================== ===============================================================
every rank                 computes its state's *layout signature* (keys, kinds, dtypes,
                           global shapes, its shards' placement, object keys; no values).
                           Equal to the cached one: it sends an empty plan marked unusable,
                           with the cached plan's id and one digest per *holder set*
                           (below), and builds no write item. Otherwise: the full plan.
coordinator, all cached    every rank names the cached plan's id and sends the digests its
                           holder sets expect: no global planning; the cached metadata is
                           this save's. A holder set whose digests differ: ``Replan``.
coordinator, all full      the full global plan (a linear check of the chunks,
                           :mod:`ckpt.format.coverage`), then cached with a new id; each
                           rank's final plan tells it that id and its holder sets.
coordinator, mixed         (one rank's layout changed, or a rank has no cache: a new
                           process after a resume on other ranks): ``Replan``.
``Replan`` on every rank   ``ckpt.dcp.api.save`` runs the save once more, every rank
                           planning in full (the replica check of a full plan then names
                           the exact key that differs).
========================== ===============================================================

A *holder set* is a set of >= 2 ranks holding the same replicated keys (plain tensors and
objects every one of them has: optimizer hyperparameters, counters, a DDP model); the full
plan learns them from the items. At every save, cached or not, each rank checksums its
replicated values and sends one digest per holder set, so a replica that drifted on one
rank is refused on the 50th cached save as on the first (``SafeSavePlanner`` describes the
replica check). The cached final plan holds nothing save-specific: its ``storage_data`` is
each save's own (the coordinator's save id, in that save's central plan, cached or not),
from which and its own rank each writer names its data files (``CkptWriter``); only what
depends on the layout alone (the chunks a rank's part refers to) is taken from the cached
plan's.

The cache is per owner on purpose: DCP's own ``enable_plan_caching`` keeps its plans in
class attributes keyed by the planner class' name, so two managers in one process (the two
tiers of ``ckpt.job.tiers``) would read each other's plans, and its coordinator keeps
every rank's full local plan (memory O(ranks x items)). Here the coordinator keeps the
global metadata (which the commit needs anyway) and the holder sets, O(ranks x sets).
Used by one saving thread at a time (a manager's persist thread).
"""

from __future__ import annotations

import hashlib
import struct
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

__all__ = ["SavePlanCache", "Replan", "layout_signature", "holder_sets", "replica_digest"]


class Replan(Exception):
    """The coordinator cannot use the cached plan for this save (see the module
    docstring); raised on every rank through DCP's plan scatter, never seen by users:
    ``ckpt.dcp.api.save`` plans the save again in full."""


@dataclass
class RankPlan:
    """One rank's cached plan: the signature it was made for, the final plan, the global
    plan's id and this rank's holder sets (id -> its replicated keys, in order)."""

    signature: tuple
    final_plan: SavePlan
    plan_id: str
    sets: dict[int, tuple[str, ...]]


@dataclass
class GlobalPlan:
    """The coordinator's cached global plan: id, metadata, and each holder set's ranks;
    ``sets_of_rank[r]``: the ids rank ``r`` reports."""

    plan_id: str
    metadata: Metadata
    set_ranks: dict[int, tuple[int, ...]]
    sets_of_rank: list[tuple[int, ...]]


class SavePlanCache:
    """The plans of one owner's saves (see the module docstring). Counters, for tests and
    benchmarks: ``num_full_plans`` (this rank built its full local plan),
    ``num_cached_plans`` (it reused its cached one), ``num_replans`` (saves planned twice
    because the cache could not be used)."""

    def __init__(self) -> None:
        self.rank_plan: RankPlan | None = None
        self.global_plan: GlobalPlan | None = None  # the coordinator's
        self.num_full_plans = 0
        self.num_cached_plans = 0
        self.num_replans = 0

    def clear(self) -> None:
        """Forget the cached plans (the next save plans in full)."""
        self.rank_plan = None
        self.global_plan = None

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex


def layout_signature(state_dict: dict[str, Any]) -> tuple:
    """What a flattened state dict's write items depend on, values aside: per key its kind,
    dtype, global shape and this rank's shards (for a DTensor: its placements, its mesh's
    shape and this rank's coordinate in it, which fix the shard's offsets and sizes)."""
    from torch.distributed.tensor import DTensor

    out = []
    for fqn, obj in state_dict.items():
        if isinstance(obj, DTensor) and type(obj._local_tensor) is torch.Tensor:
            local = obj._local_tensor
            mesh = obj.device_mesh
            out.append((fqn, "d", obj.dtype, tuple(obj.shape), tuple(obj.placements),
                        tuple(mesh.shape), tuple(mesh.get_coordinate() or ()),
                        local.layout, local.requires_grad, local.is_pinned()))
        elif hasattr(obj, "__create_write_items__") or hasattr(obj, "local_shards"):
            # Another checkpointable tensor type (a ShardedTensor, a DTensor around a
            # tensor subclass): its write items themselves, values aside.
            from torch.distributed.checkpoint.planner_helpers import _create_write_items

            out.append((fqn, "i", tuple((w.index.offset, w.type, w.tensor_data)
                                        for w in _create_write_items(fqn, obj))))
        elif isinstance(obj, torch.Tensor):
            out.append((fqn, "t", obj.dtype, tuple(obj.shape), obj.layout, obj.requires_grad,
                        obj.is_pinned()))
        else:
            out.append((fqn, "o"))
    return tuple(out)


def holder_sets(all_plans: list[SavePlan]) -> tuple[dict[int, tuple[int, ...]],
                                                    list[dict[int, list[str]]]]:
    """The holder sets of a full global plan's local plans (before deduplication): every
    plain tensor or object key held by >= 2 ranks, grouped by the ranks that hold it.
    Returns (set id -> ranks, per rank: set id -> its keys in plan order)."""
    holders: dict[str, list[int]] = {}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            if item.type != WriteItemType.SHARD:
                holders.setdefault(item.index.fqn, []).append(rank)
    set_of: dict[tuple[int, ...], int] = {}
    per_rank: list[dict[int, list[str]]] = [{} for _ in all_plans]
    for fqn, ranks in holders.items():
        if len(ranks) < 2:
            continue
        sid = set_of.setdefault(tuple(ranks), len(set_of))
        for r in ranks:
            per_rank[r].setdefault(sid, []).append(fqn)
    return {sid: ranks for ranks, sid in set_of.items()}, per_rank


def replica_digest(crcs: list[int]) -> str:
    """One holder set's digest: over its keys' CRC32Cs, in order."""
    return hashlib.blake2b(struct.pack(f"<{len(crcs)}I", *crcs), digest_size=16).hexdigest()
