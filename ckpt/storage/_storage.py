"""One small storage interface over fsspec: local paths, ``file://``, ``s3://``, ``memory://``.

:class:`Storage` is the one type the rest of ``ckpt`` talks to. It parses the checkpoint
URL, names files in messages (:meth:`Storage.describe`), retries and translates errors, and
hands the primitives to a backend, one class per filesystem family (``ckpt/storage/``):
``LocalBackend`` (durable local writes, commit by hard link, no links followed),
``S3Backend`` (conditional writes, parallel multipart uploads) and ``FsspecBackend``
(``memory://`` and any other fsspec filesystem). Paths passed to methods are relative to
the storage root and use ``/``.

Retries: every request is retried by :class:`RetryPolicy` (exponential backoff with full
jitter) when it fails with a transient error: a timeout, a dropped or refused connection,
S3 throttling (``SlowDown``) or a 5xx. s3fs's and botocore's own retry loops are turned off
for the filesystems made here, so each retry is counted once, in ``RetryPolicy.num_retries``
(aiohttp still resends an idempotent request once, uncounted, when a reused keep-alive
connection turns out to be closed).
Errors that retrying cannot fix (unreachable endpoint after the last attempt, bad
credentials, a missing bucket) become :class:`~ckpt.errors.StorageUnavailableError` with a
message that names the URL and what to check.

Links (local disk): nothing is read, written, listed or deleted through a symbolic link
inside a root, nor inside a root's :meth:`Storage.child` (see ``ckpt/storage/_local.py``).

Sizes: a whole-file read of a record (manifest, marker, part, control file) names the most
it may hold (``read_bytes(..., max_bytes=)``): a larger file is refused, naming it, with
memory bounded by that limit, never by what the file holds.
"""

from __future__ import annotations

import errno
import os
from typing import Any, Callable, Sequence, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ckpt.errors import StorageUnavailableError
from ckpt.storage._base import Backend, FsspecBackend, too_large_error
from ckpt.storage._retry import (
    RetryPolicy,
    error_code,
    is_credentials_error,
    is_throttling_error,
    is_transient_error,
)
from ckpt.storage._s3 import DEFAULT_PART_BYTES, PROTOCOLS as S3_PROTOCOLS, S3Backend, open_s3
from ckpt.storage._local import LocalBackend

__all__ = ["Storage", "open_backend"]

T = TypeVar("T")


class Storage:
    """A checkpoint root on any fsspec filesystem.

    ``Storage("s3://bucket/prefix", storage_options={"client_kwargs": {"endpoint_url": ...}})``
    or a plain local path. Methods take paths relative to the root. All methods are safe to
    call from several threads at once. A Storage pickles without its backend (and so its
    filesystem object), which is rebuilt from the URL and options, so it can be handed to
    spawned processes.

    ``backend`` is the :class:`~ckpt.storage.Backend` that does the requests; ``fs`` (the
    fsspec filesystem) and ``root`` (the root as a path on it) come from it. Callers never
    ask which backend a root is on; they ask what it can do, to take a faster or simpler
    path where one exists: :meth:`local_path`, :attr:`has_folders`, :attr:`default_threads`,
    :attr:`preferred_file_bytes`; :meth:`location` compares two roots.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 retry: RetryPolicy | None = None, *, within: str | None = None):
        if url is None or not str(url).strip():
            raise ValueError("checkpoint root is empty: give a local path or a URL such as "
                             "s3://bucket/prefix")
        url = os.fspath(url) if isinstance(url, os.PathLike) else str(url).strip()
        protocol, sep, rest = url.partition("://")
        if sep:  # keep "s3://" whole: stripping its slashes would make it a local path
            url = f"{protocol}://{rest.rstrip('/') or ('/' if rest.startswith('/') else '')}"
        else:
            url = url.rstrip("/") or "/"
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.retry = retry or RetryPolicy()
        # The root this one was made inside by ``child`` (None: a root of its own).
        self.within = within
        self.backend: Backend = open_backend(self.url, self.storage_options, self.retry,
                                             within)

    def __getstate__(self):
        # The backend is rebuilt on the other side from the URL and options.
        return {k: v for k, v in self.__dict__.items() if k != "backend"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.backend = open_backend(self.url, self.storage_options, self.retry,
                                    state.get("within"))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    @property
    def fs(self) -> Any:
        return self.backend.fs

    @property
    def root(self) -> str:
        return self.backend.root

    def child(self, rel: str) -> "Storage":
        """The folder ``rel`` (plain names, ``/``-separated) below this root as a root of
        its own, created when absent: a root a tier keeps inside another (``peer-{node}``).

        On local disk neither ``rel`` nor any folder on its way may be a symbolic link, now
        or later: the child refuses every access through one as its parent does below
        itself (``CorruptCheckpointError`` naming the link), so that a link planted where
        the child lives cannot lead its writes into another root."""
        rel = rel.strip("/")
        if not rel or any(p in ("", ".", "..") for p in rel.split("/")):
            raise ValueError(f"child root {rel!r} must be plain folder names below "
                             f"{self.url}")
        self.makedirs(rel)
        child = Storage(f"{self.url}/{rel}", self.storage_options, self.retry,
                        within=self.within or self.url)
        child.listdir("")  # refuses a link put there since
        return child

    # -- what the backend can do ------------------------------------------------------------
    def local_path(self, rel: str = "") -> str | None:
        """The path of ``rel`` on the local file system (for ``os`` calls: ``fsync``,
        :meth:`open_local`), or None when the root is not on one (S3, ``memory://``)."""
        return self.backend.local_path(rel)

    @property
    def has_folders(self) -> bool:
        """Whether folders exist apart from their files. False on S3: a prefix exists only
        through its objects, so a root that holds nothing yet is not "missing"."""
        return self.backend.has_folders

    @property
    def default_threads(self) -> int:
        """Files (and streams) per rank for a save or a load when not told: object stores
        want many requests in flight (16), local disks a few files (4)."""
        return self.backend.default_threads

    @property
    def shared_across_processes(self) -> bool:
        """Whether another process sees this root's files and may write beside this one
        (False for ``memory://``, which lives in this process)."""
        return self.backend.shared_across_processes

    @property
    def preferred_file_bytes(self) -> int | None:
        """The size a save's data files should not exceed for the fastest writes, one
        request each (S3: one part, 32 MiB); None where a few large files are as fast."""
        return self.backend.preferred_file_bytes

    @staticmethod
    def location(url: str) -> str:
        """Where the root ``url`` is, as text to compare with another root's: a local path
        (``file://`` included) as its real absolute folder (``~`` expanded, links resolved),
        any other URL as written; always ending in ``/``, so ``a.startswith(b)`` means "the
        same folder or inside it". Opens nothing."""
        url = os.fspath(url) if isinstance(url, os.PathLike) else str(url).strip()
        protocol, path = fsspec.core.split_protocol(url)
        if protocol in (None, "file", "local"):
            return os.path.join(os.path.realpath(os.path.expanduser(path)), "")
        return url.rstrip("/") + "/"

    # -- paths -----------------------------------------------------------------------------
    def path(self, rel: str = "") -> str:
        """The path of ``rel`` on ``fs``."""
        return self.backend.path(rel)

    def describe(self, rel: str = "") -> str:
        """The user-facing URL of ``rel``, for messages."""
        return self.backend.describe(rel)

    # -- error handling --------------------------------------------------------------------
    def _translate(self, what: str, rel: str, exc: BaseException) -> BaseException | None:
        """The user-facing error for ``exc``, or None to raise ``exc`` unchanged."""
        where = self.describe(rel)
        endpoint = self.backend.endpoint
        if error_code(exc)[0] == "NoSuchBucket":
            bucket = self.root.split("/", 1)[0]
            return StorageUnavailableError(
                f"bucket {bucket!r} does not exist (while trying to {what} {where} at "
                f"{endpoint}). Create the bucket or fix the checkpoint URL.")
        if isinstance(exc, (FileNotFoundError, FileExistsError, IsADirectoryError,
                            NotADirectoryError)):
            return None
        if self.local_path() is not None and isinstance(exc, PermissionError):
            return StorageUnavailableError(
                f"permission denied to {what} {where}: {exc}. Check the file permissions of "
                f"the checkpoint folder.")
        if isinstance(exc, PermissionError) or is_credentials_error(exc):
            return StorageUnavailableError(
                f"access denied to {what} {where} at {endpoint}: "
                f"{type(exc).__name__}: {exc}. Check the credentials (AWS_ACCESS_KEY_ID/"
                f"AWS_SECRET_ACCESS_KEY, a profile, or key/secret in storage_options) and "
                f"that they may access this bucket.")
        attempts = getattr(exc, "retry_attempts", self.retry.attempts)
        seconds = getattr(exc, "retry_seconds", None)
        over = f" over {seconds:.0f}s" if seconds is not None else ""
        if is_throttling_error(exc):
            code, status = error_code(exc)
            answer = " ".join(str(x) for x in (status, code) if x)
            return StorageUnavailableError(
                f"storage throttled: gave up after {attempts} attempt(s){over} to {what} "
                f"{where}: {endpoint} kept answering {answer} (the service is up but asks "
                f"for fewer requests). Try again later, or lower the request rate on this "
                f"bucket (fewer jobs or threads at once).")
        if is_transient_error(exc):
            return StorageUnavailableError(
                f"storage unreachable: could not {what} {where} after {attempts} "
                f"attempt(s){over}: {type(exc).__name__}: {exc}. Check the endpoint "
                f"({endpoint}), the network, and that the service is up.")
        return None

    def _guard(self, what: str, rel: str, fn: Callable[[], T]) -> T:
        """``fn()`` with errors translated (no retry: ``fn`` retries per request itself)."""
        try:
            return fn()
        except Exception as exc:
            translated = self._translate(what, rel, exc)
            if translated is None:
                raise
            raise translated from exc

    def _wrap(self, what: str, rel: str, fn: Callable[[], T]) -> T:
        """``fn()`` retried on transient errors, then with errors translated."""
        return self._guard(what, rel, lambda: self.retry.call(f"{what} {self.describe(rel)}", fn))

    # -- reads -----------------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        return self._wrap("check", rel, lambda: self.backend.exists(rel))

    def size(self, rel: str) -> int:
        return self._wrap("stat", rel, lambda: self.backend.size(rel))

    def read_bytes(self, rel: str, start: int | None = None, end: int | None = None, *,
                   max_bytes: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``rel`` (the whole object when both are None).

        ``max_bytes`` (a whole read only): the most ``rel`` may hold; a larger file is
        refused (``CorruptCheckpointError`` naming it) having read at most ``max_bytes + 1``
        bytes (none on local disk, where its size is known first)."""
        if max_bytes is not None:
            if start is not None or end is not None:
                raise ValueError("max_bytes bounds a whole read, not a range")
            data = self._wrap("read", rel, lambda: self.backend.read_at_most(rel, max_bytes))
            if len(data) > max_bytes:
                raise too_large_error(self.describe(rel), max_bytes)
            return data
        if start is not None and end is not None and end <= start:
            return b""
        return self._wrap("read", rel, lambda: self.backend.read(rel, start, end))

    def open_local(self, rel: str):
        """An unbuffered binary file object reading local file ``rel``, never through a
        link (``CorruptCheckpointError`` naming it). For readers that fill tensors in place."""
        backend = self.backend
        if not isinstance(backend, LocalBackend):
            raise ValueError(f"{self.describe(rel)} is not on a local file system")
        return os.fdopen(self._guard("open", rel, lambda: backend.open_fd(rel)), "rb",
                         buffering=0)

    def create_local(self, rel: str):
        """A binary file object writing new local file ``rel`` (created exclusively, never
        through a link: ``FileExistsError`` if anything is there). For writers that stream
        a file as its bytes arrive; the caller syncs it and its folder (``fsync_dir``)."""
        backend = self.backend
        if not isinstance(backend, LocalBackend):
            raise ValueError(f"{self.describe(rel)} is not on a local file system")
        return os.fdopen(self._guard("create", rel, lambda: backend.create_fd(rel)), "wb")

    def listdir(self, rel: str = "") -> list[tuple[str, str, int]]:
        """Entries directly under ``rel`` as ``(name, "file"|"directory", size)``; [] if absent."""
        return self._wrap("list", rel, lambda: self.backend.listdir(rel))

    # -- writes ----------------------------------------------------------------------------
    def makedirs(self, rel: str) -> None:
        """Create folder ``rel`` (nothing to do on S3, where prefixes need no creation)."""
        self._wrap("create folder", rel, lambda: self.backend.makedirs(rel))

    def write_buffers(self, rel: str, buffers: Sequence[Any], *, durable: bool = True,
                      part_bytes: int = DEFAULT_PART_BYTES, max_concurrency: int = 8) -> None:
        """Write the concatenation of ``buffers`` (bytes-like, numpy arrays included) to ``rel``.

        Local files are fsync'd when ``durable``. On S3 an object of two parts or more goes
        up as a parallel multipart upload of ``part_bytes`` parts (at least 5 MiB; larger if
        needed to stay within 10,000 parts), ``max_concurrency`` at a time (a smaller one is
        one PUT); it appears only
        when the upload completes, and a failed upload is aborted. Buffers are never joined:
        each request body reads zero-copy slices of them, so the extra host memory is a few
        small read chunks per request in flight.
        """
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        views = [_byte_view(b) for b in buffers]
        self._guard("write", rel, lambda: self.backend.write(
            rel, views, durable=durable, part_bytes=part_bytes, max_concurrency=max_concurrency))

    def write_bytes(self, rel: str, data: bytes, *, durable: bool = True) -> None:
        self.write_buffers(rel, [data], durable=durable)

    def create_exclusive(self, rel: str, data: bytes) -> None:
        """Create ``rel`` with ``data`` only if it does not exist; else ``FileExistsError``.

        This is the commit primitive: local files are written to a temporary name, fsync'd,
        then hard-linked into place (``link`` fails if the target exists, unlike ``rename``);
        S3 uses a conditional PUT (``If-None-Match: *``), which is the commit itself.

        A refused create that finds the object holding exactly ``data`` counts as done, on
        every backend: on S3 it is our own earlier try whose answer was lost (retried by us
        or, for a dropped keep-alive connection, silently by the HTTP client). Callers make
        ``data`` unique to the writer (the manifest carries a save id, the lease record its
        holder and time).
        """
        def _create() -> None:
            if not self.backend.create_exclusive(rel, data) \
                    and self.backend.read_or_none(rel, len(data)) != data:
                raise FileExistsError(errno.EEXIST, f"{self.describe(rel)} already exists")
        self._wrap("commit", rel, _create)

    def replace_if_unchanged(self, rel: str, data: bytes, expected: bytes) -> bool:
        """Overwrite ``rel`` with ``data`` only if it still holds ``expected``.

        Returns False when it is absent or someone else changed it first. Used by the lease's
        heartbeat and take-over. As for :meth:`create_exclusive`, finding exactly ``data``
        there (our own write whose answer was lost) counts as success. S3 reads the object
        with its ETag and writes with ``If-Match`` on that ETag. Local files swap under a
        short-lived lock folder by a rename out of it, which fails once the lock was broken
        as stale, so a swapper stalled inside the swap never lands over a newer record; the
        file never disappears, so an exclusive create cannot slip in between
        (:meth:`ckpt.storage._local.LocalBackend.replace_if_unchanged`).
        """
        return self._wrap("replace", rel,
                          lambda: self.backend.replace_if_unchanged(rel, data, expected))

    def delete(self, rel: str, recursive: bool = False) -> None:
        """Delete ``rel`` (a folder/prefix with ``recursive``); absent is not an error."""
        self._wrap("delete", rel, lambda: self.backend.delete(rel, recursive))

    def delete_many(self, rels: Sequence[str]) -> None:
        """Delete every file of ``rels``; absent ones are not an error. On S3 one request
        per 1,000 files (a bulk delete); elsewhere one :meth:`delete` per file, in order."""
        rels = list(rels)
        if not rels:
            return
        if not self.backend.bulk_delete:
            for rel in rels:
                self.delete(rel)
            return
        self._wrap("delete", rels[0], lambda: self.backend.delete_many(rels))

    def remove_empty_folder(self, rel: str) -> None:
        """Remove folder ``rel`` if it is empty. Absent, not empty, or a file appearing
        meanwhile: left as it is, no error (the removal itself refuses a folder that is not
        empty: no listing first); without folders (S3) there is nothing to do."""
        if not self.has_folders:
            return
        try:
            self.backend.rmdir(rel)
        except OSError:
            pass


def _byte_view(buf: Any) -> memoryview:
    """A flat unsigned-byte view of a bytes-like object (numpy arrays included), zero-copy
    unless it is not contiguous."""
    view = memoryview(buf)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def open_backend(url: str, options: dict[str, Any], retry: RetryPolicy,
                 within: str | None = None) -> Backend:
    """The backend for checkpoint root ``url`` (already normalised by ``Storage``).

    ``options`` are fsspec's ``storage_options``; ``retry`` is the policy the backend's
    multi-request writes use; ``within``: the root ``url`` was made inside
    (``Storage.child``), below which no folder may be a link. A URL that cannot be opened
    (unknown protocol, missing package, bad options, no bucket) raises ``ValueError``
    naming it."""
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    is_s3 = protocol in S3_PROTOCOLS
    try:
        fs, root = open_s3(url, options) if is_s3 else fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError, TypeError) as exc:
        raise ValueError(f"cannot open checkpoint root {url!r}: {exc}") from exc
    if is_s3:
        return S3Backend(url, fs, root, retry, options)
    if isinstance(fs, LocalFileSystem):
        anchor = fsspec.core.url_to_fs(within)[1] if within is not None else None
        return LocalBackend(url, fs, root, retry, anchor)
    return FsspecBackend(url, fs, root, retry)
