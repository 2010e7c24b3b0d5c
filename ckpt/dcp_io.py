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
import os
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

from ckpt.attachments import attachment_bytes
from ckpt.commit import Lifecycle, attachment_file
from ckpt.savecost import SaveCost
from ckpt.manifest import (
    Attachment,
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
                 before_commit: Callable[[], None] | None = None,
                 attachments: dict[str, bytes | str] | None = None, cost: Any = None):
        super().__init__()
        self.cost = cost if cost is not None else SaveCost()  # see ckpt.savecost
        self.before_commit = before_commit
        # Checked by ckpt.attachments.check_attachments; written by the coordinator only.
        self.attachments = dict(attachments or {})
        self._attached: dict[str, Attachment] = {}
        self.storage = storage
        self.life = lifecycle or Lifecycle(storage)
        self.step = step
        self.step_dir = step_dir
        self.save_id = save_id or uuid.uuid4().hex[:12]
        self.num_threads = max(1, num_threads or default_threads(storage))
        self.extra = dict(manifest_extra or {})
        self.durable = durable
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
        with self.cost.phase("commit"):
            self.life.begin(self.step, self.save_id, durable=self.durable)
            # After the marker, so a failed attempt's attachments are its leftovers like its
            # data.
            for name, value in sorted(self.attachments.items()):
                data = attachment_bytes(name, value)
                file = attachment_file(self.save_id, name)
                self.storage.write_bytes(f"{self.step_dir}/{file}", data,
                                         durable=self.durable)
                self._attached[name] = Attachment(file, len(data), crc32c_of([data]))
        return [dataclasses.replace(p, storage_data=_RankPrefix(f"r{i:05d}_{self.save_id}"))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with self.cost.span():  # its time is in the write/fsync/crc phases
            results = self._write_data(plan, planner)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_data(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        prefix = plan.storage_data.prefix
        rank = int(prefix[1:6])
        items = list(plan.items)
        # The planner already checksummed this rank's plain tensors (the replica check), over
        # the very bytes written here: those checksums are reused, not computed again.
        known: dict[str, int] = getattr(planner, "known_crcs", None) or {}
        # Resolve data on this thread (planners are not thread-safe), then write in parallel.
        resolved = []
        for item in items:
            data = planner.resolve_data(item)
            crc = None
            if item.type == WriteItemType.BYTE_IO:
                buf = data.getvalue()
                crc = known.get(item.index.fqn)  # the planner's, of these very bytes
            else:
                buf = _tensor_view_bytes(data)
                whole = planner.state_dict.get(item.index.fqn) if hasattr(
                    planner, "state_dict") else None
                if item.index.fqn in known and isinstance(whole, torch.Tensor) and \
                        whole.numel() * whole.element_size() == _nbytes(buf):
                    crc = known[item.index.fqn]
            resolved.append((item, buf, crc))
        num_files = self.num_threads
        if self.storage.is_s3:
            # Object stores: files of about one part each, so every file is a single PUT and
            # num_threads of them are in flight (multipart completion is slow on some
            # servers, and parallel parts of one file add nothing over parallel files).
            total = sum(_nbytes(r[1]) for r in resolved)
            num_files = max(num_files, min(1024, -(-total // _S3_FILE_BYTES)))
        buckets = _balance(resolved, num_files)
        # Local files: each file's bytes are synced by itself, and the folder (the files'
        # names) once for all of them, before this rank reports its files written; the
        # manifest, the commit, comes only after every rank did (DCP's contract).
        sync_here = self.durable and self.storage.is_local
        cost = self.cost
        results: list[WriteResult] = []

        def checksum(bufs: list) -> list[int]:
            with cost.phase("crc"):
                return [crc32c_of([b]) for b in bufs]

        def write_bucket(k: int, bucket):
            name = f"{prefix}_{k}.bin"
            rel = f"{self.step_dir}/{name}"
            bufs = [buf for _, buf, _ in bucket]
            todo = [i for i, (_, _, crc) in enumerate(bucket) if crc is None]
            # Checksums run on their own thread while this one writes and fsyncs the same
            # (read-only) buffers: crc32c and file I/O both release the GIL.
            computed: list[int] = []
            summer = None
            if todo:
                summer = threading.Thread(
                    target=lambda: computed.extend(checksum([bufs[i] for i in todo])),
                    name="ckpt-crc")
                summer.start()
            try:
                with cost.phase("write"):
                    self.storage.write_buffers(rel, bufs, durable=self.durable and not sync_here)
                if sync_here:
                    with cost.phase("fsync"):
                        _fsync_path(self.storage.path(rel))
            finally:
                if summer is not None:
                    summer.join()
            crcs = [crc for _, _, crc in bucket]
            for i, value in zip(todo, computed):
                crcs[i] = value
            offset, crc, out = 0, 0, []
            for (item, buf, _), item_crc in zip(bucket, crcs):
                length = _nbytes(buf)
                crc = crc32c_combine(crc, item_crc, length)  # no second pass over the bytes
                out.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=ItemLocation(name, offset, length, item_crc)))
                offset += length
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
        if sync_here and non_empty:
            with cost.phase("fsync"):
                _fsync_path(self.storage.path(self.step_dir))
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        with self.cost.phase("commit"):
            self._finish(metadata, results)

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
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
        for a in self._attached.values():  # listed in files too: verified and kept with them
            files[a.file] = FileRecord(a.size, a.crc32c, 0)
        manifest = Manifest(step=self.step, save_id=self.save_id, created_unix=time.time(),
                            tensors=tensors, objects=objects, files=files,
                            planner_data=planner_data, attachments=dict(self._attached),
                            **self.extra)
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


def _fsync_path(path: str) -> None:
    """Make a file's bytes, or a folder's entries, durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CkptReader(StorageReader):
    """Reads one committed checkpoint described by an already validated ``Manifest``.

    Reads are transactional. ``read_data`` (every rank, inside DCP's collective read) only
    *stages*: it reads this rank's byte ranges into scratch buffers, checks sizes and
    checksums, decodes non-tensor values and matches every chunk to its target slice, but
    writes nothing into the state. ``apply`` then copies the staged values into the state;
    the caller runs it only once every rank's ``read_data`` succeeded (``ckpt.api.load``
    agrees first), so a failed load on any rank leaves every rank's state as it was.
    ``discard`` drops the staged bytes instead.

    Memory: while a load is in flight this rank holds one copy of the bytes it reads (the
    scratch), freed by ``apply``/``discard``; nothing stays allocated between loads. With
    ``scratch`` (a :class:`ckpt.staging.StagingBuffers` not in use by a save), local reads
    go into its buffers instead, which a job keeps for its saves anyway: no extra memory,
    and none to touch for the first time.
    Scratch tensors are aligned for their dtype: items are packed without padding, so a view
    of the file's bytes can start at any address, and some copy kernels (complex128)
    crash on a misaligned source.
    """

    def __init__(self, storage: Storage, step_dir: str, manifest: Manifest, *,
                 verify: str = "full", num_threads: int | None = None,
                 on_bytes_read: Callable[[int], None] | None = None,
                 scratch: Any = None):
        super().__init__()
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify={verify!r}: expected one of {VERIFY_MODES}")
        self.storage = storage
        self.step_dir = step_dir
        self.manifest = manifest
        self.verify = verify
        self.scratch = scratch  # a StagingBuffers to borrow read buffers from, or None
        self.num_threads = max(1, num_threads or default_threads(storage))
        self.on_bytes_read = on_bytes_read
        self._metadata = manifest.to_dcp_metadata()
        # (planner, [(request, target slice or None, staged tensor or object bytes)])
        self._staged: tuple[LoadPlanner, list[tuple[ReadItem, Any, Any]]] | None = None

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

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Stage this rank's reads (see the class docstring); the state is not touched."""
        storage_data: dict[MetadataIndex, ItemLocation] = self._metadata.storage_data
        md = self._metadata.state_dict_metadata
        per_file: dict[str, dict[ItemLocation, torch.dtype | None]] = {}
        for req in plan.items:
            loc = storage_data[req.storage_index]
            dtype = None if req.type == LoadItemType.BYTE_IO else \
                md[req.storage_index.fqn].properties.dtype
            per_file.setdefault(loc.file, {})[loc] = dtype
        lent: dict[ItemLocation, torch.Tensor] = {}
        if self.scratch is not None and self.storage.is_local:
            items = [loc for wanted in per_file.values() for loc, dtype in wanted.items()
                     if dtype is not None]
            for loc, buf in zip(items, self.scratch.borrow([loc.length for loc in items])):
                if buf is not None:
                    lent[loc] = buf
        names = list(per_file)
        if len(names) > 1 and self.num_threads > 1:
            with ThreadPoolExecutor(min(self.num_threads, len(names)),
                                    thread_name_prefix="ckpt-read") as pool:
                parts = list(pool.map(lambda n: self._read_file(n, per_file[n], lent), names))
        else:
            parts = [self._read_file(n, per_file[n], lent) for n in names]
        blobs: dict[ItemLocation, Any] = {}
        for part in parts:
            blobs.update(part)
        # Planner callbacks run on this thread: DCP planners are not thread-safe.
        staged: list[tuple[ReadItem, Any, Any]] = []
        for req in plan.items:
            blob = blobs[storage_data[req.storage_index]]
            fqn = req.storage_index.fqn
            if req.type == LoadItemType.BYTE_IO:
                _check_object(self.storage.describe(self.step_dir), fqn, blob)
                staged.append((req, None, blob))
                continue
            chunk = next(c for c in md[fqn].chunks if c.offsets == req.storage_index.offset)
            src = blob.reshape(chunk.sizes)
            for dim, (off, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                src = src.narrow(dim, off, length)
            target = planner.resolve_tensor(req).detach()
            if target.size() != src.size():
                raise CorruptCheckpointError(
                    f"{fqn}: chunk of size {list(src.size())} does not fit the target slice "
                    f"{list(target.size())}", path=self.step_dir)
            staged.append((req, target, src))
        self._staged = (planner, staged)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def apply(self) -> None:
        """Copy the staged, verified values into the state; then free the scratch.

        Call on every rank only after every rank's ``read_data`` succeeded.
        """
        assert self._staged is not None, "apply() without a successful read_data()"
        planner, staged = self._staged
        self._staged = None
        copies = [(target, src) for _, target, src in staged if target is not None]
        total = sum(src.numel() * src.element_size() for _, src in copies)
        if total >= _PARALLEL_COPY_BYTES and len(copies) > 1 and self.num_threads > 1:
            # copy_ releases the GIL: large loads copy on several threads.
            with ThreadPoolExecutor(min(self.num_threads, len(copies)),
                                    thread_name_prefix="ckpt-apply") as pool:
                list(pool.map(lambda ts: ts[0].copy_(ts[1]), copies))
        else:
            for target, src in copies:
                target.copy_(src)
        for req, target, src in staged:
            if target is None:
                planner.load_bytes(req, io.BytesIO(src))
            else:
                planner.commit_tensor(req, target)

    def discard(self) -> None:
        """Drop the staged values (a failed load): the state is left as it was."""
        self._staged = None

    def _read_file(self, name: str, wanted: dict[ItemLocation, torch.dtype | None],
                   lent: dict[ItemLocation, torch.Tensor]) -> dict[ItemLocation, Any]:
        """Read, check and type one file's wanted items (on a worker thread; no planner)."""
        rel = f"{self.step_dir}/{name}"
        where = self.storage.describe(rel)
        if self.verify in ("full", "size"):
            expected_size = self.manifest.files[name].size
            try:
                actual = self.storage.size(rel)
            except FileNotFoundError:
                raise _missing(where) from None
            if actual != expected_size:
                raise CorruptCheckpointError(
                    f"data file {where} is {actual} bytes, the manifest says {expected_size} "
                    f"(truncated or overwritten). Load an earlier step.",
                    path=where, expected=expected_size, actual=actual)
        out: dict[ItemLocation, Any] = {}

        def take(loc: ItemLocation, piece: memoryview) -> None:
            if self.verify == "full":
                _check_crc(where, loc, piece)
            dtype = wanted[loc]
            out[loc] = bytes(piece) if dtype is None else _typed(piece, dtype, where, loc)

        locs = sorted(wanted, key=lambda loc: loc.offset)
        if not self.storage.is_local:
            for start, end, group in _coalesce(locs):
                try:
                    data = memoryview(self.storage.read_bytes(rel, start, end))
                except FileNotFoundError:
                    raise _missing(where) from None
                if len(data) != end - start:
                    raise _truncated(where, start, end)
                if self.on_bytes_read is not None:
                    self.on_bytes_read(end - start)
                for loc in group:
                    take(loc, data[loc.offset - start: loc.offset - start + loc.length])
            return out
        # Local files: read straight into borrowed buffers (an item each) or fresh scratch.
        try:
            f = open(self.storage.path(rel), "rb", buffering=0)
        except FileNotFoundError:
            raise _missing(where) from None
        with f:
            for loc in locs:
                if loc in lent:
                    view = memoryview(lent[loc].numpy())
                    _read_into(f, loc.offset, view, where)
                    if self.on_bytes_read is not None:
                        self.on_bytes_read(loc.length)
                    take(loc, view)
            for start, end, group in _coalesce([loc for loc in locs if loc not in lent]):
                data = _scratch(end - start)
                _read_into(f, start, data, where)
                if self.on_bytes_read is not None:
                    self.on_bytes_read(end - start)
                for loc in group:
                    take(loc, data[loc.offset - start: loc.offset - start + loc.length])
        return out


def _missing(where: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"data file {where} is missing; the checkpoint is incomplete. Load an earlier step.",
        path=where)


def _truncated(where: str, start: int, end: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"data file {where} is truncated: bytes [{start}, {end}) not all present. Load an "
        f"earlier step.", path=where)


_HUGE_PAGE_BYTES = 2 << 20
_PARALLEL_COPY_BYTES = 64 << 20


def _scratch(nbytes: int) -> memoryview:
    """``nbytes`` of fresh, page-aligned memory for one read, freed with its last view.

    Large ones are anonymous mappings advised to use transparent huge pages: touching fresh
    memory page by page costs about as much as reading it from the page cache (measured:
    0.14-0.2 s per 256 MiB in 4 KiB pages, 0.04 s in 2 MiB pages; docs/performance.md).
    """
    if nbytes >= _HUGE_PAGE_BYTES:
        import mmap

        try:
            m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (OSError, AttributeError, ValueError):
            pass
        else:
            try:
                m.madvise(mmap.MADV_HUGEPAGE)
            except (OSError, AttributeError, ValueError):
                pass  # no THP here: plain pages
            return memoryview(m)
    return memoryview(bytearray(nbytes))


def _read_into(f, start: int, view: memoryview, where: str) -> None:
    """Fill ``view`` with the bytes of open file ``f`` from ``start`` on."""
    f.seek(start)
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise _truncated(where, start, start + len(view))
        got += n


def _typed(piece: memoryview, dtype: torch.dtype, where: str, loc: ItemLocation
           ) -> torch.Tensor:
    """A flat ``dtype`` tensor of ``piece``'s bytes: a view when its address suits the
    dtype's alignment, else an aligned copy (never a misaligned tensor)."""
    import numpy as np

    size = torch.empty(0, dtype=dtype).element_size()
    if len(piece) % size:
        raise CorruptCheckpointError(
            f"{where} bytes [{loc.offset}, {loc.offset + loc.length}): {len(piece)} bytes is "
            f"not a whole number of {dtype} elements; the manifest is corrupt. Load an "
            f"earlier step.", path=where)
    if not len(piece):
        return torch.empty(0, dtype=dtype)
    array = np.frombuffer(piece, dtype=np.uint8)
    if array.ctypes.data % size:
        aligned = torch.empty(len(piece), dtype=torch.uint8)
        aligned.numpy()[:] = array
        return aligned.view(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only bytes: only ever copied from
        return torch.frombuffer(piece, dtype=dtype)


def _check_object(where: str, fqn: str, data: bytes) -> None:
    """Refuse a non-tensor value that does not decode, before anything is applied."""
    from ckpt.codec import decode_object

    try:
        decode_object(data)
    except (ValueError, TypeError, RuntimeError) as exc:  # bad JSON, UTF-8 or tag payload
        raise CorruptCheckpointError(
            f"{where}: object {fqn!r} is not a ckpt JSON value ({exc}); the checkpoint is "
            f"corrupt or was not written by ckpt (its bytes are never unpickled). Load an "
            f"earlier step.", path=where) from None


def _check_crc(where: str, loc: ItemLocation, data: Any) -> None:
    actual = crc32c_of([data])
    if actual != loc.crc32c:
        raise CorruptCheckpointError(
            f"checksum mismatch in {where} bytes [{loc.offset}, {loc.offset + loc.length}): "
            f"expected crc32c {loc.crc32c:08x}, got {actual:08x}. The file is corrupt; load an "
            f"earlier step.", path=where, expected=f"{loc.crc32c:08x}",
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
