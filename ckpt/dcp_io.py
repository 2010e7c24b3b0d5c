"""Our StorageWriter and StorageReader for torch.distributed.checkpoint.

DCP's planners (:mod:`ckpt.planners`) decide *what* each rank saves and loads; these classes
decide *where* the bytes go, and keep the manifest, commit and checksums ours. DCP's own
``.metadata`` file is a pickle; ours is the JSON manifest (:mod:`ckpt.manifest`).

Call order (DCP's contract): every rank ``set_up_storage_writer`` -> ``prepare_local_plan``;
the coordinator ``prepare_global_plan`` (here it also begins the attempt through
:mod:`ckpt.commit`: refuses a committed step, writes the attempt's marker before any data
exists); every rank ``write_data``; the coordinator ``finish`` (commits the manifest through
:mod:`ckpt.commit`, which fences off a writer that lost the lease).
"""

from __future__ import annotations

import dataclasses
import io
import threading
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ckpt._crc import crc32c_combine
from ckpt.errors import CorruptCheckpointError

from ckpt.commit import Lifecycle
from ckpt.manifest import (
    FileRecord,
    ItemLocation,
    Manifest,
    dtype_name,
)
from ckpt.storage import Storage, crc32c_of

__all__ = ["CkptWriter", "CkptReader", "VERIFY_MODES", "default_threads"]

VERIFY_MODES = ("full", "size", "none")
_S3_FILE_BYTES = 32 << 20  # one S3 part (Storage.write_buffers' default part size)
_FILE_KEY = "__file__:"


def default_threads(storage: Storage) -> int:
    """Files (and streams) per rank: object stores want many requests in flight.

    Measured on a loopback S3 endpoint: 16 concurrent uploads per rank match a raw parallel
    upload of the same bytes, 4 multipart files reach about half of it; on local disk a few
    files saturate the device (bench/, docs/performance.md).
    """
    return 16 if storage.is_s3 else 4


def _tensor_view_bytes(t: torch.Tensor) -> Any:
    """A zero-copy uint8 view of a CPU tensor's bytes (copying only if not contiguous/CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


@dataclasses.dataclass
class _RankPrefix:
    prefix: str


class CkptWriter(StorageWriter):
    """Writes one checkpoint folder. Construct one per save (it holds that save's state)."""

    def __init__(self, storage: Storage, step: int, step_dir: str, *, save_id: str | None = None,
                 num_threads: int | None = None, lifecycle: Lifecycle | None = None,
                 manifest_extra: dict[str, Any] | None = None, durable: bool = True,
                 on_file_written: Callable[[str, int], None] | None = None,
                 before_commit: Callable[[], None] | None = None):
        super().__init__()
        self.before_commit = before_commit
        self.storage = storage
        self.life = lifecycle or Lifecycle(storage)
        self.step = step
        self.step_dir = step_dir
        self.save_id = save_id or uuid.uuid4().hex[:12]
        self.num_threads = max(1, num_threads or default_threads(storage))
        self.extra = dict(manifest_extra or {})
        self.durable = durable
        self.on_file_written = on_file_written
        self.is_coordinator = True
        self.manifest: Manifest | None = None

    # -- StorageWriter interface -----------------------------------------------------------
    def reset(self, checkpoint_id=None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.storage.describe(self.step_dir), save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self.life.begin(self.step, self.save_id, durable=self.durable)
        return [dataclasses.replace(p, storage_data=_RankPrefix(f"r{i:05d}_{self.save_id}"))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix
        rank = int(prefix[1:6])
        items = list(plan.items)
        # Resolve data on this thread (planners are not thread-safe), then write in parallel.
        resolved = []
        for item in items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                buf = data.getvalue()
            else:
                buf = _tensor_view_bytes(data)
            resolved.append((item, buf))
        num_files = self.num_threads
        if self.storage.is_s3:
            # Object stores: files of about one part each, so every file is a single PUT and
            # num_threads of them are in flight (multipart completion is slow on some
            # servers, and parallel parts of one file add nothing over parallel files).
            total = sum(_nbytes(buf) for _, buf in resolved)
            num_files = max(num_files, min(1024, -(-total // _S3_FILE_BYTES)))
        buckets = _balance(resolved, num_files)
        results: list[WriteResult] = []

        def write_bucket(k: int, bucket):
            name = f"{prefix}_{k}.bin"
            bufs = [buf for _, buf in bucket]
            # Checksums run on their own thread while this one writes and fsyncs the same
            # (read-only) buffers: crc32c and file I/O both release the GIL.
            crcs: list[int] = []
            summer = threading.Thread(target=lambda: crcs.extend(crc32c_of([b]) for b in bufs),
                                      name="ckpt-crc")
            summer.start()
            try:
                self.storage.write_buffers(f"{self.step_dir}/{name}", bufs, durable=self.durable)
            finally:
                summer.join()
            offset, crc, out = 0, 0, []
            for (item, buf), item_crc in zip(bucket, crcs):
                length = len(buf) if not hasattr(buf, "nbytes") else int(buf.nbytes)
                crc = crc32c_combine(crc, item_crc, length)  # no second pass over the bytes
                out.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=ItemLocation(name, offset, length, item_crc)))
                offset += length
            if self.on_file_written is not None:
                self.on_file_written(name, offset)
            out.append(WriteResult(index=MetadataIndex(_FILE_KEY + name), size_in_bytes=offset,
                                   storage_data=FileRecord(offset, crc, rank)))
            return out

        non_empty = [(k, b) for k, b in enumerate(buckets) if b]
        if len(non_empty) <= 1:
            for k, b in non_empty:
                results.extend(write_bucket(k, b))
        else:
            with ThreadPoolExecutor(min(self.num_threads, len(non_empty)),
                                    thread_name_prefix="ckpt-write") as pool:
                for out in pool.map(lambda kb: write_bucket(*kb), non_empty):
                    results.extend(out)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        files: dict[str, FileRecord] = {}
        where: dict[MetadataIndex, ItemLocation] = {}
        for rank_results in results:
            for wr in rank_results:
                if wr.index.fqn.startswith(_FILE_KEY):
                    files[wr.index.fqn[len(_FILE_KEY):]] = wr.storage_data
                else:
                    where[wr.index] = wr.storage_data
        tensors, objects = {}, {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                chunks = []
                for chunk in md.chunks:
                    loc = where[MetadataIndex(fqn, chunk.offsets)]
                    chunks.append({"offsets": list(chunk.offsets), "sizes": list(chunk.sizes),
                                   "location": loc})
                tensors[fqn] = {"dtype": dtype_name(md.properties.dtype),
                                "shape": list(md.size), "chunks": chunks}
            else:
                objects[fqn] = where[MetadataIndex(fqn)]
        planner_data = {k: list(v) for k, v in (metadata.planner_data or {}).items()}
        manifest = Manifest(step=self.step, save_id=self.save_id, created_unix=time.time(),
                            tensors=tensors, objects=objects, files=files,
                            planner_data=planner_data, **self.extra)
        if self.before_commit is not None:
            self.before_commit()  # raises to abandon; the attempt stays uncommitted
        # Other versions in this folder (earlier failed attempts, rolled-back checkpoints)
        # are left alone: they are the life-cycle's to judge, never the writer's.
        self.life.commit(manifest)
        self.manifest = manifest


def _balance(items: list, num_buckets: int) -> list[list]:
    """Greedy largest-first split into ``num_buckets`` groups of similar byte size."""
    buckets: list[list] = [[] for _ in range(num_buckets)]
    totals = [0] * num_buckets
    order = sorted(range(len(items)), key=lambda i: -_nbytes(items[i][1]))
    for i in order:
        k = totals.index(min(totals))
        buckets[k].append(items[i])
        totals[k] += _nbytes(items[i][1])
    # Keep each file's items in state-dict order (stable, readable layout).
    index = {id(it): i for i, it in enumerate(items)}
    for b in buckets:
        b.sort(key=lambda it: index[id(it)])
    return buckets


def _nbytes(buf) -> int:
    return int(buf.nbytes) if hasattr(buf, "nbytes") else len(buf)


class CkptReader(StorageReader):
    """Reads one committed checkpoint described by an already validated ``Manifest``."""

    def __init__(self, storage: Storage, step_dir: str, manifest: Manifest, *,
                 verify: str = "full", num_threads: int | None = None,
                 on_bytes_read: Callable[[int], None] | None = None):
        super().__init__()
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify={verify!r}: expected one of {VERIFY_MODES}")
        self.storage = storage
        self.step_dir = step_dir
        self.manifest = manifest
        self.verify = verify
        self.num_threads = max(1, num_threads or default_threads(storage))
        self.on_bytes_read = on_bytes_read
        self._metadata = manifest.to_dcp_metadata()

    def reset(self, checkpoint_id=None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs):
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _direct_target(self, req: ReadItem, planner: LoadPlanner) -> torch.Tensor | None:
        """The tensor to read ``req``'s bytes straight into, if the saved chunk *is* it.

        That is the common case of resuming on the same layout (a whole saved chunk into a
        contiguous CPU tensor of the same dtype): no intermediate buffer and no copy.
        """
        if req.type == LoadItemType.BYTE_IO or not self.storage.is_local:
            return None
        md = self._metadata.state_dict_metadata[req.storage_index.fqn]
        chunk = next(c for c in md.chunks if c.offsets == req.storage_index.offset)
        if any(req.storage_offsets) or list(req.lengths) != list(chunk.sizes):
            return None
        target = planner.resolve_tensor(req).detach()
        loc = self._metadata.storage_data[req.storage_index]
        if (target.device.type != "cpu" or not target.is_contiguous()
                or target.dtype != md.properties.dtype
                or target.numel() * target.element_size() != loc.length):
            return None
        return target

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        storage_data: dict[MetadataIndex, ItemLocation] = self._metadata.storage_data
        per_file: dict[str, list[ReadItem]] = {}
        direct: dict[ReadItem, torch.Tensor] = {}
        for req in plan.items:
            per_file.setdefault(storage_data[req.storage_index].file, []).append(req)
            target = self._direct_target(req, planner)  # planner calls stay on this thread
            if target is not None:
                direct[req] = target

        def read_file(name: str) -> list[tuple[ReadItem, Any]]:
            rel = f"{self.step_dir}/{name}"
            expected_size = self.manifest.files[name].size
            if self.verify in ("full", "size"):
                try:
                    actual = self.storage.size(rel)
                except FileNotFoundError:
                    raise CorruptCheckpointError(
                        f"data file {self.storage.describe(rel)} is missing; the checkpoint is "
                        f"incomplete. Load an earlier step.", path=self.storage.describe(rel)
                    ) from None
                if actual != expected_size:
                    raise CorruptCheckpointError(
                        f"data file {self.storage.describe(rel)} is {actual} bytes, the manifest "
                        f"says {expected_size} (truncated or overwritten). Load an earlier step.",
                        path=self.storage.describe(rel), expected=expected_size, actual=actual)
            mine = [r for r in per_file[name] if r in direct]
            if mine:
                self._read_into(rel, [(storage_data[r.storage_index], direct[r]) for r in mine])
            locs = sorted({storage_data[r.storage_index] for r in per_file[name]
                           if r not in direct}, key=lambda loc: loc.offset)
            blobs: dict[ItemLocation, memoryview] = {}
            for start, end, group in _coalesce(locs):
                try:
                    data = self.storage.read_bytes(rel, start, end)
                except FileNotFoundError:
                    raise CorruptCheckpointError(
                        f"data file {self.storage.describe(rel)} is missing",
                        path=self.storage.describe(rel)) from None
                if len(data) != end - start:
                    raise CorruptCheckpointError(
                        f"data file {self.storage.describe(rel)} is truncated: bytes "
                        f"[{start}, {end}) not all present", path=self.storage.describe(rel))
                if self.on_bytes_read is not None:
                    self.on_bytes_read(len(data))
                view = memoryview(data)
                for loc in group:
                    blob = view[loc.offset - start: loc.offset - start + loc.length]
                    if self.verify == "full":
                        _check_crc(self.storage.describe(rel), loc, blob)
                    blobs[loc] = blob
            return [(r, blobs.get(storage_data[r.storage_index])) for r in per_file[name]]

        names = list(per_file)
        if len(names) > 1 and self.num_threads > 1:
            with ThreadPoolExecutor(min(self.num_threads, len(names)),
                                    thread_name_prefix="ckpt-read") as pool:
                loaded = list(pool.map(read_file, names))
        else:
            loaded = [read_file(n) for n in names]
        # Planner callbacks run on this thread: DCP planners are not thread-safe.
        for pairs in loaded:
            for req, blob in pairs:
                if req in direct:
                    planner.commit_tensor(req, direct[req])
                    continue
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(bytes(blob)))
                    continue
                md = self._metadata.state_dict_metadata[req.storage_index.fqn]
                chunk = next(c for c in md.chunks if c.offsets == req.storage_index.offset)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only copy
                    src = torch.frombuffer(blob, dtype=md.properties.dtype) if len(blob) else \
                        torch.empty(0, dtype=md.properties.dtype)
                src = src.reshape(chunk.sizes)
                for dim, (off, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                    src = src.narrow(dim, off, length)
                target = planner.resolve_tensor(req).detach()
                if target.size() != src.size():
                    raise CorruptCheckpointError(
                        f"{req.storage_index.fqn}: chunk of size {list(src.size())} does not fit "
                        f"the target slice {list(target.size())}", path=self.step_dir)
                target.copy_(src)
                planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


    def _read_into(self, rel: str, pairs: list[tuple[ItemLocation, torch.Tensor]]) -> None:
        """Local files: read each item into its target tensor's memory, then verify it there.

        On a checksum mismatch the target holds the corrupt bytes, and the error says so:
        a failed load leaves the state to be loaded again (``load_latest`` does that).
        """
        path = self.storage.path(rel)
        where = self.storage.describe(rel)
        with open(path, "rb", buffering=0) as f:
            for loc, target in sorted(pairs, key=lambda p: p[0].offset):
                view = memoryview(target.view(-1).view(torch.uint8).numpy()) if loc.length \
                    else memoryview(b"")
                f.seek(loc.offset)
                got = 0
                while got < loc.length:
                    n = f.readinto(view[got:])
                    if not n:
                        raise CorruptCheckpointError(
                            f"data file {where} is truncated: bytes [{loc.offset}, "
                            f"{loc.offset + loc.length}) not all present", path=where)
                    got += n
                if self.on_bytes_read is not None:
                    self.on_bytes_read(loc.length)
                if self.verify == "full":
                    _check_crc(where, loc, view, " (the state being loaded into is partly "
                                                 "overwritten)")


def _check_crc(where: str, loc: ItemLocation, data: Any, note: str = "") -> None:
    actual = crc32c_of([data])
    if actual != loc.crc32c:
        raise CorruptCheckpointError(
            f"checksum mismatch in {where} bytes [{loc.offset}, {loc.offset + loc.length}): "
            f"expected crc32c {loc.crc32c:08x}, got {actual:08x}. The file is corrupt; load an "
            f"earlier step{note}.", path=where, expected=f"{loc.crc32c:08x}",
            actual=f"{actual:08x}")


def _coalesce(locs: list[ItemLocation], gap: int = 1 << 20, max_bytes: int = 256 << 20):
    """Group sorted byte ranges into few reads: merge when the hole between is small."""
    group: list[ItemLocation] = []
    start = end = 0
    for loc in locs:
        if group and (loc.offset - end > gap or loc.offset + loc.length - start > max_bytes):
            yield start, end, group
            group = []
        if not group:
            start = loc.offset
            end = loc.offset + loc.length
        else:
            end = max(end, loc.offset + loc.length)
        group.append(loc)
    if group:
        yield start, end, group
