"""Our StorageReader for torch.distributed.checkpoint: transactional, verified reads.

DCP's planners (:mod:`ckpt.dcp.planners`) decide *what* each rank loads; this reader finds the
bytes through our JSON manifest (:mod:`ckpt.format.manifest`), never DCP's pickled ``.metadata``,
checks them, and turns them back into tensors as :mod:`ckpt.dcp.layout` says.

Which parts a rank reads (format version 2, :mod:`ckpt.format.part`): given the state it
loads into, a rank first reads only its own part and the parts its refs name; when the
chunks found there cover every local shard of its state (an unchanged layout), that is
all. Otherwise (another layout or world size: resharding; export) it reads every part.

Cooperative reads (:mod:`ckpt.dcp._coop`): with ``group``, a location that several ranks of
the load need (replicated values, HSDP replicas, a chunk two ranks' shards straddle after a
reshard) is read from storage by one of them, balanced, and received by the others over the
group, each receiver checking the item's CRC32C on what it received. A load where no
location is needed twice reads as before, with no collective of its own.

A version that holds one node's share (its manifest's ``span``) may lack chunks of its
sharded tensors. DCP's planner plans reads only from the chunks the metadata lists that
overlap a rank's shard: chunks a rank does not need may be absent at no cost, but a shard
whose chunks are absent would be left as it was, silently. So for such a version the chunks
found MUST cover every local shard of the state, checked here before anything is planned
(``PartialCheckpointError`` naming the key otherwise, on every rank through DCP's plan).

Call order (DCP's contract, then ours): every rank ``set_up_storage_reader`` ->
``prepare_local_plan`` (with a group: the locations it needs); the coordinator
``prepare_global_plan`` (who reads what); every rank ``read_data`` (reads, and in a
cooperative load sends and receives, with two all-reduces of its own on the group;
stages and verifies only); then, once every rank's ``read_data`` succeeded, every rank
``apply`` (or ``discard`` after a failure anywhere).

Size: one StorageReader contract (find, read, verify, and apply only when every rank
succeeded); its cooperative side (who reads a shared range) is in ``_coop``, its layouts in
``layout``.
"""

from __future__ import annotations

import dataclasses
import io
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckpt.dcp._coop import (
    Exchange,
    Wanted,
    assign,
    pieces,
    post_receives,
    post_send,
    receive_layout,
    send_layout,
)
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
from ckpt.ranks import Agreement
from ckpt.root import complete_parts, parts_for_rank
from ckpt.storage import Storage

__all__ = ["CkptReader", "VERIFY_MODES"]

VERIFY_MODES = ("full", "size", "none")
_HUGE_PAGE_BYTES = 2 << 20
_PARALLEL_COPY_BYTES = 64 << 20
_PAGE_BYTES = 4096



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

    ``group``: the load's process group (a gloo group, as ``ckpt.dcp.api.load`` passes it);
    with it, and more than one rank, a location several ranks need is read by one of them
    and sent to the others (the module docstring). ``on_bytes_read`` counts what this rank
    reads from storage, not what it receives.
    """

    def __init__(self, storage: Storage, step_dir: str, manifest: Manifest, *,
                 verify: str = "full", num_threads: int | None = None,
                 on_bytes_read: Callable[[int], None] | None = None,
                 scratch: Any = None, state: dict[str, Any] | None = None, rank: int = 0,
                 world_size: int = 1, group: Any = None):
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
        self.group = group if world_size > 1 else None
        self.parts_read: list[str] = []
        # This rank's distinct locations, in the order its ``Wanted`` names them.
        self._wanted: list[ItemLocation] = []
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
        """Raise the problem ``read_metadata`` found; in a cooperative load, send this
        rank's locations along (:class:`ckpt.dcp._coop.Wanted`)."""
        if self._error is not None:
            raise self._error
        if self.group is None:
            return plan
        storage_data = self._metadata.storage_data
        wanted = dict.fromkeys(storage_data[req.storage_index] for req in plan.items)
        self._wanted = list(wanted)
        files = list(dict.fromkeys(loc.file for loc in self._wanted))
        index = {name: i for i, name in enumerate(files)}
        table = np.array([(index[loc.file], loc.offset, loc.length) for loc in self._wanted],
                         dtype=np.int64).reshape(-1, 3)
        return dataclasses.replace(plan, storage_data=Wanted(files, table))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """On the coordinator: who reads each location several ranks need
        (:func:`ckpt.dcp._coop.assign`); each rank's share goes back in its plan."""
        if self.group is None:
            return plans
        shares = assign([p.storage_data if isinstance(p.storage_data, Wanted) else None
                         for p in plans])
        if shares is None:
            return [dataclasses.replace(p, storage_data=None) for p in plans]
        return [dataclasses.replace(p, storage_data=share) for p, share in zip(plans, shares)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Stage this rank's reads (see the class docstring); the state is not touched."""
        storage_data: dict[MetadataIndex, ItemLocation] = self._metadata.storage_data
        md = self._metadata.state_dict_metadata
        dtypes: dict[ItemLocation, torch.dtype | None] = {}
        for req in plan.items:
            dtypes[storage_data[req.storage_index]] = (
                None if req.type == LoadItemType.BYTE_IO
                else md[req.storage_index.fqn].properties.dtype)
        fut: Future[None] = Future()
        fut.set_result(None)
        if isinstance(plan.storage_data, Exchange):
            blobs = self._read_cooperatively(plan.storage_data, dtypes)
            if blobs is None:  # another rank's read failed: DCP fails the load everywhere
                return fut
        else:
            blobs = self._read_files(dtypes, self._borrow_own(dtypes)[0], {})
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
        return fut

    def _borrow_own(self, dtypes: dict[ItemLocation, torch.dtype | None],
                    extra: list[int] = ()) -> tuple[dict[ItemLocation, torch.Tensor], list]:
        """Scratch buffers lent by ``scratch`` for the tensor items of ``dtypes`` (local
        files only: they are read straight into them), and for ``extra`` byte sizes
        (None where nothing is left)."""
        if self.scratch is None:
            return {}, [None] * len(extra)
        items = ([loc for loc, dtype in dtypes.items() if dtype is not None]
                 if self.storage.local_path() is not None else [])
        lent = self.scratch.borrow([loc.length for loc in items] + list(extra))
        own = {loc: buf for loc, buf in zip(items, lent) if buf is not None}
        return own, lent[len(items):]

    def _read_files(self, dtypes: dict[ItemLocation, torch.dtype | None],
                    lent: dict[ItemLocation, torch.Tensor],
                    into: dict[ItemLocation, torch.Tensor]) -> dict[ItemLocation, Any]:
        """Read, check and type the items of ``dtypes`` (several files at once). ``lent``:
        buffers to read tensor items of local files into; ``into``: buffers every item
        (any storage) is read into, and viewed there."""
        per_file: dict[str, dict[ItemLocation, torch.dtype | None]] = {}
        for loc, dtype in dtypes.items():
            per_file.setdefault(loc.file, {})[loc] = dtype
        targets = {**lent, **into}
        names = list(per_file)
        if len(names) > 1 and self.num_threads > 1:
            with ThreadPoolExecutor(min(self.num_threads, len(names)),
                                    thread_name_prefix="ckpt-read") as pool:
                parts = list(pool.map(
                    lambda n: self._read_file(n, per_file[n], targets, into), names))
        else:
            parts = [self._read_file(n, per_file[n], targets, into) for n in names]
        blobs: dict[ItemLocation, Any] = {}
        for part in parts:
            blobs.update(part)
        return blobs

    def _read_cooperatively(self, share: Exchange,
                            dtypes: dict[ItemLocation, torch.dtype | None]
                            ) -> dict[ItemLocation, Any] | None:
        """This rank's part of a cooperative read (:mod:`ckpt.dcp._coop`). None when
        another rank's read failed (this one raises its own failure).

        Every rank allocates its buffers and agrees that all could; posts its receives;
        reads and verifies the shared items it reads, batch by batch, sending each batch
        once read (so sending overlaps reading); reads its own items; meanwhile a thread
        checks each received item's CRC32C as its bytes arrive. Then every rank agrees that
        every read and every check succeeded. A rank whose read fails reads no further but
        still sends every message (the receivers expect them), and the agreement fails the
        load before anyone uses a byte of it."""
        locs = self._wanted
        lengths = np.array([loc.length for loc in locs], dtype=np.int64).reshape(-1)
        read_offsets, arena_bytes, sends = send_layout(share, lengths)
        layouts = {src: receive_layout(lengths[idx], slots, batches)
                   for src, (idx, slots, batches) in share.recv.items()}
        shared = set(share.read.tolist())
        for idx, _, _ in share.recv.values():
            shared.update(idx.tolist())
        own = {loc: dtypes[loc] for i, loc in enumerate(locs) if i not in shared}
        error: BaseException | None = None
        inbound: dict[int, torch.Tensor] = {}
        lent: dict[ItemLocation, torch.Tensor] = {}
        try:
            lent, extra = self._borrow_own(
                own, [arena_bytes] + [layouts[src][2] for src in sorted(layouts)])
            arena = _buffer(arena_bytes, extra[0])
            for src, buf in zip(sorted(layouts), extra[1:]):
                inbound[src] = _buffer(layouts[src][2], buf)
        except Exception as exc:  # noqa: BLE001 - raised below, after every rank agreed
            error = exc
        agreement = Agreement(self.group)
        if not agreement.all(error is None):  # nothing is sent unless every rank can take it
            if error is not None:
                raise error
            return None
        received = _ReceivedCheck(self, share, layouts, inbound, dtypes)
        received.start()
        sent = []
        blobs: dict[ItemLocation, Any] = {}
        slots = np.arange(len(share.read))
        try:
            for batch in np.unique(share.batches).tolist():
                if error is None:
                    mine = share.batches == batch
                    into = {locs[i]: arena[o:o + locs[i].length] for i, o in zip(
                        share.read[mine].tolist(), read_offsets[slots[mine]].tolist())}
                    try:
                        blobs.update(self._read_files({loc: dtypes[loc] for loc in into},
                                                      {}, into))
                    except Exception as exc:  # noqa: BLE001 - agreed below
                        error = exc
                for dst, start, nbytes in sends.get(batch, ()):
                    sent.extend(post_send(self.group, dst, pieces(arena, start, nbytes)))
            if error is None and own:
                try:
                    blobs.update(self._read_files(own, lent, {}))
                except Exception as exc:  # noqa: BLE001 - agreed below
                    error = exc
        finally:
            for work in sent:
                work.wait()
            received.join()
        error = error or received.error
        if not agreement.all(error is None):
            if error is not None:
                raise error
            return None
        blobs.update(received.blobs)
        return blobs

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

    def staged_objects(self) -> list[tuple[ReadItem, bytes]]:
        """The objects read and verified (each read item with its bytes), not applied yet:
        what :meth:`ckpt.dcp.planners.SafeLoadPlanner.check_loaded` checks first."""
        assert self._staged is not None, "staged_objects() without a successful read_data()"
        return [(req, src) for req, target, src in self._staged[1] if target is None]

    def discard(self) -> None:
        """Drop the staged values (a failed load): the state is left as it was."""
        self._staged = None

    def _read_file(self, name: str, wanted: dict[ItemLocation, torch.dtype | None],
                   lent: dict[ItemLocation, torch.Tensor],
                   into: dict[ItemLocation, torch.Tensor]) -> dict[ItemLocation, Any]:
        """Read, check and type one file's wanted items (on a worker thread; no planner).
        ``lent``: buffers items of a local file are read straight into; ``into``: buffers
        items are copied into from a remote file's read too (and viewed there)."""
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
                    piece = data[loc.offset - start: loc.offset - start + loc.length]
                    if loc in into:
                        view = memoryview(into[loc].numpy())
                        view[:] = piece
                        piece = view
                    take(loc, piece)
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


class _ReceivedCheck(threading.Thread):
    """Receives what other ranks send this one in a cooperative read and checks it as it
    arrives (one thread; CRC32C releases the GIL): each item's CRC32C from this rank's own
    manifest or part, on the bytes received, when ``verify='full'``. ``blobs``: the typed
    items; ``error``: the first failure (it then only waits for the rest to arrive)."""

    def __init__(self, reader: CkptReader, share: Exchange, layouts: dict, inbound: dict,
                 dtypes: dict[ItemLocation, torch.dtype | None]):
        super().__init__(name="ckpt-coop-recv", daemon=True)
        self.blobs: dict[ItemLocation, Any] = {}
        self.error: BaseException | None = None
        self._where = reader.storage.describe(reader.step_dir)
        self._verify, self._dtypes, self._locs = reader.verify, dtypes, reader._wanted
        self._todo = []  # (source rank, receive works of a run, [(own index, offset)])
        for src in sorted(layouts):
            runs_of, offsets, _ = layouts[src]
            idx, offsets = share.recv[src][0].tolist(), offsets.tolist()
            for start, nbytes, a, b in runs_of:
                works = post_receives(reader.group,
                                      {src: pieces(inbound[src], start, nbytes)})
                self._todo.append((src, works, inbound[src],
                                   list(zip(idx[a:b], offsets[a:b]))))

    def run(self) -> None:
        for src, works, buf, items in self._todo:
            try:
                for work in works:
                    work.wait()
            except Exception as exc:  # noqa: BLE001 - a peer gone: the load fails
                self.error = self.error or exc
                continue
            if self.error is not None:
                continue
            try:
                for i, off in items:
                    self._take(src, self._locs[i], buf, off)
            except Exception as exc:  # noqa: BLE001 - reported by the reader
                self.error = exc

    def _take(self, src: int, loc: ItemLocation, buf: torch.Tensor, off: int) -> None:
        piece = memoryview(buf[off:off + loc.length].numpy())
        where = f"{self._where}/{loc.file}"
        if self._verify == "full":
            actual = crc32c_of([piece])
            if actual != loc.crc32c:
                raise CorruptCheckpointError(
                    f"{where} bytes [{loc.offset}, {loc.offset + loc.length}) as received "
                    f"from rank {src} fail their checksum: expected crc32c "
                    f"{loc.crc32c:08x}, got {actual:08x}. Damaged in transit (rank {src} "
                    f"verified them as it read them); the load falls back. Check the "
                    f"network between the ranks.", path=where,
                    expected=f"{loc.crc32c:08x}", actual=f"{actual:08x}")
        dtype = self._dtypes[loc]
        self.blobs[loc] = (bytes(piece) if dtype is None
                           else tensor_from_bytes(piece, dtype, where, loc))


def _buffer(nbytes: int, lent: torch.Tensor | None) -> torch.Tensor:
    """``lent`` (a flat uint8 buffer of at least ``nbytes``), or fresh scratch memory."""
    if lent is not None:
        return lent[:nbytes]
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(_scratch(nbytes), dtype=torch.uint8)


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
    """Group sorted byte ranges into few reads: merge across a hole when it is small, both
    in bytes (at most ``gap``) and against what the read wants (at most 1/32 of the bytes
    wanted so far in it, or one page): a read never carries much that nobody asked for
    (a loading rank reads about what it needs, docs/performance.md)."""
    group: list[ItemLocation] = []
    start = end = wanted = 0
    for loc in locs:
        hole = loc.offset - end
        if group and (hole > gap or (hole > _PAGE_BYTES and hole * 32 > wanted)
                      or loc.offset + loc.length - start > max_bytes):
            yield start, end, group
            group = []
        if not group:
            start = loc.offset
            end = loc.offset + loc.length
            wanted = 0
        else:
            end = max(end, loc.offset + loc.length)
        wanted += loc.length
        group.append(loc)
    if group:
        yield start, end, group
