"""Our StorageReader for torch.distributed.checkpoint: transactional, verified reads.

DCP's planners (:mod:`ckpt.dcp.planners`) decide *what* each rank loads; this reader finds the
bytes through our JSON manifest (:mod:`ckpt.format.manifest`), never DCP's pickled ``.metadata``,
checks them, and turns them back into tensors as :mod:`ckpt.dcp.layout` says.

Which parts a rank reads (format version 2, :mod:`ckpt.format.part`): given the state it
loads into, a rank first reads only its own part and the parts its refs name; when the
chunks found there cover every local shard of its state (an unchanged layout), that is
all. Otherwise (another layout or world size: resharding; export) it reads every part.

A version that holds one node's share (its manifest's ``span``) may lack chunks of its
sharded tensors. DCP's planner plans reads only from the chunks the metadata lists that
overlap a rank's shard: chunks a rank does not need may be absent at no cost, but a shard
whose chunks are absent would be left as it was, silently. So for such a version the chunks
found MUST cover every local shard of the state, checked here before anything is planned
(``PartialCheckpointError`` naming the key otherwise, on every rank through DCP's plan).

Call order (DCP's contract, then ours): every rank ``set_up_storage_reader`` ->
``prepare_local_plan``; the coordinator ``prepare_global_plan``; every rank ``read_data``
(stages and verifies only); then, once every rank's ``read_data`` succeeded, every rank
``apply`` (or ``discard`` after a failure anywhere).
"""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckpt.dcp._shards import first_uncovered
from ckpt.dcp.layout import tensor_from_bytes
from ckpt.errors import (
    CorruptCheckpointError,
    PartialCheckpointError,
    crc_mismatch_error,
    missing_file_error,
    size_mismatch_error,
)
from ckpt.format import (
    ItemLocation,
    Manifest,
    crc32c_of,
    decode_object,
    merge_chunks,
)
from ckpt.root import complete_parts, parts_for_rank
from ckpt.storage import Storage

__all__ = ["CkptReader", "VERIFY_MODES"]

VERIFY_MODES = ("full", "size", "none")
_HUGE_PAGE_BYTES = 2 << 20
_PARALLEL_COPY_BYTES = 64 << 20



class CkptReader(StorageReader):
    """Reads one committed checkpoint described by an already validated ``Manifest``.

    Reads are transactional. ``read_data`` (every rank, inside DCP's collective read) only
    *stages*: it reads this rank's byte ranges into scratch buffers, checks sizes and
    checksums, decodes non-tensor values and matches every chunk to its target slice, but
    writes nothing into the state. ``apply`` then copies the staged values into the state;
    the caller runs it only once every rank's ``read_data`` succeeded (``ckpt.dcp.api.load``
    agrees first), so a failed load on any rank leaves every rank's state as it was.
    ``discard`` drops the staged bytes instead.

    Memory: while a load is in flight this rank holds one copy of the bytes it reads (the
    scratch), freed by ``apply``/``discard``; nothing stays allocated between loads. With
    ``scratch`` (a :class:`ckpt.dcp.staging.StagingBuffers` not in use by a save), local reads
    go into its buffers instead, which a job keeps for its saves anyway: no extra memory,
    and none to touch for the first time.
    Scratch tensors are aligned for their dtype: items are packed without padding, so a view
    of the file's bytes can start at any address, and some copy kernels (complex128)
    crash on a misaligned source.

    Parts: ``state`` is the state this rank loads into (as given to ``dcp.load``), ``rank``
    and ``world_size`` its place in the load's group. With them, a root manifest of format
    version 2 costs this rank its own part and those its refs name when they cover every
    local shard of ``state``; without them, or when they do not, every part is read.
    ``parts_read`` lists the parts read.
    """

    def __init__(self, storage: Storage, step_dir: str, manifest: Manifest, *,
                 verify: str = "full", num_threads: int | None = None,
                 on_bytes_read: Callable[[int], None] | None = None,
                 scratch: Any = None, state: dict[str, Any] | None = None, rank: int = 0,
                 world_size: int = 1):
        super().__init__()
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify={verify!r}: expected one of {VERIFY_MODES}")
        self.storage = storage
        self.step_dir = step_dir
        self.manifest = manifest
        self.verify = verify
        self.scratch = scratch  # a StagingBuffers to borrow read buffers from, or None
        self.num_threads = max(1, num_threads or storage.default_threads)
        self.on_bytes_read = on_bytes_read
        self.state, self.rank, self.world_size = state, rank, world_size
        self.parts_read: list[str] = []
        self._metadata: Metadata | None = None
        self._error: BaseException | None = None
        # (planner, [(request, target slice or None, staged tensor or object bytes)])
        self._staged: tuple[LoadPlanner, list[tuple[ReadItem, Any, Any]]] | None = None

    def reset(self, checkpoint_id=None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The chunks this rank may read (see the class docstring). Never raises: DCP
        would take an error here for a missing file and retry per rank, outside its
        collectives. A problem (a damaged part) is raised by ``prepare_local_plan``
        instead, which every rank reaches, so the load fails everywhere."""
        if self._metadata is None:
            try:
                self._metadata = self._read_metadata()
            except Exception as exc:  # noqa: BLE001 - raised again in prepare_local_plan
                self._error = exc
                self._metadata = self.manifest.to_dcp_metadata()  # the root's chunks only
        return self._metadata

    def _read_metadata(self) -> Metadata:
        m = self.manifest
        if m.complete:
            return m.to_dcp_metadata()
        where = self.storage.describe(self.step_dir)
        parts = {}
        if self.state is not None and m.world_size == self.world_size:
            parts = parts_for_rank(self.storage, m, self.rank, num_threads=self.num_threads)
            chunks = merge_chunks(m, parts.items(), where)
            if first_uncovered(self.state, m, chunks) is None:
                self.parts_read = sorted(parts)
                return m.to_dcp_metadata(chunks)
        self.parts_read = sorted(m.parts)
        whole = complete_parts(self.storage, m, num_threads=self.num_threads, known=parts)
        if m.span is not None:  # one node's share: it must hold what this rank loads
            key = None if self.state is None else first_uncovered(
                self.state, m, {fqn: t["chunks"] for fqn, t in whole.tensors.items()})
            if self.state is None or key is not None:
                missing = "the state's keys" if key is None else f"key {key!r}"
                raise PartialCheckpointError(
                    f"{where} holds {m.span.describe()} and lacks chunks of {missing} that "
                    f"rank {self.rank} loads (other nodes hold them); load it on the layout "
                    f"that wrote it, or resume from the durable root")
        return whole.to_dcp_metadata()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs):
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        if self._error is not None:
            raise self._error
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
        if self.scratch is not None and self.storage.local_path() is not None:
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
        sizes: dict[str, dict[torch.Size, torch.Size]] = {}  # key -> chunk offsets -> sizes
        for req in plan.items:
            blob = blobs[storage_data[req.storage_index]]
            fqn = req.storage_index.fqn
            if req.type == LoadItemType.BYTE_IO:
                _check_object(self.storage.describe(self.step_dir), fqn, blob)
                staged.append((req, None, blob))
                continue
            by_offsets = sizes.get(fqn)
            if by_offsets is None:  # one pass over a tensor's chunks, at its first request
                by_offsets = sizes[fqn] = {c.offsets: c.sizes for c in md[fqn].chunks}
            chunk_sizes = by_offsets[req.storage_index.offset]
            src = blob.reshape(chunk_sizes)
            for dim, (off, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                if off or length != chunk_sizes[dim]:  # the whole chunk needs no view
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
                raise missing_file_error(where) from None
            if actual != expected_size:
                raise size_mismatch_error(where, expected_size, actual)
        out: dict[ItemLocation, Any] = {}

        def take(loc: ItemLocation, piece: memoryview) -> None:
            if self.verify == "full":
                _check_crc(where, loc, piece)
            dtype = wanted[loc]
            out[loc] = (bytes(piece) if dtype is None
                        else tensor_from_bytes(piece, dtype, where, loc))

        locs = sorted(wanted, key=lambda loc: loc.offset)
        if self.storage.local_path() is None:
            for start, end, group in _coalesce(locs):
                try:
                    data = memoryview(self.storage.read_bytes(rel, start, end))
                except FileNotFoundError:
                    raise missing_file_error(where) from None
                if len(data) != end - start:
                    raise _truncated(where, start, end)
                if self.on_bytes_read is not None:
                    self.on_bytes_read(end - start)
                for loc in group:
                    take(loc, data[loc.offset - start: loc.offset - start + loc.length])
            return out
        # Local files: read straight into borrowed buffers (an item each) or fresh scratch.
        try:
            f = self.storage.open_local(rel)
        except FileNotFoundError:
            raise missing_file_error(where) from None
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


def _truncated(where: str, start: int, end: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"data file {where} is truncated: bytes [{start}, {end}) not all present. Load an "
        f"earlier step.", path=where)


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


def _check_object(where: str, fqn: str, data: bytes) -> None:
    """Refuse a non-tensor value that does not decode, before anything is applied."""

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
        raise crc_mismatch_error(where, loc.crc32c, actual,
                                 span=(loc.offset, loc.offset + loc.length))


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
