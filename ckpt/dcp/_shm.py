"""A staged state handed to another process: described in JSON, rebuilt there over shared memory.

The manager's writer process (:mod:`ckpt.job._writer_process`) persists what the training
process staged into a shared arena (``StagingBuffers(shared=True)``, whose block is a file in
``/dev/shm``: :class:`ckpt.dcp._host_arena.HostArena`). Nothing is pickled: the training
process describes the staged copy (:func:`describe_staged`), the writer maps the block and
rebuilds a state of the same keys over it (:func:`rebuild_staged`), which DCP's planner
flattens and plans as it would the staged copy itself, so the checkpoint is the same.

The description (a JSON object)::

    {"arena": {"path": "/dev/shm/ckpt-staging-...", "nbytes": N},
     "items": [{"path": ["model", "w"], "offset": 0, "dtype": "float32", "shape": [4, 8]},
               {"path": ["model", "s"], "offset": 512, "dtype": "bfloat16", "shape": [2, 8],
                "sharded": {"size": [4, 8], "offsets": [2, 0]}},
               {"path": ["extra", "step"], "object": "<ckpt.format.codec JSON text>"}]}

``path``: DCP's flattening path of the value (its keys and list indices, from
``flatten_state_dict``), so the rebuilt state flattens to the same keys and the manifest
records the same ``planner_data``. ``offset``/``dtype``/``shape``: the tensor's bytes in the
block (this rank's shard, for a DTensor). ``sharded``: the global size and this shard's
offsets, the chunk DCP plans for a DTensor (a DTensor needs its ``DeviceMesh`` to say so,
which the writer process does not have): the writer rebuilds it as a :class:`ShardView`.
Objects (non-tensor values) travel in the checkpoint's own JSON codec, the encoding they
are saved in anyway.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ckpt.dcp._host_arena import HostArena, map_shared
from ckpt.dcp._shards import local_chunks
from ckpt.format import decode_object, dtype_from_name, dtype_name, encode_object

__all__ = ["ShardView", "describe_staged", "rebuild_staged", "SharedBlocks"]


class ShardView(torch.Tensor):
    """This rank's chunk of a sharded tensor over host memory, as DCP's save planner sees a
    DTensor's (one write item at ``offsets`` of a tensor of ``size``), without a mesh.

    The tensor itself is the local chunk (``shape`` is the chunk's); operations on it return
    plain tensors. It implements DCP's checkpointable-tensor hooks
    (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``), which
    DCP's planner helpers call for any tensor that has them.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl
    local: torch.Tensor
    global_size: torch.Size
    global_offsets: torch.Size

    @staticmethod
    def __new__(cls, local: torch.Tensor, size: list[int], offsets: list[int]) -> "ShardView":
        if len(size) != local.dim() or len(offsets) != local.dim():
            raise ValueError(f"shard of shape {list(local.shape)} described with size {size} "
                             f"and offsets {offsets}: one entry per dim expected")
        view = torch.Tensor._make_subclass(cls, local)
        view.local = local
        view.global_size = torch.Size(size)
        view.global_offsets = torch.Size(offsets)
        return view

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=self.global_offsets, sizes=self.local.size())

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, self.global_offsets),
                          type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=self._chunk(),
                              properties=TensorProperties.create_from_tensor(self.local),
                              size=self.global_size))]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.local


def _is_dtensor(value: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(value, DTensor)


def describe_staged(staged: dict[str, Any], arena: HostArena,
                    known: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The JSON description of ``staged`` (a copy staged into the shared ``arena``; module
    docstring). Raises ``ValueError`` naming the key when a tensor does not lie in the arena
    (a state over its staging budget) or a DTensor's shard is not one chunk, and
    ``TypeError`` for a value the checkpoint's codec cannot encode.

    ``known``: the tensor items of earlier descriptions by their flattened key, valid only
    while the copy is staged into the same arena with the same layout (the same keys,
    shapes, dtypes and shards: :attr:`StagingBuffers.layout_version` unchanged); a tensor
    found there is not described again, and each one described is added. Objects are
    described at every call (their values change from save to save)."""
    if arena.path is None and arena.nbytes:
        raise ValueError("the staged copy is not in shared memory: stage it into "
                         "StagingBuffers(shared=True) to hand it to a writer process")
    base = arena.data.data_ptr() if arena.nbytes else 0
    flat, mappings = flatten_state_dict(staged)
    items = []
    for fqn, value in flat.items():
        if not isinstance(value, torch.Tensor):
            path = [k if isinstance(k, (str, int)) else str(k) for k in mappings[fqn]]
            items.append({"path": path, "object": encode_object(value, fqn).decode()})
            continue
        item = known.get(fqn) if known is not None else None
        if item is None:
            item = _describe_tensor(fqn, value, mappings[fqn], base, arena.nbytes)
            if known is not None:
                known[fqn] = item
        items.append(item)
    return {"arena": {"path": arena.path or "", "nbytes": arena.nbytes}, "items": items}


def _describe_tensor(fqn: str, value: torch.Tensor, mapping: tuple, base: int,
                     arena_bytes: int) -> dict[str, Any]:
    """The item of one staged tensor (module docstring), its bytes at ``base`` + offset."""
    path = [k if isinstance(k, (str, int)) else str(k) for k in mapping]
    local = value.to_local() if _is_dtensor(value) else value
    nbytes = local.numel() * local.element_size()
    offset = local.data_ptr() - base
    if not local.is_contiguous() or offset < 0 or offset + nbytes > arena_bytes \
            or (nbytes and local.device.type != "cpu"):
        raise ValueError(f"{fqn}: not in the shared staging memory (a state over its "
                         f"staging budget is saved from the live tensors, which a writer "
                         f"process cannot read): save with writer='thread', or without "
                         f"staging_budget_bytes")
    item = {"path": path, "offset": offset, "dtype": dtype_name(local.dtype),
            "shape": list(local.shape)}
    if _is_dtensor(value):
        chunks = local_chunks(value)
        if len(chunks) != 1 or list(chunks[0].sizes) != list(local.shape):
            raise ValueError(f"{fqn}: a DTensor whose local shard is not one chunk of its "
                             f"own shape cannot be handed to a writer process: save with "
                             f"writer='thread'")
        item["sharded"] = {"size": list(value.shape), "offsets": list(chunks[0].offsets)}
    return item


class SharedBlocks:
    """The writer process's mapping of the training process's shared arena, kept while the
    arena is the same (one mapping for every save of an unchanged layout)."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.block: torch.Tensor | None = None

    def get(self, path: str, nbytes: int) -> torch.Tensor:
        """The block at ``path``, at least ``nbytes`` long, mapped (again when it changed)."""
        if self.path != path or self.block is None or self.block.numel() < nbytes:
            self.block, self.path = None, None  # the old mapping goes with its last view
            self.block, self.path = map_shared(path, nbytes), path
        return self.block

    def close(self) -> None:
        self.block, self.path = None, None


def _checked_list(value: Any, where: str, of: type) -> list:
    if not isinstance(value, list) or not all(isinstance(v, of) and not isinstance(v, bool)
                                              for v in value):
        raise ValueError(f"hand-off {where}: expected a list of {of.__name__}, got {value!r:.80}")
    return value


def rebuild_staged(description: dict[str, Any], blocks: SharedBlocks) -> dict[str, Any]:
    """The state ``description`` (:func:`describe_staged`'s) describes, over the shared block
    (mapped through ``blocks``): nested dicts along each path, tensors as read-only views of
    the block (:class:`ShardView` for a shard), objects decoded. Raises ``ValueError``
    naming the item for a description that does not fit the block."""
    arena = description["arena"]
    nbytes = int(arena["nbytes"])
    block = blocks.get(str(arena["path"]), nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
    state: dict[Any, Any] = {}
    for i, item in enumerate(description["items"]):
        path = item["path"]
        if not isinstance(path, list) or not path or not all(
                isinstance(k, (str, int)) and not isinstance(k, bool) for k in path):
            raise ValueError(f"hand-off item {i}: path {path!r:.80} is not a list of keys")
        if "object" in item:
            value = decode_object(item["object"].encode(), f"hand-off item {'.'.join(map(str, path))}")
        else:
            shape = _checked_list(item["shape"], f"item {i} shape", int)
            dtype = dtype_from_name(item["dtype"], f"hand-off item {i}")
            offset = int(item["offset"])
            size = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
            if offset < 0 or offset + size > nbytes:
                raise ValueError(f"hand-off item {'.'.join(map(str, path))}: bytes {offset}.."
                                 f"{offset + size} lie outside the {nbytes}-byte block")
            value = block[offset:offset + size].view(dtype).view(shape)
            sharded = item.get("sharded")
            if sharded is not None:
                value = ShardView(value, _checked_list(sharded["size"], f"item {i} size", int),
                                  _checked_list(sharded["offsets"], f"item {i} offsets", int))
        node = state
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return state
