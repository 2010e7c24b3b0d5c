"""Our StorageWriter for torch.distributed.checkpoint: where each rank's bytes go.

DCP's planners (:mod:`ckpt.dcp.planners`) decide *what* each rank saves; this writer decides
*where* the bytes go (data files laid out as :mod:`ckpt.dcp.layout` says), checksums every
item, and commits our JSON manifest (:mod:`ckpt.format.manifest`) instead of DCP's pickled
``.metadata``.

Format version 2: each rank writes its own *part* (:mod:`ckpt.format.part`) beside its data
files, naming the chunks of sharded tensors it wrote and those it holds that another rank
wrote (DCP writes a shard that several ranks hold, e.g. an HSDP replica, from one of them);
only what the root manifest needs (files, tensors saved whole, objects, the part's checksum)
travels back to the coordinator, which commits a root of O(keys + ranks) entries.

Call order (DCP's contract): every rank ``set_up_storage_writer`` -> ``prepare_local_plan``;
the coordinator ``prepare_global_plan`` (here it also begins the attempt through
:mod:`ckpt.root.lifecycle`: refuses a committed step, writes the attempt's marker before any data
exists, then the attachments); every rank ``write_data`` (data files, then its part); the
coordinator ``finish`` (commits the root manifest through :mod:`ckpt.root.lifecycle`, which
fences off a writer that lost the lease).

Size: one class, DCP's StorageWriter contract end to end (plans, the data files with their
checksums, the rank's part, the root manifest); layout, shards, attachments and save cost
are modules of their own.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckpt.dcp._shards import LocalShards, in_part, refs_by_rank
from ckpt.dcp.attachments import attachment_bytes
from ckpt.dcp.layout import buffer_nbytes, tensor_view_bytes
from ckpt.dcp.savecost import SaveCost
from ckpt.format import (
    DTYPE_NAMES,
    Attachment,
    FileRecord,
    ItemLocation,
    Lineage,
    Manifest,
    Part,
    PartRecord,
    crc32c_combine,
    attachment_file,
    crc32c_of,
    data_file_name,
    dtype_from_name,
    new_run_id,
    dtype_name,
    part_name,
    part_sha256,
)
from ckpt.root import Lifecycle
from ckpt.storage import Storage

__all__ = ["CkptWriter"]

_FILE_KEY = "__file__:"
_PART_KEY = "__part__:"
_MAX_NAMED = 10  # keys named in one error
_FORMAT_DTYPES = frozenset(dtype_from_name(name, "ckpt") for name in DTYPE_NAMES)


@dataclasses.dataclass
class _RankData:
    """A rank's final plan's ``storage_data``: this save's id (the coordinator's, from which
    and its rank each writer names its files) and ``refs``: the chunks the rank holds that
    another rank writes, ``(key, offsets) -> writer rank``. ``refs`` depends on the layout
    only: a save that reuses a cached plan (:mod:`ckpt.dcp.plancache`) sends ``None`` and
    the planner fills in the cached plan's (:meth:`reuse`)."""

    save_id: str
    refs: dict[tuple[str, tuple[int, ...]], int] | None = None

    def reuse(self, cached: Any) -> _RankData:
        """This save's id with the refs of the cached final plan's ``storage_data``."""
        return _RankData(self.save_id, cached.refs if isinstance(cached, _RankData) else {})


@dataclasses.dataclass(frozen=True)
class _PartWritten:
    """What a rank reports of its part: its file record and its SHA-256."""

    record: FileRecord
    sha256: str


class CkptWriter(StorageWriter):
    """Writes one checkpoint folder. Construct one per save (it holds that save's state)."""

    def __init__(self, storage: Storage, step: int, step_dir: str, *, save_id: str | None = None,
                 num_threads: int | None = None, lifecycle: Lifecycle | None = None,
                 manifest_extra: dict[str, Any] | None = None, durable: bool = True,
                 before_commit: Callable[[], None] | None = None,
                 before_write: Callable[[], None] | None = None,
                 attachments: dict[str, bytes | str] | None = None, cost: Any = None,
                 host_window_bytes: int | None = None):
        super().__init__()
        # Device tensors (a state larger than its staging budget) reach the host in waves
        # of at most this many bytes, each written before the next is copied; None: at once.
        self.host_window_bytes = host_window_bytes
        self.cost = cost if cost is not None else SaveCost()  # see ckpt.dcp.savecost
        self.before_commit = before_commit
        self.before_write = before_write
        # Checked by ckpt.dcp.attachments.check_attachments; written by the coordinator only.
        self.attachments = dict(attachments or {})
        self._attached: dict[str, Attachment] = {}
        self.storage = storage
        self.life = lifecycle or Lifecycle(storage)
        self.step = step
        self.step_dir = step_dir
        self.save_id = save_id or uuid.uuid4().hex[:12]
        self.num_threads = max(1, num_threads or storage.default_threads)
        self.extra = dict(manifest_extra or {})
        self.durable = durable
        self.is_coordinator = True
        self.rank = 0  # in the save's group (set_up_storage_writer)
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
        self.rank = int(kwargs.get("rank", 0))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Every rank, before any byte of the save is written (the attempt's marker
        included): ``before_write`` (it may refuse the save), then refuse a tensor whose
        dtype the format cannot hold. Found later, at the commit, it would cost every rank a
        whole write for nothing. Raising here fails the save on every rank: DCP gathers
        each rank's outcome of this step."""
        if self.before_write is not None:
            self.before_write()
        unsupported = sorted({(item.index.fqn, str(item.tensor_data.properties.dtype))
                              for item in plan.items if item.tensor_data is not None
                              and item.tensor_data.properties.dtype not in _FORMAT_DTYPES})
        if unsupported:
            named = ", ".join(f"{fqn!r} ({dtype})" for fqn, dtype in unsupported[:_MAX_NAMED])
            more = len(unsupported) - _MAX_NAMED
            raise ValueError(
                f"cannot save step {self.step}: the checkpoint format does not support the "
                f"dtype of state key(s) {named}{f' and {more} more' if more > 0 else ''}. "
                f"Supported: {', '.join(DTYPE_NAMES)} (docs/format.md, 'Manifest'). Convert "
                f"such a tensor to one of them before saving (e.g. t.view(torch.uint8) for "
                f"bit-packed data, t.dequantize() for a quantized tensor).")
        shards = tuple(item.index for item in plan.items if in_part(item))
        if not shards:
            return plan
        return dataclasses.replace(plan, storage_data=LocalShards(shards, len(plan.items)))

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
        # The coordinator's save id, this save's, for every rank's file names (write_data).
        # All plans unusable: every rank reuses its cached plan, refs included (_RankData).
        if not any(p.usable for p in plans):
            return [dataclasses.replace(p, storage_data=_RankData(self.save_id))
                    for p in plans]
        refs = refs_by_rank(plans)
        return [dataclasses.replace(p, storage_data=_RankData(self.save_id, refs[i]))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if isinstance(plan.storage_data, _RankData):
            self.save_id = plan.storage_data.save_id  # the coordinator's
        with self.cost.span():  # its time is in the write/fsync/crc phases
            try:
                results = self._write_data(plan, planner)
            except FileNotFoundError:  # the step's folder went away: say why, if fenced off
                self.life.raise_if_taken_over(
                    f"step {self.step} was being written (its files were removed)")
                raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_data(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        rank, save_id = self.rank, self.save_id
        items = list(plan.items)
        # The planner already checksummed this rank's plain tensors (the replica check), over
        # the very bytes written here: those checksums are reused, not computed again.
        known: dict[str, int] = getattr(planner, "known_crcs", None) or {}
        # Resolve data on this thread (planners are not thread-safe), then write in parallel.
        resolved, deferred = [], []
        for item in items:
            data = planner.resolve_data(item)
            crc = None
            if item.type == WriteItemType.BYTE_IO:
                buf = data.getvalue()
                crc = known.get(item.index.fqn)  # the planner's, of these very bytes
            else:
                nbytes = data.numel() * data.element_size()
                whole = planner.state_dict.get(item.index.fqn) if hasattr(
                    planner, "state_dict") else None
                if item.index.fqn in known and isinstance(whole, torch.Tensor) and \
                        whole.numel() * whole.element_size() == nbytes:
                    crc = known[item.index.fqn]
                if self.host_window_bytes is not None and data.device.type != "cpu":
                    deferred.append((item, data, crc, nbytes))  # copied in its wave
                    continue
                buf = tensor_view_bytes(data)
            resolved.append((item, buf, crc))
        num_files = self.num_threads
        file_bytes = self.storage.preferred_file_bytes
        if file_bytes:
            # Object stores: files of about one part each, so every file is a single PUT and
            # num_threads of them are in flight (Storage.preferred_file_bytes says why).
            total = sum(buffer_nbytes(r[1]) for r in resolved)
            num_files = max(num_files, min(1024, -(-total // file_bytes)))
        waves = [_balance(resolved, num_files)] + [
            wave for wave in _waves(deferred, self.host_window_bytes or 0)]
        # Local files: each file's bytes are synced by itself, and the folder (the files'
        # names) once for all of them, before this rank reports its files written; the
        # manifest, the commit, comes only after every rank did (DCP's contract).
        sync_here = self.durable and self.storage.local_path() is not None
        cost = self.cost
        results: list[WriteResult] = []

        def checksum(bufs: list) -> list[int]:
            with cost.phase("crc"):
                return [crc32c_of([b]) for b in bufs]

        def write_bucket(k: int, bucket):
            name = data_file_name(rank, save_id, k)
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
                        _fsync_path(self.storage.local_path(rel))
            finally:
                if summer is not None:
                    summer.join()
            crcs = [crc for _, _, crc in bucket]
            for i, value in zip(todo, computed):
                crcs[i] = value
            offset, crc, out = 0, 0, []
            for (item, buf, _), item_crc in zip(bucket, crcs):
                length = buffer_nbytes(buf)
                crc = crc32c_combine(crc, item_crc, length)  # no second pass over the bytes
                out.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=ItemLocation(name, offset, length, item_crc)))
                offset += length
            out.append(WriteResult(index=MetadataIndex(_FILE_KEY + name), size_in_bytes=offset,
                                   storage_data=FileRecord(offset, crc, rank)))
            return out

        num_named = 0  # file numbers given so far
        wrote_files = False
        for wave in waves:
            if callable(wave):  # device tensors: their host copies now, freed after
                wave = wave(self.num_threads)
            non_empty = [(num_named + k, b) for k, b in enumerate(wave) if b]
            num_named += len(wave)
            wrote_files = wrote_files or bool(non_empty)
            if len(non_empty) <= 1:
                for k, b in non_empty:
                    results.extend(write_bucket(k, b))
            else:
                with ThreadPoolExecutor(min(self.num_threads, len(non_empty)),
                                        thread_name_prefix="ckpt-write") as pool:
                    for out in pool.map(lambda kb: write_bucket(*kb), non_empty):
                        results.extend(out)
            wave = non_empty = None  # a device wave's host copies go now
        results, wrote_part = self._write_part(plan, rank, save_id, results, sync_here)
        if sync_here and (wrote_files or wrote_part):
            with cost.phase("fsync"):
                _fsync_path(self.storage.local_path(self.step_dir))
        return results

    def _write_part(self, plan: SavePlan, rank: int, save_id: str,
                    results: list[WriteResult], sync_here: bool
                    ) -> tuple[list[WriteResult], bool]:
        """Write this rank's part (when it has chunks or refs): the locations of the chunks
        of sharded tensors it wrote, and the chunks it holds that another rank writes.
        Returns what goes back to the coordinator (everything else: files, tensors saved
        whole, objects, the part's record) and whether a part was written."""
        sizes = {item.index: item.tensor_data.chunk.sizes for item in plan.items
                 if in_part(item)}
        part = Part(rank)
        back: list[WriteResult] = []
        for wr in results:
            chunk_sizes = sizes.get(wr.index)
            if chunk_sizes is None:
                back.append(wr)
            else:
                part.chunks.setdefault(wr.index.fqn, []).append(
                    {"offsets": list(wr.index.offset), "sizes": list(chunk_sizes),
                     "location": wr.storage_data})
        for (fqn, offsets), writer in sorted((getattr(plan.storage_data, "refs", None) or {}).items()):
            part.refs.setdefault(fqn, []).append((list(offsets), writer))
        if not part:
            return back, False
        with self.cost.phase("commit"):
            name = part_name(rank, save_id)
            data = part.to_json_bytes(self.step, save_id)
            rel = f"{self.step_dir}/{name}"
            self.storage.write_bytes(rel, data, durable=self.durable and not sync_here)
        if sync_here:
            with self.cost.phase("fsync"):
                _fsync_path(self.storage.local_path(rel))
        record = FileRecord(len(data), crc32c_of([data]), rank)
        back.append(WriteResult(index=MetadataIndex(_PART_KEY + name), size_in_bytes=len(data),
                                storage_data=_PartWritten(record, part_sha256(data))))
        return back, True

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        with self.cost.phase("commit"):
            self._finish(metadata, results)

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Build and commit the root manifest: every file (data files, parts, attachments),
        every key with its dtype and shape, the chunks of tensors saved whole and every
        object's location; sharded tensors' chunks are in the parts the ranks wrote."""
        files: dict[str, FileRecord] = {}
        parts: dict[str, PartRecord] = {}
        where: dict[MetadataIndex, ItemLocation] = {}
        for rank_results in results:
            for wr in rank_results:
                fqn = wr.index.fqn
                if fqn.startswith(_FILE_KEY):
                    files[fqn[len(_FILE_KEY):]] = wr.storage_data
                elif fqn.startswith(_PART_KEY):
                    name, written = fqn[len(_PART_KEY):], wr.storage_data
                    files[name] = written.record
                    parts[name] = PartRecord(written.record.rank, written.sha256)
                else:
                    where[wr.index] = wr.storage_data
        tensors, objects = {}, {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                # A tensor saved whole has one chunk, at the origin, reported by its writer;
                # every other chunk is in the part of the rank that wrote it.
                loc = where.get(MetadataIndex(fqn, torch.Size([0] * len(md.size))))
                chunks = [] if loc is None else [
                    {"offsets": [0] * len(md.size), "sizes": list(md.size), "location": loc}]
                tensors[fqn] = {"dtype": dtype_name(md.properties.dtype),
                                "shape": list(md.size), "chunks": chunks,
                                "sharded": len(md.chunks) > len(chunks)}
            else:
                objects[fqn] = where[MetadataIndex(fqn)]
        planner_data = {k: list(v) for k, v in (metadata.planner_data or {}).items()}
        for a in self._attached.values():  # listed in files too: verified and kept with them
            files[a.file] = FileRecord(a.size, a.crc32c, 0)
        manifest = Manifest(step=self.step, save_id=self.save_id, created_unix=time.time(),
                            tensors=tensors, objects=objects, files=files,
                            planner_data=planner_data, attachments=dict(self._attached),
                            parts=parts,
                            complete=not any(t["sharded"] for t in tensors.values()),
                            lineage=self.life.lineage or Lineage(new_run_id()),
                            **self.extra)
        if self.before_commit is not None:
            self.before_commit()  # raises to abandon; the attempt stays uncommitted
        # Other versions in this folder (earlier failed attempts, rolled-back checkpoints)
        # are left alone: they are the life-cycle's to judge, never the writer's.
        self.life.commit(manifest)
        self.manifest = manifest


def _waves(deferred: list, window_bytes: int):
    """Device tensors ``(item, tensor, crc, bytes)`` in waves of at most ``window_bytes``
    (a larger one alone): each wave a function of the number of files that copies its
    tensors to the host, then balances them into that many files (one per tensor at most).
    A wave's host copies live until its files are written."""
    wave: list = []
    size = 0
    for entry in deferred:
        if wave and size + entry[3] > window_bytes:
            yield _wave(wave)
            wave, size = [], 0
        wave.append(entry)
        size += entry[3]
    if wave:
        yield _wave(wave)


def _wave(entries: list):
    def copied(num_files: int) -> list[list]:
        host = [(item, tensor_view_bytes(data), crc) for item, data, crc, _ in entries]
        return _balance(host, min(num_files, len(host)))
    return copied


def _balance(items: list, num_buckets: int) -> list[list]:
    """Greedy largest-first split into ``num_buckets`` groups of similar byte size."""
    buckets: list[list] = [[] for _ in range(num_buckets)]
    totals = [0] * num_buckets
    order = sorted(range(len(items)), key=lambda i: -buffer_nbytes(items[i][1]))
    for i in order:
        k = totals.index(min(totals))
        buckets[k].append(items[i])
        totals[k] += buffer_nbytes(items[i][1])
    # Keep each file's items in state-dict order (stable, readable layout).
    index = {id(it): i for i, it in enumerate(items)}
    for b in buckets:
        b.sort(key=lambda it: index[id(it)])
    return buckets


def _fsync_path(path: str) -> None:
    """Make a file's bytes, or a folder's entries, durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
