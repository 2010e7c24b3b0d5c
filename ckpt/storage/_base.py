"""The backend interface (:class:`Backend`) and its generic fsspec implementation.

:class:`FsspecBackend` serves any fsspec filesystem (``memory://`` and the rest) with plain
fsspec calls; :class:`~ckpt.storage._local.LocalBackend` and
:class:`~ckpt.storage._s3.S3Backend` subclass it and override only the primitives whose
behaviour they make stronger (durable writes, no links, atomic conditional writes).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any, Sequence

from ckpt.errors import CorruptCheckpointError
from ckpt.storage._retry import RetryPolicy, error_code

__all__ = ["Backend", "FsspecBackend", "too_large_error"]

# Makes check-then-write atomic for filesystems without conditional writes, within this
# process only (what ``memory://`` needs; a shared filesystem needs a backend of its own).
_PROCESS_LOCK = threading.Lock()


def too_large_error(where: str, max_bytes: int, size: int | None = None
                    ) -> CorruptCheckpointError:
    """``where`` holds more than ``max_bytes``, the most its kind of file may hold (``size``:
    how much, when known): refused before it is read."""
    holds = f"{size} bytes" if size is not None else f"more than {max_bytes} bytes"
    return CorruptCheckpointError(
        f"{where} holds {holds}, more than the {max_bytes} such a file may hold; it is "
        f"damaged or was not written by ckpt, and is not read. Restore or delete it (for a "
        f"checkpoint: load an earlier step).", path=where, expected=max_bytes, actual=size)


class Backend(ABC):
    """The primitives of one storage family, on paths relative to the root (``/``-separated).

    :class:`~ckpt.storage._storage.Storage` calls every primitive inside its retry loop and its error
    translation, except :meth:`write`, which retries its own requests with ``retry`` (an S3
    multipart upload retries each request, never the whole upload), so Storage only
    translates its errors. Primitives raise ``FileNotFoundError`` for a missing object and
    the filesystem's own errors otherwise; they may be called from several threads at once.

    The capabilities below (and :meth:`local_path`) are what
    :class:`~ckpt.storage._storage.Storage` tells callers that take a faster or simpler path
    where one exists: nothing outside this package asks which backend a root is on.
    """

    has_folders = True
    """Whether folders exist apart from their files. False: a prefix exists through its
    objects only (S3), needs no creating, and is never left behind empty."""

    default_threads = 4
    """Files (and streams) per rank a save or a load uses when not told: on a local disk a
    few files saturate the device (bench/, docs/performance.md)."""

    bulk_delete = False
    """Whether :meth:`delete_many` deletes many files in one request (S3's bulk delete)."""

    shared_across_processes = True
    """Whether another process (a writer process, another rank) sees the same files and may
    write beside this one: False where the files live in this process (``memory://``) or
    exclusive creates are atomic only among its threads."""

    preferred_file_bytes: int | None = None
    """The size a save's data files should not exceed for the fastest writes (one request
    each), or None where ``num_threads`` files of any size are as fast."""

    def __init__(self, url: str, fs: Any, root: str, retry: RetryPolicy):
        self.url = url
        self.fs = fs
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self.retry = retry

    @property
    def endpoint(self) -> str:
        """Where requests go, as a message tells the user to check it."""
        return "the mount"

    def path(self, rel: str = "") -> str:
        """The filesystem path of ``rel``."""
        rel = rel.strip("/")
        if not rel:
            return self.root
        return f"{self.root}/{rel}" if self.root != "/" else f"/{rel}"

    def describe(self, rel: str = "") -> str:
        """The user-facing URL of ``rel``, for messages."""
        rel = rel.strip("/")
        return f"{self.url}/{rel}" if rel else self.url

    def local_path(self, rel: str) -> str | None:
        """The path of ``rel`` on the local file system, where ``os`` calls (``open``,
        ``fsync``) reach it; None when the root is not on a local file system."""
        return None

    def read_or_none(self, rel: str, max_bytes: int) -> bytes | None:
        """The whole of ``rel`` when it holds at most ``max_bytes``, or None if it holds
        more or cannot be read for any reason (at most ``max_bytes + 1`` bytes are read).

        Only used to recognise our own earlier write whose answer was lost: ``max_bytes``
        is that write's size, so a larger object is not ours and is never read whole."""
        try:
            data = self.read_at_most(rel, max_bytes)
        except Exception:  # noqa: BLE001 - any failure means "not recognisably ours"
            return None
        return data if len(data) <= max_bytes else None

    @abstractmethod
    def exists(self, rel: str) -> bool:
        """Whether ``rel`` exists (a file, object or folder)."""

    @abstractmethod
    def size(self, rel: str) -> int:
        """The size of ``rel`` in bytes."""

    @abstractmethod
    def read(self, rel: str, start: int | None, end: int | None) -> bytes:
        """Bytes ``[start, end)`` of ``rel`` (the whole object when both are None; negative
        offsets count from the end)."""

    def read_at_most(self, rel: str, max_bytes: int) -> bytes:
        """The whole of ``rel`` when it holds at most ``max_bytes``; otherwise at most
        ``max_bytes + 1`` bytes of it (one ranged read), or ``too_large_error`` where the
        backend knows the size before reading. Memory is bounded by ``max_bytes`` whatever
        the file's size."""
        return self.read(rel, 0, max_bytes + 1)

    @abstractmethod
    def listdir(self, rel: str) -> list[tuple[str, str, int]]:
        """Entries directly under ``rel`` as ``(name, "file"|"directory", size)``; [] if
        absent. A folder's size is reported as 0."""

    @abstractmethod
    def makedirs(self, rel: str) -> None:
        """Create folder ``rel`` and its parents; existing ones are fine."""

    @abstractmethod
    def write(self, rel: str, views: Sequence[memoryview], *, durable: bool, part_bytes: int,
              max_concurrency: int) -> None:
        """Replace ``rel`` with the concatenation of ``views``, retrying with ``retry``.

        ``rel`` appears whole or not at all. ``durable`` asks for the bytes to be on stable
        storage on return; ``part_bytes`` and ``max_concurrency`` size a multipart upload
        where the backend has one."""

    @abstractmethod
    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Create ``rel`` holding ``data`` atomically; False (nothing written) if it exists."""

    @abstractmethod
    def replace_if_unchanged(self, rel: str, data: bytes, expected: bytes) -> bool:
        """Overwrite ``rel`` with ``data`` only if it holds ``expected``, atomically; False
        if it is absent or holds something else (True if it already holds exactly ``data``
        after an earlier try whose answer was lost, where the backend can tell)."""

    @abstractmethod
    def delete(self, rel: str, recursive: bool) -> None:
        """Delete ``rel`` (a folder or prefix with ``recursive``); absent is not an error."""

    def delete_many(self, rels: Sequence[str]) -> None:
        """Delete each file of ``rels``; absent ones are not an error (called only where
        :attr:`bulk_delete` is True; Storage deletes one by one elsewhere)."""
        for rel in rels:
            self.delete(rel, False)

    @abstractmethod
    def rmdir(self, rel: str) -> None:
        """Remove the empty folder ``rel``; ``OSError`` if it is not empty (nothing to do
        without folders)."""


class FsspecBackend(Backend):
    """Any fsspec filesystem, through its generic calls (``memory://`` in the tests).

    Exclusive creates and conditional replaces are atomic only among threads of this
    process, which is all ``memory://`` needs."""

    shared_across_processes = False

    def exists(self, rel: str) -> bool:
        try:
            self.fs.info(self.path(rel))
            return True
        except FileNotFoundError as exc:
            if error_code(exc)[0] == "NoSuchBucket":
                raise
            return False

    def size(self, rel: str) -> int:
        return int(self.fs.size(self.path(rel)))

    def read(self, rel: str, start: int | None, end: int | None) -> bytes:
        if start is None and end is None:
            return self.fs.cat_file(self.path(rel))
        return self.fs.cat_file(self.path(rel), start=start, end=end)

    def listdir(self, rel: str) -> list[tuple[str, str, int]]:
        p = self.path(rel)
        try:
            entries = self.fs.ls(p, detail=True)
        except FileNotFoundError as exc:
            if error_code(exc)[0] == "NoSuchBucket":
                raise
            return []
        out = []
        for e in entries:
            if e["name"].rstrip("/") == p.rstrip("/"):
                continue
            name = e["name"].rstrip("/").rsplit("/", 1)[-1]
            kind = "directory" if e.get("type") == "directory" else "file"
            # A folder's own size (4096 on local disks) is not data: report 0 everywhere.
            out.append((name, kind, int(e.get("size") or 0) if kind == "file" else 0))
        return out

    def makedirs(self, rel: str) -> None:
        self.fs.makedirs(self.path(rel), exist_ok=True)

    def write(self, rel: str, views: Sequence[memoryview], *, durable: bool, part_bytes: int,
              max_concurrency: int) -> None:
        def _write() -> None:
            with self.fs.open(self.path(rel), "wb") as f:
                for view in views:
                    f.write(view)
        self.retry.call(f"write {self.describe(rel)}", _write)

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        p = self.path(rel)
        with _PROCESS_LOCK:
            if self.fs.exists(p):
                return False
            self.fs.pipe_file(p, data)
            return True

    def replace_if_unchanged(self, rel: str, data: bytes, expected: bytes) -> bool:
        p = self.path(rel)
        with _PROCESS_LOCK:
            # No more than ``expected`` and one byte: a larger file is not it.
            if not self.fs.exists(p) or self.read_at_most(rel, len(expected)) != expected:
                return False
            self.fs.pipe_file(p, data)
            return True

    def delete(self, rel: str, recursive: bool) -> None:
        try:
            self.fs.rm(self.path(rel), recursive=recursive)
        except FileNotFoundError as exc:
            if error_code(exc)[0] == "NoSuchBucket":
                raise

    def rmdir(self, rel: str) -> None:
        self.fs.rmdir(self.path(rel))
