"""A rank's shards and the parts that list them (format version 2).

Saving: a chunk of a sharded tensor that is not the whole tensor goes in its writer's part
(:func:`in_part`); a rank's local plan carries the indices of its shards
(:class:`LocalShards`), so the coordinator tells each rank which of them DCP's dedup gave
another rank to write (:func:`refs_by_rank`): the rank's part refers to those. Loading:
:func:`first_uncovered` says whether the chunks a rank found (the root's, its own part's
and its refs' parts') cover every local shard of the state it loads into, and if not, where.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from ckpt.format import Manifest, coverage_problem

__all__ = ["LocalShards", "in_part", "refs_by_rank", "first_uncovered", "local_chunks"]


@dataclasses.dataclass
class LocalShards:
    """A local plan's ``storage_data``: the indices of its chunks of sharded tensors, so the
    coordinator can tell each rank which of them another rank writes after DCP's dedup.
    They are the very ``MetadataIndex`` objects of the plan's items, so pickling the plan
    for the gather stores each once (a reference here costs a few bytes)."""

    indices: tuple[MetadataIndex, ...]
    num_items: int  # of the whole local plan: fewer in the global plan = some were deduped


def in_part(item: WriteItem) -> bool:
    """A chunk of a sharded tensor that is not the whole tensor: its writer's part lists it
    (the root lists tensors saved whole)."""
    td = item.tensor_data
    if item.type != WriteItemType.SHARD or td is None:
        return False
    return any(td.chunk.offsets) or td.chunk.sizes != td.size


def refs_by_rank(plans: list[SavePlan]) -> list[dict[tuple[str, tuple[int, ...]], int]]:
    """For each rank, the chunks of sharded tensors its local plan held that DCP's dedup
    gave another rank to write: ``(key, offsets) -> writer rank``. Costs O(ranks) when
    nothing was deduplicated, and one pass over the plans' items when something was."""
    refs: list[dict[tuple[str, tuple[int, ...]], int]] = [{} for _ in plans]
    removed: dict[MetadataIndex, list[int]] = {}
    for rank, plan in enumerate(plans):
        local = plan.storage_data
        if not isinstance(local, LocalShards) or len(plan.items) == local.num_items:
            continue
        kept = {item.index for item in plan.items}
        for index in local.indices:
            if index not in kept:
                removed.setdefault(index, []).append(rank)
    if not removed:
        return refs
    for rank, plan in enumerate(plans):
        for item in plan.items:
            holders = removed.get(item.index)
            if holders:
                for holder in holders:
                    refs[holder][(item.index.fqn, tuple(item.index.offset))] = rank
    return refs


def first_uncovered(state: dict[str, Any], manifest: Manifest,
                    chunks: dict[str, list[dict[str, Any]]]) -> str | None:
    """The first key of ``state`` whose local shard ``chunks`` do not cover (None: they
    cover every local shard of ``state``'s sharded tensors). Linear in the chunks: a local
    shard that equals a chunk (an unchanged layout) is found by its offsets; any other is
    tiled exactly by its intersections with the key's chunks (only the few read from this
    rank's parts), or not covered."""
    flat, _ = flatten_state_dict(_flatten_sharded_tensors(state))
    for fqn, value in flat.items():
        t = manifest.tensors.get(fqn)
        if t is None or not t["sharded"] or not isinstance(value, torch.Tensor) \
                or list(value.shape) != t["shape"]:
            continue  # whole in the root, or a mismatch the planner reports
        found = chunks[fqn]
        by_offsets = None
        for local in local_chunks(value):
            offs, sizes = list(local.offsets), list(local.sizes)
            if not math.prod(sizes):
                continue
            if sizes == t["shape"]:  # the whole tensor: the chunks themselves must tile it
                boxes = [(c["offsets"], c["sizes"]) for c in found]
                if coverage_problem(sizes, boxes) is not None:
                    return fqn
                continue
            if by_offsets is None:
                by_offsets = {tuple(c["offsets"]): c for c in found}
            c = by_offsets.get(tuple(offs))
            if c is not None and list(c["sizes"]) == sizes:
                continue
            boxes = []
            for c in found:
                lo = [max(a, b) for a, b in zip(offs, c["offsets"])]
                hi = [min(a + s, b + t) for a, s, b, t in zip(offs, sizes, c["offsets"],
                                                               c["sizes"])]
                if all(h > low for low, h in zip(lo, hi)):
                    boxes.append(([low - o for low, o in zip(lo, offs)],
                                  [h - low for low, h in zip(lo, hi)]))
            if coverage_problem(sizes, boxes) is not None:
                return fqn
    return None


def local_chunks(value: torch.Tensor) -> list:
    """This rank's chunks of ``value`` (a DTensor's or ShardedTensor's local shards, or
    a plain tensor whole), as DCP's planner sees them."""
    if hasattr(value, "__create_chunk_list__"):
        return value.__create_chunk_list__()
    return [ChunkStorageMetadata(offsets=torch.Size([0] * value.dim()), sizes=value.size())]
