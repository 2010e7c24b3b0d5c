"""Pickle-free planners for torch.distributed.checkpoint.

DCP's planners decide *what* each rank saves and loads; they understand DTensor, FSDP2 and
tensor-parallel shards, which is what makes resharding work. Its default ones store every
non-tensor value with ``torch.save`` and load it back with an unrestricted ``torch.load``;
these store JSON (:mod:`ckpt.format.codec`) instead, check that a key shared by several ranks
holds one value (objects and plain tensors alike), reuse a save's plan while the layout does
not change (:mod:`ckpt.dcp.plancache`), and check the whole state against the checkpoint
before reading anything (bringing packed values to the checkpoint's form first:
:class:`PackedNode`).

Size: DCP's two planner classes and their replica check; the plan cache, coverage check and
packed optimizer state are modules of their own.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any, Iterable

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import (
    create_default_global_save_plan,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItemType

from ckpt.dcp.plancache import (
    GlobalPlan,
    SavePlanCache,
    RankPlan,
    Replan,
    holder_sets,
    layout_signature,
    replica_digest,
)
from ckpt.dcp.savecost import SaveCost
from ckpt.errors import CorruptCheckpointError, StateMismatchError
from ckpt.format import coverage_problem, crc32c_of, decode_object, dtype_name, encode_object

__all__ = ["SafeSavePlanner", "SafeLoadPlanner", "PackedNode", "placeholder", "tiling_problem"]

_HASH_KEY = "__ckpt_object_crc__:"
_CACHED_KEY = "__ckpt_cached__"  # an unusable local plan: [cached plan id, {set: digest}]
_PLAN_KEY = "__ckpt_plan__"  # a full central plan: [plan id, {set: [keys]}]
_MAX_KEYS_NAMED = 10


def _is_plain_tensor(obj) -> bool:
    """A tensor each rank holds whole: not a DTensor, ShardedTensor or other tensor that
    names its own chunks (DCP's ``__create_write_items__``, as ``ckpt.dcp._shm.ShardView``
    does): those are sharded, and DCP tells their shards apart by offset."""
    return (isinstance(obj, torch.Tensor) and not hasattr(obj, "__create_write_items__")
            and not hasattr(obj, "local_shards"))


def _tensor_crc(t: torch.Tensor) -> int:
    """CRC32C of a tensor's bytes, exactly as the writer checksums them."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return crc32c_of([t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""])


class SafeSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with non-tensor values encoded as JSON instead of pickles,
    a replica check, a linear check of the global plan, and plan caching.

    DCP saves a key that several ranks have from one rank only: it assumes replicas. When the
    ranks' values differ, the others' are silently lost (a per-rank counter or generator
    state saved under a shared key comes back as rank 0's on every rank). So each rank sends,
    with its local plan, a CRC32C of each object's encoding and of each plain (non-DTensor)
    tensor's bytes, and the coordinator refuses the save, before anything is written, when a
    key's checksums differ between ranks. Checksums travel in the plans DCP already gathers
    on the save's process group: no collective of its own.

    ``cache``: a :class:`ckpt.dcp.plancache.SavePlanCache` (its module docstring has the
    protocol): a rank whose layout did not change since the cached plan sends an empty plan
    with one digest per holder set instead, and the coordinator compares those (a mismatch
    makes the save plan again in full, which names the key). ``replan``: plan in full
    whatever the cache holds (the second try of a save the cache could not serve).

    Cost: one CRC32C pass over this rank's plain tensors (in a full plan a rank cannot tell
    which of them other ranks share before the plans meet; with a cached plan, over its
    replicated ones only), on the thread that saves; DTensor and ShardedTensor shards are
    never read here. ``known_crcs`` keeps the results by key (plain tensors, and objects'
    encodings): they are the CRCs of the very bytes the writer writes, which it reuses
    instead of checksumming them again. ``cost``: a :class:`ckpt.dcp.savecost.SaveCost`
    that the planning and checksum time is added to. ``partial``: the save holds one node's
    share of a job-wide checkpoint (its manifest's ``span``): a tensor's chunks in the
    global plan must not overlap, but need not cover it (other nodes hold the rest).
    """

    known_crcs: dict[str, int]

    def __init__(self, *args, cost=None, cache: SavePlanCache | None = None, replan: bool = False,
                 partial: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.cost = cost if cost is not None else SaveCost()  # see ckpt.dcp.savecost
        self.cache = cache
        self.replan = replan
        self.partial = partial
        self.known_crcs = {}
        self._encoded: dict[str, bytes] = {}
        self._signature: tuple | None = None

    @staticmethod
    def digest_key(fqn: str) -> str:
        """The ``planner_data`` key under which a local plan carries ``fqn``'s checksum."""
        return _HASH_KEY + fqn

    def create_local_plan(self) -> SavePlan:
        with self.cost.phase("plan"):
            cached = self._cached_rank_plan()
            plan = self._full_local_plan() if cached is None else None
        if cached is not None:  # the layout is the cached plan's: only its replica digests
            with self.cost.phase("crc"):
                digests = {sid: replica_digest([self._value_crc(k) for k in keys])
                           for sid, keys in cached.sets.items()}
            self.plan = SavePlan([], usable=False,
                                 planner_data={_CACHED_KEY: [cached.plan_id, digests]})
            return self.plan
        with self.cost.phase("crc"):
            hashes = self._replica_checksums(plan)
        if hashes:
            plan = dataclasses.replace(plan, planner_data={**(plan.planner_data or {}),
                                                           **hashes})
        self.plan = plan
        return plan

    def _cached_rank_plan(self) -> RankPlan | None:
        """This rank's cached plan when the state's layout is the one it was made for."""
        cache = self.cache
        if cache is None:
            return None
        self._signature = layout_signature(self.state_dict)
        cached = cache.rank_plan
        if cached is not None and not self.replan and cached.signature == self._signature:
            cache.num_cached_plans += 1
            return cached
        cache.num_full_plans += 1
        return None

    def _full_local_plan(self) -> SavePlan:
        plan = create_default_local_save_plan(self.state_dict, self.is_coordinator)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        return plan

    def _value_crc(self, fqn: str) -> int:
        """CRC32C of a replicated value: an object's encoding or a plain tensor's bytes."""
        obj = self.state_dict[fqn]
        if isinstance(obj, torch.Tensor):
            crc = _tensor_crc(obj)
        else:
            data = encode_object(obj, fqn)
            self._encoded[fqn] = data  # written as is: encoded once per save
            crc = crc32c_of([data])
        self.known_crcs[fqn] = crc
        return crc

    def _replica_checksums(self, plan: SavePlan) -> dict[str, list]:
        hashes = {}
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                hashes[self.digest_key(fqn)] = [self._value_crc(fqn)]
            elif _is_plain_tensor(self.state_dict.get(fqn)):
                t = self.state_dict[fqn]
                hashes[self.digest_key(fqn)] = [self._value_crc(fqn), str(t.dtype),
                                                str(list(t.shape))]
        return hashes

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """Every rank: the central plan, or (unusable) this rank's cached final plan."""
        with self.cost.phase("plan"):
            cache = self.cache
            if not new_plan.usable:
                if cache is None or cache.rank_plan is None:
                    raise AssertionError("a cached central plan reached a rank without one")
                # This save's storage_data (the writer's: its save id), never a cached one;
                # a writer's storage_data with a ``reuse`` method takes what depends on the
                # layout only from the cached plan's (ckpt.dcp.writer: a part's refs).
                data, cached_data = new_plan.storage_data, cache.rank_plan.final_plan.storage_data
                reuse = getattr(data, "reuse", None)
                self.plan = dataclasses.replace(
                    cache.rank_plan.final_plan,
                    storage_data=reuse(cached_data) if reuse is not None else data)
                return self.plan
            info = (new_plan.planner_data or {}).get(_PLAN_KEY)
            final = dataclasses.replace(new_plan, planner_data=None)
            if cache is not None:
                cache.rank_plan = None if info is None or self._signature is None else \
                    RankPlan(self._signature, final,
                             info[0], {int(sid): tuple(keys) for sid, keys in info[1].items()})
            self.plan = final
            return final

    def create_global_plan(self, all_plans: list[SavePlan]):
        """On the coordinator: the cached plan when every rank may use it, else refuse keys
        whose replicas differ, then the global plan (cached when there is a cache)."""
        with self.cost.phase("plan"):
            usable = sum(1 for p in all_plans if p.usable)
            if usable == len(all_plans):
                return self._checked_global_plan(all_plans)
            if usable == 0:
                return self._cached_global_plan(all_plans)
            raise Replan(f"{len(all_plans) - usable} of {len(all_plans)} ranks reused a cached "
                         f"plan that the others could not")

    def _cached_global_plan(self, all_plans: list[SavePlan]):
        cached = self.cache.global_plan if self.cache is not None else None
        if cached is None or len(cached.sets_of_rank) != len(all_plans):
            raise Replan("the coordinator holds no cached plan for these ranks")
        digests: dict[int, dict[str, list[int]]] = {}
        for rank, plan in enumerate(all_plans):
            plan_id, by_set = (plan.planner_data or {}).get(_CACHED_KEY, (None, {}))
            if plan_id != cached.plan_id or tuple(sorted(int(s) for s in by_set)) != \
                    cached.sets_of_rank[rank]:
                raise Replan(f"rank {rank} holds another cached plan")
            for sid, digest in by_set.items():
                digests.setdefault(int(sid), {}).setdefault(digest, []).append(rank)
        differ = sorted(sid for sid, values in digests.items() if len(values) > 1)
        if differ:
            raise Replan("replicated values differ within the holder sets of ranks "
                         + "; ".join(_ranks(list(cached.set_ranks[s])) for s in differ))
        self.metadata = cached.metadata
        self.global_plan = [SavePlan([], usable=False) for _ in all_plans]
        return self.global_plan, cached.metadata

    def _checked_global_plan(self, all_plans: list[SavePlan]):
        ranks_by_value: dict[str, dict[tuple, list[int]]] = {}
        for rank, plan in enumerate(all_plans):
            for key, value in (plan.planner_data or {}).items():
                if key.startswith(_HASH_KEY):
                    ranks_by_value.setdefault(key[len(_HASH_KEY):], {}).setdefault(
                        tuple(value), []).append(rank)
        conflicts = [f"{fqn!r} ({' | '.join(_ranks(r) for r in groups.values())})"
                     for fqn, groups in sorted(ranks_by_value.items()) if len(groups) > 1]
        if conflicts:
            named = ", ".join(conflicts[:_MAX_KEYS_NAMED])
            more = len(conflicts) - _MAX_KEYS_NAMED
            raise ValueError(
                f"state keys hold different values on different ranks (ranks grouped by "
                f"value): {named}{f' and {more} more' if more > 0 else ''}. A key present on "
                f"several ranks is saved once, from one rank, as a replica; give per-rank "
                f"values a per-rank key (wrap the object in ckpt.dcp.stateful.PerRankState, or "
                f"nest it under f'rank{{rank}}'; docs/store.md, 'Per-rank state').")
        # The flatten mappings are merged here, not by DCP: its ``dict(ChainMap(*mappings))``
        # looks each rank's own keys (per-rank state) up through every earlier rank's map,
        # which is quadratic in the ranks (bench/bench_scale.py). Same result: the first
        # plan holding a key gives its path, keys in the same order.
        merged: dict = {}
        for p in reversed(all_plans):
            merged.update((k, v) for k, v in (p.planner_data or {}).items()
                          if not k.startswith(_HASH_KEY))
        cleaned = [dataclasses.replace(p, planner_data=None) for p in all_plans]
        global_plan, metadata = create_default_global_save_plan(
            self._dedup_save_plans(cleaned))
        if self.flatten_state_dict:
            metadata = dataclasses.replace(metadata, planner_data=merged)
        # Not DCP's _validate_global_plan: it compares chunks pairwise (quadratic); the
        # format's coverage rule is linear (ckpt.format.coverage).
        partial = len(all_plans) == 1 or self.partial
        problems = [p for fqn, md in metadata.state_dict_metadata.items()
                    if isinstance(md, TensorStorageMetadata)
                    and (p := tiling_problem(fqn, md.size, md.chunks, partial=partial))]
        if problems:
            raise ValueError(f"Failed to validate global plan: {'; '.join(problems[:10])}"
                             + (f" and {len(problems) - 10} more" if len(problems) > 10
                                else ""))
        if self.cache is not None:
            plan_id = SavePlanCache.new_id()
            set_ranks, sets = holder_sets(all_plans)
            self.cache.global_plan = GlobalPlan(plan_id, metadata, set_ranks,
                                                [tuple(sorted(s)) for s in sets])
            global_plan = [dataclasses.replace(p, planner_data={_PLAN_KEY: [plan_id, s]})
                           for p, s in zip(global_plan, sets)]
        self.global_plan, self.metadata = global_plan, metadata
        return global_plan, metadata

    def transform_object(self, write_item, object):  # noqa: A002 - DCP's signature
        if write_item.type == WriteItemType.BYTE_IO:
            fqn = write_item.index.fqn
            data = self._encoded.get(fqn)
            return io.BytesIO(data if data is not None else encode_object(object, fqn))
        return object


def tiling_problem(fqn: str, size: Any, chunks: Any, *, partial: bool = False) -> str | None:
    """What is wrong with the ``chunks`` (objects with ``offsets`` and ``sizes``) a global
    save plan gives the tensor ``fqn`` of shape ``size`` (None: nothing): a chunk outside the
    tensor, or chunks that do not tile it (format.md's coverage rule; ``partial``: they may
    leave elements uncovered, never overlap). The sentence names the key and the chunk."""
    size = list(size)
    if not size:
        return None  # a 0-d tensor is its one chunk
    boxes = []
    for i, c in enumerate(chunks):
        offs, lens = list(c.offsets), list(c.sizes)
        if len(offs) != len(size) or len(lens) != len(size) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(offs, lens, size)):
            return (f"key {fqn!r}.chunks[{i}] (offsets {offs}, sizes {lens}) lies outside "
                    f"the tensor's shape {size}")
        boxes.append((offs, lens))
    return coverage_problem(size, boxes, where=f"key {fqn!r}", partial=partial)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _fixes(missing: list[str], unexpected: list[str], mismatched: list[str]) -> list[str]:
    """One "Fix:" line per kind of problem found (a mismatch's kind is the word after its
    key: "shape", "dtype", or "checkpoint" for a tensor/object swap)."""
    kinds = {m.split(": ", 1)[1].split(" ", 1)[0] for m in mismatched}
    out = []
    if missing or unexpected:
        out.append("  Fix (keys): load into the model/optimizer the checkpoint was saved from, "
                   "or pass strict=False to load only the keys both have"
                   + (", or ignore_keys=(prefix, ...) to leave the checkpoint keys under "
                      "those prefixes unloaded" if unexpected and not missing else "") + ".")
    if "shape" in kinds:
        out.append("  Fix (shape): build the model with the configuration it was saved with "
                   "(sizes, vocabulary, layers); a different layout of the same model reshards "
                   "by itself. strict=False does not skip a mismatched key.")
    if "dtype" in kinds:
        saved = next(m.split(": dtype ", 1)[1].split(" ", 1)[0] for m in mismatched
                     if ": dtype " in m)
        out.append(f"  Fix (dtype): give the state the checkpoint's dtype before loading (e.g. "
                   f"model.to(torch.{saved})) and cast after. strict=False does not skip a "
                   f"mismatched key.")
    if "checkpoint" in kinds:
        out.append("  Fix (tensor/object): the key holds another kind of value than when "
                   "saved; rename the new value's key. strict=False does not skip a "
                   "mismatched key.")
    return out


class PackedNode(dict):
    """A node of a state dict whose values are saved packed: one value where an earlier or
    another form has many (e.g. an optimizer's param groups: :mod:`ckpt.dcp.optim_state`).

    Saving sees a dict like any other. Before a load is planned, :class:`SafeLoadPlanner`
    calls ``match_checkpoint(path, state_dict, metadata)`` on every such node of the state
    (``path``: where it is in ``state_dict``): when the checkpoint holds these values in
    another form, the node puts placeholders (:func:`placeholder`) at the checkpoint's
    paths (in itself or around it in ``state_dict``), so the load asks for the checkpoint's
    keys; its owner's ``load_state_dict`` then unpacks whichever form came back. A node
    that leaves the state alone loads as any dict does (missing keys are reported).

    After every rank read and verified its part and before anything is applied to the
    state, the planner calls ``check_loaded(path, objects)`` (``objects``: every object
    read, by its path in the state dict): a node raises there what its owner's
    ``load_state_dict`` would refuse (``StateMismatchError``), so a refused load leaves the
    state as it was.
    """

    def match_checkpoint(self, path: tuple, state_dict: dict, metadata: Metadata) -> None:
        raise NotImplementedError

    def check_loaded(self, path: tuple, objects: dict[tuple, Any]) -> None:
        """Raise what the owner would refuse of the objects read (default: nothing)."""


def placeholder(md, like: Any = None) -> Any:
    """What a state holds to be loaded with a checkpoint value of storage metadata ``md``:
    an empty tensor of its shape and dtype (like ``like``, e.g. a DTensor shard of the same
    global shape, when given one of that shape; else on the CPU), or None for an object."""
    if isinstance(md, TensorStorageMetadata):
        if isinstance(like, torch.Tensor) and tuple(like.shape) == tuple(md.size):
            return torch.empty_like(like, dtype=md.properties.dtype)
        return torch.empty(tuple(md.size), dtype=md.properties.dtype)
    return None


def _packed_nodes(value: Any, path: tuple = ()) -> list[tuple[tuple, PackedNode]]:
    if isinstance(value, PackedNode):
        return [(path, value)]
    if not isinstance(value, dict):
        return []
    return [found for k, v in value.items() for found in _packed_nodes(v, path + (k,))]


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that decodes JSON objects and checks the whole state first.

    Before any byte is read, the state to load into is compared with the checkpoint and every
    missing key, unexpected key, shape and dtype mismatch is reported in one error.
    """

    def __init__(self, strict: bool = True, source: str = "checkpoint",
                 ignore_prefixes: tuple[str, ...] = ()):
        super().__init__(allow_partial_load=not strict)
        self.strict = strict
        self.source = source
        self.ignore_prefixes = tuple(ignore_prefixes)

    def set_up_planner(self, state_dict, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        """DCP's, after every :class:`PackedNode` of the state took the checkpoint's form."""
        self._packed = _packed_nodes(state_dict)
        if metadata is not None:
            for path, node in self._packed:
                node.match_checkpoint(path, state_dict, metadata)
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def check_loaded(self, objects: Iterable[tuple[ReadItem, bytes]]) -> None:
        """Before anything read is applied: every :class:`PackedNode` of the state checks the
        objects read (``objects``: each read item with its bytes) and raises what its owner
        would refuse. Call on every rank after a successful read, before applying it."""
        if not getattr(self, "_packed", None):
            return
        values = {}
        for req, data in objects:
            fqn = req.dest_index.fqn
            path = self.mappings[fqn] if self.flatten_state_dict else (fqn,)
            values[tuple(path)] = self._decode(req, data)
        for path, node in self._packed:
            node.check_loaded(path, values)

    def create_local_plan(self) -> LoadPlan:
        """Plan this rank's reads; record (not raise) its problems for the global check."""
        md = self.metadata.state_dict_metadata
        missing, mismatched = [], []
        for fqn, obj in self.state_dict.items():
            if fqn not in md:
                missing.append(fqn)
                continue
            saved = md[fqn]
            is_tensor = isinstance(obj, torch.Tensor)
            if isinstance(saved, TensorStorageMetadata) != is_tensor:
                kind = "a tensor" if isinstance(saved, TensorStorageMetadata) else "an object"
                mismatched.append(f"{fqn}: checkpoint holds {kind}, state holds "
                                  f"{type(obj).__name__}")
                continue
            if is_tensor:
                shape = tuple(obj.shape)  # DTensor reports its global shape
                if tuple(saved.size) != shape:
                    mismatched.append(f"{fqn}: shape {list(saved.size)} in checkpoint, "
                                      f"{list(shape)} in state")
                elif saved.properties.dtype != obj.dtype:
                    mismatched.append(f"{fqn}: dtype {dtype_name(saved.properties.dtype)} in "
                                      f"checkpoint, {str(obj.dtype).removeprefix('torch.')} "
                                      f"in state")
        bad = set(missing) | {m.split(":", 1)[0] for m in mismatched}
        requested = sorted(k for k in self.state_dict if k in md)
        self.state_dict = {k: v for k, v in self.state_dict.items() if k not in bad}
        # Not super(): DefaultLoadPlanner re-flattens the original state when keys are
        # missing (a pre-2.4 compatibility path), which would undo the filtering above.
        plan = create_default_local_load_plan(self.state_dict, self.metadata, False)
        return dataclasses.replace(plan, planner_data={
            "missing": sorted(missing), "mismatched": mismatched, "requested": requested})

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        """On the coordinator: one error listing every problem of every rank.

        A checkpoint key is *unexpected* only if no rank asked for it (per-rank keys such as
        each rank's RNG state are asked for by one rank each).
        """
        missing: set[str] = set()
        mismatched: list[str] = []
        requested: set[str] = set()
        for plan in global_plan:
            data = plan.planner_data or {}
            missing.update(data.get("missing", ()))
            for m in data.get("mismatched", ()):
                if m not in mismatched:
                    mismatched.append(m)
            requested.update(data.get("requested", ()))
        if self.strict:
            unexpected = sorted(k for k in set(self.metadata.state_dict_metadata) - requested
                                if not k.startswith(self.ignore_prefixes))
            missing_list = sorted(missing)
        else:
            unexpected, missing_list = [], []
        if missing_list or unexpected or mismatched:
            lines = [f"state does not match {self.source}:"]
            if missing_list:
                lines.append(f"  {len(missing_list)} key(s) in the state but not in the "
                             f"checkpoint: {', '.join(missing_list)}")
            if unexpected:
                lines.append(f"  {len(unexpected)} key(s) in the checkpoint but not in the "
                             f"state: {', '.join(unexpected)}")
            for m in mismatched:
                lines.append(f"  mismatch: {m}")
            lines.extend(_fixes(missing_list, unexpected, mismatched))
            raise StateMismatchError("\n".join(lines), missing=missing_list,
                                     unexpected=unexpected, mismatched=mismatched)
        return [dataclasses.replace(p, planner_data=None) for p in global_plan]

    def _decode(self, read_item: ReadItem, data: bytes) -> Any:
        try:
            return decode_object(data)
        except (ValueError, TypeError, RuntimeError) as exc:  # bad JSON, UTF-8 or tag payload
            fqn = read_item.storage_index.fqn
            raise CorruptCheckpointError(
                f"{self.source}: object {fqn!r} is not a ckpt JSON value ({exc}); the "
                f"checkpoint is corrupt or was not written by ckpt (its bytes are never "
                f"unpickled). Load an earlier step.", path=self.source) from None

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = self._decode(read_item, value.getvalue())
        from torch.distributed.checkpoint._traverse import set_element

        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
