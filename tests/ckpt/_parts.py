"""Helpers for the tests of parts (format version 2): a one-process save whose tensors are
written as chunks, a checkpoint of one tensor in many chunks, and a storage that records
what it reads.

``save_chunked`` runs the real save path (DCP's ``save`` with our ``CkptWriter`` and
``SafeSavePlanner``), only the planner cuts the chosen plain tensors into the given chunks,
as a sharded tensor's shards are cut: the writer puts them in the process's part.
``craft_chunked`` writes one float32 tensor of ``n`` one-element chunks directly with the
format's own writers (``Part.to_json_bytes``, ``Manifest.to_json_bytes``), spread over
``num_parts`` ranks' parts (version 2) or listed in one manifest (version 1): DCP's save
checks a plan's chunks pairwise, too slow for the chunk counts these tests need.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Any, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ckpt.dcp.planners import SafeSavePlanner
from ckpt.dcp.writer import CkptWriter
from ckpt.format import (
    MANIFEST_NAME,
    FileRecord,
    ItemLocation,
    Manifest,
    Part,
    PartRecord,
    Span,
    crc32c_of,
    part_name,
    part_sha256,
    step_dirname,
)
from ckpt.storage import Storage

__all__ = ["save_chunked", "even_chunks", "craft_chunked", "RecordingStorage"]

Box = tuple[Sequence[int], Sequence[int]]


class _ChunkedSavePlanner(SafeSavePlanner):
    """Writes the tensors of ``chunks`` (key -> boxes) as those chunks (SHARD items)."""

    def __init__(self, chunks: dict[str, list[Box]], **kwargs):
        super().__init__(**kwargs)
        self.chunks = chunks

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            boxes = self.chunks.get(item.index.fqn)
            if boxes is None:
                items.append(item)
                continue
            td = item.tensor_data
            for offs, sizes in boxes:
                offs, sizes = torch.Size(offs), torch.Size(sizes)
                items.append(WriteItem(
                    index=MetadataIndex(item.index.fqn, offs), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(ChunkStorageMetadata(offs, sizes),
                                                td.properties, td.size)))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item):
        if write_item.index.fqn not in self.chunks:
            return super().resolve_data(write_item)
        t = self.state_dict[write_item.index.fqn]
        chunk = write_item.tensor_data.chunk
        for dim, (o, s) in enumerate(zip(chunk.offsets, chunk.sizes)):
            t = t.narrow(dim, o, s)
        return t


def even_chunks(n: int, count: int) -> list[Box]:
    """``count`` chunks of about ``n / count`` elements of a 1-d tensor of ``n``."""
    step = -(-n // count)
    return [([i], [min(step, n - i)]) for i in range(0, n, step)]


def save_chunked(root: str | Storage, step: int, state: dict[str, Any],
                 chunks: dict[str, list[Box]], *, span: Span | None = None) -> Manifest:
    """Save ``state`` (flat, plain values) as ``step`` in one process, the tensors named in
    ``chunks`` cut into those chunks (``span``: the version's, chunks that leave a gap then
    make it one node's share); returns the committed (root) manifest."""
    storage = root if isinstance(root, Storage) else Storage(root)
    storage.makedirs("")
    writer = CkptWriter(storage, step, step_dirname(step),
                        manifest_extra={"world_size": 1, "layout": {}, "versions": {},
                                        "user_metadata": {}, "span": span})
    with warnings.catch_warnings():  # DCP warns of one process even when asked for one
        warnings.filterwarnings("ignore", message=".*assuming the intent is")
        dcp.save(state, storage_writer=writer, planner=_ChunkedSavePlanner(chunks),
                 no_dist=True)
    return writer.manifest


class RecordingStorage(Storage):
    """Storage that records the files it reads (whole, by range, or opened locally)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads: list[str] = []
        self._lock = threading.Lock()

    def _record(self, rel: str) -> None:
        with self._lock:
            self.reads.append(rel)

    def read_bytes(self, rel, start=None, end=None, **kwargs):
        self._record(rel)
        return super().read_bytes(rel, start, end, **kwargs)

    def open_local(self, rel):
        self._record(rel)
        return super().open_local(rel)


def craft_chunked(root: str, step: int, n: int, *, num_parts: int = 1, version: int = 2,
                  key: str = "t", save_id: str = "abcdef012345") -> torch.Tensor:
    """A checkpoint of ``key``: ``arange(n)`` as float32, in ``n`` one-element chunks; each of
    ``num_parts`` ranks wrote a contiguous share to one data file. Returns the tensor."""
    storage = Storage(root)
    folder = step_dirname(step)
    storage.makedirs(folder)
    values = torch.arange(n, dtype=torch.float32)
    raw = values.numpy().tobytes()
    files, parts, chunks = {}, {}, []
    share = -(-n // num_parts)
    for rank in range(num_parts):
        lo, hi = rank * share, min(n, (rank + 1) * share)
        data = raw[lo * 4:hi * 4]
        name = f"r{rank:05d}_{save_id}_0.bin"
        storage.write_bytes(f"{folder}/{name}", data, durable=False)
        files[name] = FileRecord(len(data), crc32c_of([data]), rank)
        mine = [{"offsets": [i], "sizes": [1],
                 "location": ItemLocation(name, (i - lo) * 4, 4,
                                          crc32c_of([data[(i - lo) * 4:(i - lo) * 4 + 4]]))}
                for i in range(lo, hi)]
        chunks += mine
        if version >= 2:
            pdata = Part(rank, {key: mine}).to_json_bytes(step, save_id)
            pname = part_name(rank, save_id)
            storage.write_bytes(f"{folder}/{pname}", pdata, durable=False)
            files[pname] = FileRecord(len(pdata), crc32c_of([pdata]), rank)
            parts[pname] = PartRecord(rank, part_sha256(pdata))
    tensor = {"dtype": "float32", "shape": [n], "chunks": [] if version >= 2 else chunks,
              "sharded": version >= 2}
    manifest = Manifest(step=step, save_id=save_id, created_unix=1.0, tensors={key: tensor},
                        objects={}, files=files, planner_data={key: [key]}, parts=parts,
                        world_size=num_parts, format_version=version, complete=version < 2)
    storage.write_bytes(f"{folder}/{MANIFEST_NAME}", manifest.to_json_bytes(), durable=False)
    return values
