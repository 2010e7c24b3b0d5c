"""One committed version sent to a neighbouring node and committed there: the bytes of a
node-local checkpoint copied to the next node, or fetched back from it
(:mod:`ckpt.job._copies` decides who sends what, and when).

A version goes as messages (``ckpt.ranks.swap_bytes``), in three phases every pair of nodes
runs in step (:func:`swap_versions`):

1. the head: a header (step, the sending node, its root, every file with its size, the
   steps its owner keeps), then the manifest. A sender first checks its own files against
   its manifest (one listing): a version whose files are missing or of another size than
   the manifest says is not sent (the header says "nothing"), so a sender never announces
   a size its files do not hold.
2. the verdict: the receiver says back (one byte) whether it wants the files. It trusts none
   of the head: the header and the manifest are parsed strictly, the files must be those
   the manifest lists, their sizes must fit the free space of its root, and the step must
   not be committed there by a newer ckpt; a version refused here costs no more messages
   (and one it holds already needs none). Nothing is allocated on a size's word: the
   chunks a file goes as are counted, never listed.
3. the files, each in chunks of at most ``CHUNK_BYTES``, when the receiver wants them: each
   file's size and CRC32C are checked as it arrives; only then is the manifest re-issued
   under the receiving root's lease (``Lifecycle.commit_copy``).

On local disk (a local tier's home) a file is written chunk by chunk as its chunks arrive,
on a thread of its own (one chunk waits at most: the receiver holds two chunks, whatever
the file's size), and synced after its last; elsewhere a file is held until its last chunk
and then written, while the next one arrives. A copy that fails is abandoned (its files
removed, a file written before its checksum failed included); one torn by a crash has no
manifest. Failures on either side never break the step of messages: a file the sender
cannot read goes as an empty message (which the receiver refuses), and a receiver that
refused a copy in phase 3 still takes every message that follows. So a crafted or damaged
version is refused in bounded time, and the caller goes on to its next candidate: the two
sides never wait on each other until a timeout.

Size: one protocol (the three phases every pair of nodes runs in step, the sender's and
the receiver's side of each, and the verdict that ends it), kept in one module so that both
sides of every message read side by side.
"""

from __future__ import annotations

import logging
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

import torch

from ckpt.errors import CheckpointError
from ckpt.format import Manifest, crc32c_of, jsonio, step_dirname, step_file
from ckpt.ranks import CHUNK_BYTES, swap_bytes
from ckpt.root import Lifecycle
from ckpt.storage import Storage, fsync_dir

__all__ = ["Outgoing", "Incoming", "swap_versions"]

log = logging.getLogger(__name__)

_HEADER_BYTES = 1 << 20  # a header lists a node's files: far less


def _num_chunks(size: int) -> int:
    """How many messages a file of ``size`` bytes goes as (one, empty, for an empty file)."""
    return max(1, -(-size // CHUNK_BYTES))


def _chunk_sizes(size: int) -> Iterator[int]:
    """The sizes of the messages a file of ``size`` bytes goes as, one at a time."""
    if size == 0:
        yield 0
    for start in range(0, size, CHUNK_BYTES):
        yield min(CHUNK_BYTES, size - start)


def _flag(value: bool) -> torch.Tensor:
    return torch.tensor([1 if value else 0], dtype=torch.uint8)


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(0, dtype=torch.uint8)


class Outgoing:
    """A committed version on its way to a neighbour: the messages, produced as they go.

    ``manifest`` None, or a version whose files do not match it (checked here, one
    listing: ``error`` says why), sends a header saying "nothing" (``step`` None)."""

    def __init__(self, storage: Storage, manifest: Manifest | None, node: int,
                 keep: list[int] | None = None):
        self.storage, self.manifest, self.node = storage, manifest, node
        self.error: str | None = None
        self.skipped = False  # the receiver wants no files (phase 2)
        if manifest is not None:
            self.error = _mismatch(storage, manifest)
            if self.error is not None:
                log.warning("%s; it is not sent", self.error)
                manifest = self.manifest = None
        self.step = manifest.step if manifest is not None else None
        self.files = sorted((n, r.size) for n, r in manifest.files.items()) if manifest else []
        self.nbytes = sum(size for _, size in self.files)
        self.keep = keep
        self._buffer: torch.Tensor | None = None  # the message being sent (local files)

    def head(self) -> list[torch.Tensor]:
        """Phase 1: the header, and the manifest when a version is sent."""
        header = {"step": self.step, "node": self.node, "root": self.storage.url,
                  "files": [[n, s] for n, s in self.files], "keep": self.keep}
        out = [_tensor(jsonio.dumps(header))]
        if self.manifest is not None:
            out.append(_tensor(self.manifest.to_json_bytes()))
        return out

    def skip_data(self) -> None:
        """Phase 2 said no: the receiver refused the version, or holds it already."""
        self.skipped = True

    def data(self) -> Iterator[torch.Tensor]:
        """Phase 3: each file in chunks (nothing when skipped); never raises."""
        if self.manifest is None or self.skipped:
            return
        for name, size in self.files:
            start = 0
            for length in _chunk_sizes(size):
                yield self._read(step_file(self.manifest.step, name), start, length)
                start += length

    def messages(self) -> Iterator[torch.Tensor]:
        """Every message in order, phase 2 taken as "send" (one process: the tests)."""
        yield from self.head()
        yield from self.data()

    def _read(self, rel: str, start: int, length: int) -> torch.Tensor:
        """``length`` bytes of ``rel`` from ``start``; on a failure an empty message, which
        the receiver refuses (a length it did not expect) while the rounds stay in step."""
        if self.error is not None or length == 0:
            return torch.empty(0, dtype=torch.uint8)
        try:
            if self.storage.local_path(rel) is not None:
                # One buffer for every message: ``swap_bytes`` returns once its send is
                # done, so the next read may reuse it (no new pages per message).
                if self._buffer is None or self._buffer.numel() < length:
                    self._buffer = torch.empty(max(length, min(CHUNK_BYTES, self.nbytes)),
                                               dtype=torch.uint8)
                out = self._buffer[:length]
                view = memoryview(out.numpy())
                with self.storage.open_local(rel) as f:
                    f.seek(start)
                    got = 0
                    while got < length:
                        n = f.readinto(view[got:])
                        if not n:
                            raise EOFError(f"{self.storage.describe(rel)} is shorter than "
                                           f"{start + length} bytes")
                        got += n
                return out
            return _tensor(self.storage.read_bytes(rel, start, start + length))
        except Exception as exc:  # noqa: BLE001 - reported by the receiver's check
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("could not read %s to copy it: %s", self.storage.describe(rel), exc)
            return torch.empty(0, dtype=torch.uint8)


def _mismatch(storage: Storage, manifest: Manifest) -> str | None:
    """Why the files of ``manifest`` under ``storage`` do not match it (one is missing or
    of another size; the folder cannot be listed), or None."""
    d = step_dirname(manifest.step)
    try:
        sizes = {n: size for n, kind, size in storage.listdir(d) if kind == "file"}
    except Exception as exc:  # noqa: BLE001 - a version that cannot be listed is not sent
        return f"{storage.describe(d)} cannot be listed to copy it: {exc}"
    for name, rec in sorted(manifest.files.items()):
        if sizes.get(name) != rec.size:
            have = "missing" if name not in sizes else f"{sizes[name]} bytes"
            return (f"{storage.describe(f'{d}/{name}')} is {have}, its manifest says "
                    f"{rec.size} bytes")
    return None


class Incoming:
    """A version arriving from a neighbour into the root of ``life`` (which holds its lease).

    Messages are taken in order: the header, then the manifest, then the files' chunks.
    ``expected`` is how many messages this version is so far (1 until the header said; 2,
    the head, until :meth:`wants_data` said yes). Nothing the sender says is trusted: the
    header and the manifest are parsed strictly, every file must be one the manifest lists
    with its size and CRC32C, and the files must fit the root's free space. ``sender``: the
    node sending; ``mirror``: delete the steps (older than this one) that the owner no
    longer keeps."""

    def __init__(self, life: Lifecycle, sender: int, *, mirror: bool):
        self.life, self.storage, self.mirror = life, life.storage, mirror
        self.source = f"node {sender}"  # in messages; the sender's root once it says it
        self.root = self.source
        self.expected = 1
        self.step: int | None = None
        self.node: int | None = None
        self.manifest: Manifest | None = None
        self.error: str | None = None
        self.held = False  # this very version is committed here already
        self.announced = False  # the header announced a version (or could not be read)
        self.began = False
        self.nbytes = 0
        self._keep: list[int] | None = None
        self._files: list[tuple[str, int]] = []
        self._num_data = 0  # data messages the header announced
        self._next = (0, 0)  # the file and offset of the next data message
        self._taken = 0
        self._chunks: list[torch.Tensor] = []  # a file's chunks so far (not on local disk)
        self._crc = 0  # of the file arriving, so far
        self._streamed = self.storage.local_path() is not None  # files written as they come
        self._file = None  # the local file being written, chunk by chunk
        self._writer: ThreadPoolExecutor | None = None
        self._writing: Future | None = None  # the chunk (or file) being written

    def take(self, msg: torch.Tensor) -> None:
        i, self._taken = self._taken, self._taken + 1
        try:
            if i == 0:
                self._header(msg)
            elif i == 1:
                self._manifest(msg)
            else:
                self._data(*self._advance(), msg)
        except Exception as exc:  # noqa: BLE001 - the copy fails; the rounds stay in step
            self._fail(f"{type(exc).__name__}: {exc}")

    def wants_data(self) -> bool:
        """Phase 2, after the head: whether the files should come (no problem so far, and
        not held here already); ``expected`` then counts them."""
        wanted = self.announced and self.error is None and not self.held
        if wanted:
            self.expected = 2 + self._num_data
        return wanted

    def _advance(self) -> tuple[int, int, bool, bool]:
        """The next data message: (file, length, first chunk, last chunk); computed as
        they come, so a size announced is never a list in memory."""
        index, start = self._next
        if index >= len(self._files):
            raise CheckpointError(f"{self.source} sent more messages than its header said")
        size = self._files[index][1]
        length = min(CHUNK_BYTES, size - start)
        last = start + length >= size
        self._next = (index + 1, 0) if last else (index, start + length)
        return index, length, start == 0, last

    def _fail(self, why: str) -> None:
        if self.error is None:
            self.error = why
        self._chunks = []

    def _header(self, msg: torch.Tensor) -> None:
        # Anything but a readable "nothing" announces a version: the sender sends its
        # manifest next and waits for the verdict, whatever this side made of the header.
        self.announced, self.expected = True, 2
        doc = jsonio.loads(msg.numpy().tobytes(), f"copy header from {self.source}",
                           max_bytes=_HEADER_BYTES)
        if isinstance(doc, dict) and doc.get("step") is None:
            self.announced, self.expected = False, 1
            return  # nothing this round
        step, files = doc.get("step"), doc.get("files") if isinstance(doc, dict) else None
        if not (isinstance(step, int) and isinstance(doc.get("node"), int)
                and isinstance(files, list)
                and all(isinstance(f, list) and len(f) == 2 and isinstance(f[0], str)
                        and isinstance(f[1], int) and f[1] >= 0 for f in files)):
            raise CheckpointError(f"copy header from {self.source} is malformed")
        self.step, self.node = step, doc["node"]
        if isinstance(doc.get("root"), str):
            self.root = f"{self.source}:{doc['root']}"
        keep = doc.get("keep")
        self._keep = [int(s) for s in keep] if isinstance(keep, list) else None
        self._files = [(name, size) for name, size in files]
        self._num_data = sum(_num_chunks(size) for _, size in self._files)

    def _manifest(self, msg: torch.Tensor) -> None:
        where = f"{self.root}/{step_dirname(self.step)} (a copy in flight)"
        m = Manifest.from_json_bytes(msg.numpy().tobytes(), where, expected_step=self.step)
        listed = sorted((n, r.size) for n, r in m.files.items())
        if listed != sorted(self._files):
            raise CheckpointError(f"{where}: the files sent are not the files its manifest "
                                  f"lists")
        self.manifest = m
        if self.life.has_manifest(self.step):
            try:
                there = self.life.read_committed(self.step)
            except CheckpointError:
                there = None
            if there is not None and there.save_id == m.save_id:
                self.held = True  # copied before: the bytes that follow are not needed
                return
            # Another version of this step (the owner saved it again after a resume):
            # the copy mirrors the owner.
            if there is not None:
                self.life.delete(self.step)
        need = sum(size for _, size in self._files)
        free = self._free_bytes()
        if free is not None and need > free:
            raise CheckpointError(f"{where}: the copy holds {need} bytes, more than the "
                                  f"{free} free on {self.storage.url}; refused")
        self.life.begin(self.step, m.save_id)
        self.began = True

    def _free_bytes(self) -> int | None:
        """The free space of the root, where it can be known (local disk)."""
        path = self.storage.local_path()
        return shutil.disk_usage(path).free if path is not None else None

    def _data(self, index: int, length: int, first: bool, last: bool,
              msg: torch.Tensor) -> None:
        name, size = self._files[index]
        if self.error is not None or self.held:
            return  # drained: the sender does not know, and the rounds must stay in step
        if msg.numel() != length:
            raise CheckpointError(f"{name} from {self.source} arrived short ({msg.numel()} of "
                                  f"{length} bytes: the sender could not read it)")
        self._crc = crc32c_of([msg.numpy()], 0 if first else self._crc)
        rel = step_file(self.step, name)
        if self._streamed:
            # Written on a thread of its own while the next chunk arrives: a receiver's disk
            # must not hold up the sender (in a ring, every node). One chunk waits at most.
            self._wait_written()
            if self.error is None:
                self._write(self._write_chunk, rel, msg, first, last)
        else:
            self._chunks.append(msg)
        if not last:
            return
        chunks, self._chunks = self._chunks, []
        record = self.manifest.files[name]
        if self._crc != record.crc32c:
            raise CheckpointError(
                f"{self.root}/{step_file(self.step, name)}: checksum mismatch "
                f"(expected crc32c {record.crc32c:08x}, got {self._crc:08x}); the copy is "
                f"refused")
        if not self._streamed:
            self._wait_written()  # one file waits at most
            if self.error is None:
                self._write(self.storage.write_buffers, rel, [c.numpy() for c in chunks])
        self.nbytes += size

    def _write(self, fn, *args) -> None:
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-copy-write")
        self._writing = self._writer.submit(fn, *args)

    def _write_chunk(self, rel: str, msg: torch.Tensor, first: bool, last: bool) -> None:
        """On the writer thread: one chunk into the local file (a new one for the first);
        after the last, the file and its folder synced."""
        if first:
            self._file = self.storage.create_local(rel)
        self._file.write(memoryview(msg.numpy()))
        if last:
            f, self._file = self._file, None
            with f:
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(os.path.dirname(self.storage.local_path(rel)))

    def _close_file(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass

    def _wait_written(self) -> None:
        """Wait for the chunk (or file) being written, if any; its failure fails the copy."""
        writing, self._writing = self._writing, None
        if writing is not None:
            try:
                writing.result()
            except Exception as exc:  # noqa: BLE001 - the copy fails, reported by finish
                self._fail(f"{type(exc).__name__}: {exc}")

    def finish(self) -> Manifest | None:
        """After the last message: commit the copy (or find it held already) and return
        its manifest; None when nothing was sent. Raises ``CheckpointError`` when the copy
        failed (its files are removed first)."""
        self._wait_written()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        self._close_file()  # a file left open by a copy that failed in its middle
        if not self.announced:
            return None
        if self.error is None and not self.held:
            try:
                committed = self.life.commit_copy(self.manifest, self.root)
                self._trim()
                return committed
            except Exception as exc:  # noqa: BLE001 - the copy does not count
                self._fail(f"{type(exc).__name__}: {exc}")
        if self.held and self.error is None:
            return self.manifest
        if self.began:
            try:
                self.life.abandon(self.step, self.manifest.save_id)
            except Exception as exc:  # noqa: BLE001 - cleanup at the next lease removes it
                log.warning("could not remove the failed copy of step %s in %s: %s",
                            self.step, self.storage.url, exc)
        raise CheckpointError(f"copy of node {self.node}'s local step {self.step} into "
                              f"{self.storage.url} failed: {self.error}")

    def _trim(self) -> None:
        """Mirror the owner's retention: delete older steps it no longer keeps."""
        if not self.mirror or self._keep is None:
            return
        for step in self.life.known_committed():
            if step < self.step and step not in self._keep:
                try:
                    self.life.delete(step)
                except Exception as exc:  # noqa: BLE001 - tried again after the next copy
                    log.warning("could not delete the copy of step %d in %s: %s", step,
                                self.storage.url, exc)


def swap_versions(group, *, send_to: int | None, outgoing: Outgoing | None,
                  recv_from: int | None, incoming: Incoming | None) -> None:
    """Send ``outgoing`` to ``send_to`` while ``incoming`` arrives from ``recv_from``, one
    message each way per step (``ckpt.ranks.swap_bytes``), in the module's three phases:
    the heads; the verdicts (``incoming``'s back to ``recv_from`` while ``outgoing`` learns
    its receiver's from ``send_to``: the files go only when wanted); the files. Both sides
    of a pair count the same messages in each phase, so neither waits for one that never
    comes."""
    def run(out: Iterator[torch.Tensor], taken: int) -> int:
        while True:
            payload = next(out, None)
            want = incoming is not None and taken < incoming.expected
            if payload is None and not want:
                return taken
            got = swap_bytes(group, send_to=send_to if payload is not None else None,
                             payload=payload, recv_from=recv_from if want else None)
            if got is not None:
                incoming.take(got)
                taken += 1

    taken = run(iter(outgoing.head() if outgoing is not None else ()), 0)
    asks = incoming is not None and incoming.announced
    waits = outgoing is not None and outgoing.step is not None
    if asks or waits:
        answer = swap_bytes(group, send_to=recv_from if asks else None,
                            payload=_flag(incoming.wants_data()) if asks else None,
                            recv_from=send_to if waits else None)
        if waits and not (answer is not None and answer.numel() == 1 and int(answer[0])):
            outgoing.skip_data()
    run(outgoing.data() if outgoing is not None else iter(()), taken)
