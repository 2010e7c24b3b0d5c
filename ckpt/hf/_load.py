"""``load_hf``: a Hugging Face folder's weights into a state dict of any layout, each rank
reading only the bytes of its own slices.

For each tensor of the state, the rank's piece of it is a box of the global tensor (a
DTensor's local shard: ``__create_chunk_list__``, the box DCP uses; a plain tensor: all of
it). The rows of that box along dim 0 are one contiguous byte range of the safetensors
file, read in pieces of a few MiB (several at once, on ``num_threads`` threads); the other
dims are cut from each piece. So a shard along dim 0 (FSDP2, column-parallel TP, a
vocabulary-parallel embedding) reads exactly its bytes, and a shard along another dim (a
row-parallel weight) reads the whole rows it needs. On local disk a piece whose dtype and
columns match is read straight into the tensor's memory; otherwise it passes through one
buffer per thread and is cast on the copy. At most ``num_threads`` pieces are in memory at
once: a rank's memory grows by its shard (already allocated by the caller) and those
pieces, never by a full tensor.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ckpt.errors import CorruptCheckpointError, StateMismatchError
from ckpt.hf._folder import HFFolder
from ckpt.hf._safetensors import TensorEntry
from ckpt.ranks import Agreement, cpu_group

__all__ = ["HFLoadReport", "load_hf"]

_INFLIGHT_BYTES = 64 << 20  # pieces in memory at once, over all threads
_MIN_PIECE_BYTES, _MAX_PIECE_BYTES = 1 << 20, 16 << 20
_SHOWN = 5  # names listed per kind of problem in the one-line error


@dataclass
class HFLoadReport:
    """What :func:`load_hf` did on this rank."""

    loaded: list[str] = field(default_factory=list)  # state keys filled
    missing: list[str] = field(default_factory=list)  # state keys the folder lacks (strict=False)
    unexpected: list[str] = field(default_factory=list)  # folder names no rank asked for
    bytes_read: int = 0  # from storage by this rank: index, headers, config, tensor bytes
    tensor_bytes_read: int = 0  # of which tensor bytes
    num_reads: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class _Item:
    key: str
    name: str
    file: str
    entry: TensorEntry
    dest: torch.Tensor  # this rank's piece of the tensor (its local shard)
    offsets: tuple[int, ...]  # the piece's box in the global tensor
    sizes: tuple[int, ...]


def _listed(items: list[str]) -> str:
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def _castable(src: torch.dtype, dst: torch.dtype) -> bool:
    return src == dst or (src.is_floating_point and dst.is_floating_point)


def _piece_of(key: str, value: torch.Tensor) -> tuple[torch.Tensor, tuple, tuple]:
    """This rank's local tensor of ``value`` and its box ``(offsets, sizes)``."""
    if isinstance(value, DTensor):
        if any(p.is_partial() for p in value.placements):
            raise ValueError(f"state key {key!r} is a DTensor with a Partial placement "
                             f"({value.placements}); load into the model's parameters")
        chunks = value.__create_chunk_list__()
        local = value.to_local()
        if len(chunks) != 1 or tuple(local.shape) != tuple(chunks[0].sizes):
            raise ValueError(f"state key {key!r}: this rank's shard of {value.placements} is "
                             f"not one box of the tensor; shard it evenly")
        offsets, sizes = tuple(chunks[0].offsets), tuple(chunks[0].sizes)
    else:
        local, offsets, sizes = value, (0,) * value.dim(), tuple(value.shape)
    if local.device.type == "meta":
        raise ValueError(f"state key {key!r} is on the meta device; materialise the model "
                         f"first (model.to_empty(device=...)), then load")
    return local, offsets, sizes


def _plan(sd: Mapping[str, Any], folder: HFFolder,
          names: Mapping[str, str | list[str]] | None
          ) -> tuple[list[_Item], list[tuple[str, str]], list[str]]:
    """This rank's reads, and its missing and mismatched keys (checked before any read).
    A key named by a list is that many folder tensors stacked on its first dimension: this
    rank reads those of the rows its piece holds, each into its row."""
    items, missing, mismatched = [], [], []
    for key, value in sd.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state key {key!r} holds {type(value).__name__}, not a tensor; a "
                            f"Hugging Face folder holds tensors only: pass the model's "
                            f"state_dict()")
        name = names.get(key, key) if names is not None else key
        if isinstance(name, str):
            pieces = [(name, tuple(value.shape), lambda: _piece_of(key, value))]
        elif value.dim() == 0 or value.shape[0] != len(name):
            mismatched.append(f"{key}: {len(name)} folder tensors stacked on the first "
                              f"dimension, but its shape is {list(value.shape)} in the state")
            continue
        else:
            local, offsets, sizes = _piece_of(key, value)
            pieces = [(name[row], tuple(value.shape[1:]),
                       lambda row=row: (local[row - offsets[0]], offsets[1:], sizes[1:]))
                      for row in range(offsets[0], offsets[0] + sizes[0])]
        for name, shape, piece in pieces:
            if name not in folder.weight_map:
                missing.append((key, name))
                continue
            entry = folder.entry(name)
            named = key if name == key else f"{key} ({name})"
            if entry.shape != shape:
                mismatched.append(f"{named}: shape {list(entry.shape)} in the folder, "
                                  f"{list(shape)} in the state")
            elif not _castable(entry.dtype, value.dtype):
                mismatched.append(f"{named}: dtype {str(entry.dtype).removeprefix('torch.')} in "
                                  f"the folder, {str(value.dtype).removeprefix('torch.')} in the "
                                  f"state (only floating-point tensors are cast)")
            else:
                items.append(_Item(key, name, folder.weight_map[name], entry, *piece()))
    return items, missing, mismatched


def _mismatch_error(where: str, missing: list[tuple[str, str]], unexpected: list[str],
                    mismatched: list[str]) -> StateMismatchError:
    parts = []
    if missing:
        parts.append(f"{len(missing)} key(s) in the state but not in the folder: " + _listed(
            [k if k == n else f"{k} (as {n})" for k, n in missing]))
    if unexpected:
        parts.append(f"{len(unexpected)} tensor(s) in the folder but not in the state: "
                     + _listed(unexpected))
    if mismatched:
        parts.append("mismatch: " + _listed(mismatched))
    fix = ("pass names={state key: folder name} for a model whose names differ, or "
           "strict=False to load what matches" if missing or unexpected else
           "build the model with the folder's config")
    return StateMismatchError(f"state does not match the Hugging Face folder {where}: "
                              + "; ".join(parts) + f"; {fix}",
                              missing=[k for k, _ in missing], unexpected=unexpected,
                              mismatched=mismatched)


class _Reader:
    """Reads the items' pieces on a thread pool; one open file per local weights file."""

    def __init__(self, folder: HFFolder, num_threads: int):
        self.folder = folder
        self.num_threads = max(1, num_threads)
        self.piece_bytes = min(_MAX_PIECE_BYTES,
                               max(_MIN_PIECE_BYTES, _INFLIGHT_BYTES // self.num_threads))
        self.files: dict[str, Any] = {}
        self.buffers = threading.local()
        self.tensor_bytes = 0
        self._lock = threading.Lock()

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.tensor_bytes += nbytes

    def tasks(self, items: list[_Item]) -> list[tuple[_Item, int, int]]:
        """``(item, first row, end row)`` pieces of at most ``piece_bytes`` (one row at least)."""
        out = []
        for item in items:
            if item.dest.numel() == 0:
                continue
            if not item.sizes:  # 0-d: the one element
                out.append((item, 0, 1))
                continue
            rows = max(1, self.piece_bytes // max(1, item.entry.row_bytes))
            first, count = item.offsets[0], item.sizes[0]
            out.extend((item, a, min(a + rows, first + count))
                       for a in range(first, first + count, rows))
        return out

    def open(self, items: list[_Item]) -> None:
        for file in sorted({i.file for i in items}):
            f = self.folder.open_local(file)
            if f is None:
                return
            self.files[file] = f

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()

    def _pread(self, file: str, start: int, view: memoryview) -> None:
        fd, got = self.files[file].fileno(), 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], start + got)
            if not n:
                where = self.folder.describe(file)
                raise CorruptCheckpointError(f"{where} ends before byte {start + len(view)}, "
                                             f"which its header promised; download it again",
                                             path=where)
            got += n
        self.folder.count(len(view))
        self._count(len(view))

    def _buffer(self, nbytes: int) -> torch.Tensor:
        buf = getattr(self.buffers, "t", None)
        if buf is None or buf.numel() < nbytes:
            buf = self.buffers.t = torch.empty(max(nbytes, self.piece_bytes), dtype=torch.uint8)
        return buf[:nbytes]

    def _bytes(self, file: str, start: int, end: int) -> torch.Tensor:
        if file in self.files:
            buf = self._buffer(end - start)
            self._pread(file, start, memoryview(buf.numpy()))
            return buf
        data = self.folder.read(file, start, end)
        self._count(len(data))
        if len(data) != end - start:
            where = self.folder.describe(file)
            raise CorruptCheckpointError(f"{where}: read {len(data)} bytes of [{start}, {end}),"
                                         f" which its header promised; download it again",
                                         path=where)
        # A writable copy: torch refuses to wrap read-only bytes without a warning.
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    @torch.no_grad()
    def run(self, task: tuple[_Item, int, int]) -> None:
        item, a, b = task
        e = item.entry
        if not item.sizes:  # a 0-d tensor
            src = self._bytes(item.file, e.begin, e.end).view(e.dtype).view(())
            item.dest.copy_(src)
            return
        first = item.offsets[0]
        start, end = e.begin + a * e.row_bytes, e.begin + b * e.row_bytes
        dest = item.dest[a - first:b - first]
        whole_rows = item.sizes[1:] == e.shape[1:]
        if (whole_rows and item.file in self.files and dest.dtype == e.dtype
                and dest.device.type == "cpu" and dest.is_contiguous()):
            self._pread(item.file, start, memoryview(dest.reshape(-1).view(torch.uint8).numpy()))
            return
        src = self._bytes(item.file, start, end).view(e.dtype).view(b - a, *e.shape[1:])
        if not whole_rows:
            src = src[(slice(None),) + tuple(slice(o, o + s) for o, s in
                                             zip(item.offsets[1:], item.sizes[1:]))]
        dest.copy_(src)


def load_hf(state: Mapping[str, torch.Tensor] | nn.Module, path: str | HFFolder, *,
            names: Mapping[str, str | list[str]] | None = None, strict: bool = True,
            storage_options: dict[str, Any] | None = None, process_group=None,
            num_threads: int | None = None) -> HFLoadReport:
    """Fill ``state`` in place from the Hugging Face folder ``path`` (a local folder or any
    fsspec URL, e.g. ``s3://bucket/llama``, with ``storage_options``; or an
    :class:`HFFolder` already open): its ``model.safetensors``, or the shards that
    ``model.safetensors.index.json`` lists.

    ``state``: a module (its ``state_dict()`` is filled, so its parameters are) or a dict
    of tensors; values may be plain tensors (read whole) or DTensors (TP, FSDP2, HSDP
    shards: each rank reads only the bytes of its own shard). Floating-point tensors are
    cast to the state's dtype on the way. ``names``: ``{state key: folder name}`` for keys
    whose names differ (the ``names`` of ``hf_export.json``, so an export's names come back);
    keys it does not list are looked up as they are. A key named by a list of ``n`` names
    is ``n`` folder tensors stacked on its first dimension (Mixtral's per-expert weights
    into a model's stacked ``[n_experts, ...]`` ones): each rank reads the ones of the rows
    its shard holds (an expert-parallel rank its own experts).

    ``strict`` (default): a state key the folder lacks, or a folder tensor no rank's state
    asked for, is a ``StateMismatchError`` naming them, raised before any tensor is read;
    ``strict=False`` loads what matches (the report lists the rest). A shape, or a dtype
    that cannot be cast, is a mismatch either way.

    Collective over ``process_group`` (None: the world) when a process group exists: every
    rank calls it, with its own part of the model (pipeline stages hold different keys).
    Two small all-reduces check the plan (whether every rank could plan; every rank's
    mismatches and which folder tensors some rank asked for); one more agrees that every
    rank's reads succeeded, so a failure on one rank raises on all (the others: an error
    saying so). The reads themselves need no
    communication. Nothing is transactional: after a failed load the state may be partly
    filled. Reads go through :class:`ckpt.storage.Storage` (retried; ``num_threads``
    pieces at once, default the storage's). Safetensors only; never pickle.
    """
    t0 = time.perf_counter()
    group = cpu_group(process_group)  # first: it may make the group, with every rank
    agree = Agreement(group)
    sd = state.state_dict() if isinstance(state, nn.Module) else state
    if names is not None and not (isinstance(names, Mapping) and all(
            isinstance(k, str) and (isinstance(v, str) or isinstance(v, list) and v and all(
                isinstance(n, str) for n in v)) for k, v in names.items())):
        raise TypeError("names must map each state key to its name in the folder (str -> str), "
                        "or to the names of the tensors stacked in it (str -> list of str)")
    error: BaseException | None = None
    folder = None
    items: list[_Item] = []
    missing: list[tuple[str, str]] = []
    mismatched: list[str] = []
    try:
        folder = path if isinstance(path, HFFolder) else HFFolder(path, storage_options)
        with torch.no_grad():
            items, missing, mismatched = _plan(sd, folder, names)
    except Exception as exc:  # noqa: BLE001 - agreed below, then raised
        error = exc
    where = folder.url if folder is not None else str(path)
    if not agree.all(error is None):
        raise error or CorruptCheckpointError(
            f"loading {where} failed on another rank (see its error); nothing was read here",
            path=where)
    assert folder is not None
    # One all-reduce: whether some rank's state does not match, and which folder tensors
    # some rank asked for (the others are unexpected).
    own_problem = bool(mismatched) or (strict and bool(missing))
    folder_names = sorted(folder.weight_map)
    asked = {i.name for i in items} | {n for _, n in missing}
    flags = agree.max(int(own_problem), *(int(n in asked) for n in folder_names))
    unexpected = [n for n, f in zip(folder_names, flags[1:]) if not f]
    if flags[0] or (strict and unexpected):
        if own_problem or (strict and unexpected):
            raise _mismatch_error(where, missing if strict else [],
                                  unexpected if strict else [], mismatched)
        raise StateMismatchError(f"the state does not match {where} on another rank (see "
                                 f"its error); nothing was read")
    reader = _Reader(folder, num_threads or folder.storage.default_threads)
    try:
        reader.open(items)
        tasks = reader.tasks(items)
        with ThreadPoolExecutor(reader.num_threads, thread_name_prefix="ckpt-hf") as pool:
            futures = [pool.submit(reader.run, task) for task in tasks]
            done, pending = wait(futures, return_when=FIRST_EXCEPTION)
            for f in pending:
                f.cancel()
            for f in futures:
                if f.done() and not f.cancelled() and f.exception() is not None:
                    raise f.exception()
    except Exception as exc:  # noqa: BLE001 - agreed below, then raised
        error = exc
    finally:
        reader.close()
    if not agree.all(error is None):
        raise error or CorruptCheckpointError(
            f"loading {where} failed on another rank (see its error); this rank's state may "
            f"be partly loaded", path=where)
    return HFLoadReport(loaded=list(dict.fromkeys(i.key for i in items)),
                        missing=list(dict.fromkeys(k for k, _ in missing)),
                        unexpected=unexpected, bytes_read=folder.bytes_read,
                        tensor_bytes_read=reader.tensor_bytes, num_reads=folder.num_reads,
                        seconds=time.perf_counter() - t0)

