"""One small storage interface over fsspec: local paths, ``file://``, ``s3://``, ``memory://``.

Every backend goes through the same code; the few places where a backend needs its own
behaviour (durable local writes with fsync, exclusive creates, S3 conditional writes and
multipart uploads) are chosen by capability, not by separate classes. Paths passed to
methods are relative to the storage root and use ``/``.

Retries: every request is retried by :class:`RetryPolicy` (exponential backoff with full
jitter) when it fails with a transient error: a timeout, a dropped or refused connection,
S3 throttling (``SlowDown``) or a 5xx. s3fs's and botocore's own retry loops are turned off
for the filesystems made here, so each retry is counted once, in ``RetryPolicy.num_retries``
(aiohttp still resends an idempotent request once, uncounted, when a reused keep-alive
connection turns out to be closed).
Errors that retrying cannot fix (unreachable endpoint after the last attempt, bad
credentials, a missing bucket) become :class:`~ckpt.errors.StorageUnavailableError` with a
message that names the URL and what to check.

Links (local disk): a checkpoint root is untrusted input, so reads never follow a symbolic
link out of it: a file that is itself a link, or one whose folder resolves outside the
root, is refused with :class:`~ckpt.errors.CorruptCheckpointError` naming it. Writes never
go through a planted link or hard link either: a file is written to a fresh temporary name
in the same folder (``O_CREAT|O_EXCL|O_NOFOLLOW``), fsync'd and renamed over the target
(the rename replaces a link, it does not follow it).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
import uuid
from typing import Any, Callable, Iterable, Sequence, TypeVar

import crc32c as _crc32c
import fsspec
import fsspec.asyn
from fsspec.implementations.local import LocalFileSystem

from ckpt._retry import (  # noqa: F401 - re-exported
    RetryPolicy,
    _error_code,
    _is_credentials_error,
    _is_precondition_failed,
    is_transient_error,
)
from ckpt._s3 import _MEMORY_LOCK, _byte_view, _open_s3, _SegmentsReader, _split_parts  # noqa: F401
from ckpt.errors import CorruptCheckpointError, StorageUnavailableError

__all__ = ["Storage", "RetryPolicy", "crc32c_of", "is_transient_error"]

log = logging.getLogger(__name__)
T = TypeVar("T")

MIN_PART_BYTES = 5 << 20  # S3's smallest part (all parts but the last)
MAX_PARTS = 10_000  # S3's most parts per upload
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def crc32c_of(buffers: Iterable[Any], value: int = 0) -> int:
    """CRC32C over the concatenation of ``buffers`` (bytes-like), continuing from ``value``."""
    for buf in buffers:
        value = _crc32c.crc32c(buf, value)
    return value


# -- error classification ------------------------------------------------------------------


class Storage:
    """A checkpoint root on any fsspec filesystem.

    ``Storage("s3://bucket/prefix", storage_options={"client_kwargs": {"endpoint_url": ...}})``
    or a plain local path. Methods take paths relative to the root. All methods are safe to
    call from several threads at once. A Storage pickles without its filesystem object,
    which is rebuilt from the URL and options, so it can be handed to spawned processes.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 retry: RetryPolicy | None = None):
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
        self._open()

    def _open(self) -> None:
        """Set ``fs``, ``root``, ``is_s3`` and ``is_local`` from ``url`` and the options."""
        protocol = fsspec.core.split_protocol(self.url)[0] or "file"
        self.is_s3 = protocol in ("s3", "s3a")
        try:
            if self.is_s3:
                self.fs, root = _open_s3(self.url, self.storage_options)
            else:
                self.fs, root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        except (ImportError, ValueError, TypeError) as exc:
            raise ValueError(f"cannot open checkpoint root {self.url!r}: {exc}") from exc
        if self.is_s3 and not root.strip("/"):
            raise ValueError(f"checkpoint root {self.url!r} names no bucket: use "
                             f"s3://bucket/prefix")
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self.is_local = isinstance(self.fs, LocalFileSystem)

    def __getstate__(self):
        # The filesystem object is rebuilt on the other side from the URL and options.
        return {k: v for k, v in self.__dict__.items() if k != "fs"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # -- paths -----------------------------------------------------------------------------
    def path(self, rel: str = "") -> str:
        rel = rel.strip("/")
        if not rel:
            return self.root
        return f"{self.root}/{rel}" if self.root != "/" else f"/{rel}"

    def describe(self, rel: str = "") -> str:
        """The user-facing URL of ``rel``, for messages."""
        rel = rel.strip("/")
        return f"{self.url}/{rel}" if rel else self.url

    def _bucket_key(self, rel: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(self.path(rel))
        return bucket, key

    def _endpoint(self) -> str:
        opts = self.storage_options
        return (opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
                or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                or "the default AWS endpoint")

    # -- error handling --------------------------------------------------------------------
    def _translate(self, what: str, rel: str, exc: BaseException) -> BaseException | None:
        """The user-facing error for ``exc``, or None to raise ``exc`` unchanged."""
        where = self.describe(rel)
        code, _ = _error_code(exc)
        if code == "NoSuchBucket":
            bucket = self._bucket_key(rel)[0]
            return StorageUnavailableError(
                f"bucket {bucket!r} does not exist (while trying to {what} {where} at "
                f"{self._endpoint()}). Create the bucket or fix the checkpoint URL.")
        if isinstance(exc, (FileNotFoundError, FileExistsError, IsADirectoryError,
                            NotADirectoryError)):
            return None
        if self.is_local and isinstance(exc, PermissionError):
            return StorageUnavailableError(
                f"permission denied to {what} {where}: {exc}. Check the file permissions of "
                f"the checkpoint folder.")
        if isinstance(exc, PermissionError) or _is_credentials_error(exc):
            return StorageUnavailableError(
                f"access denied to {what} {where} at {self._endpoint()}: "
                f"{type(exc).__name__}: {exc}. Check the credentials (AWS_ACCESS_KEY_ID/"
                f"AWS_SECRET_ACCESS_KEY, a profile, or key/secret in storage_options) and "
                f"that they may access this bucket.")
        if is_transient_error(exc):
            return StorageUnavailableError(
                f"storage unreachable: could not {what} {where} after {self.retry.attempts} "
                f"attempt(s): {type(exc).__name__}: {exc}. Check the endpoint "
                f"({self._endpoint() if self.is_s3 else 'the mount'}), the network, and that "
                f"the service is up.")
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
        p = self.path(rel)

        def _exists():
            try:
                self.fs.info(p)
                return True
            except FileNotFoundError as exc:
                if _error_code(exc)[0] == "NoSuchBucket":
                    raise
                return False
        return self._wrap("check", rel, _exists)

    def size(self, rel: str) -> int:
        if self.is_local:
            def _size_local() -> int:
                fd = self._open_local_read(rel)
                try:
                    return os.fstat(fd).st_size
                finally:
                    os.close(fd)
            return self._wrap("stat", rel, _size_local)
        return int(self._wrap("stat", rel, lambda: self.fs.size(self.path(rel))))

    def read_bytes(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``rel`` (the whole object when both are None)."""
        p = self.path(rel)
        if start is not None and end is not None and end <= start:
            return b""
        if self.is_local:
            return self._wrap("read", rel, lambda: self._read_local(rel, start, end))
        if start is None and end is None:
            return self._wrap("read", rel, lambda: self.fs.cat_file(p))
        return self._wrap("read", rel, lambda: self.fs.cat_file(p, start=start, end=end))

    # -- local files: no link is followed ------------------------------------------------------
    def _check_inside_root(self, rel: str) -> None:
        """Refuse ``rel`` when its folder resolves outside the root (a linked folder)."""
        root = os.path.realpath(self.root)
        folder = os.path.realpath(os.path.dirname(self.path(rel)))
        if folder != root and not folder.startswith(root.rstrip(os.sep) + os.sep):
            where = self.describe(rel)
            raise CorruptCheckpointError(
                f"{where} lies outside the checkpoint root {self.url} (its folder is a "
                f"symbolic link to {folder}); ckpt does not follow links out of a root. "
                f"Replace the link with the folder itself or delete it.", path=where)

    def _open_local_read(self, rel: str) -> int:
        self._check_inside_root(rel)
        try:
            return os.open(self.path(rel), os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            where = self.describe(rel)
            raise CorruptCheckpointError(
                f"{where} is a symbolic link; ckpt never reads through links in a checkpoint "
                f"root (it could lead anywhere). Replace it with the file itself or delete it.",
                path=where) from None

    def open_local(self, rel: str):
        """An unbuffered binary file object reading local file ``rel``, never through a
        link (``CorruptCheckpointError`` naming it). For readers that fill tensors in place."""
        if not self.is_local:
            raise ValueError(f"{self.describe(rel)} is not on a local file system")
        return os.fdopen(self._guard("open", rel, lambda: self._open_local_read(rel)), "rb",
                         buffering=0)

    def _read_local(self, rel: str, start: int | None, end: int | None) -> bytes:
        fd = self._open_local_read(rel)
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            lo = 0 if start is None else (max(0, size + start) if start < 0 else start)
            hi = size if end is None else (max(0, size + end) if end < 0 else min(end, size))
            if hi <= lo:
                return b""
            f.seek(lo)
            return f.read(hi - lo)

    def _write_local(self, rel: str, views: Sequence[Any], durable: bool) -> None:
        """Write a fresh temporary file next to ``rel`` and rename it over ``rel``."""
        self._check_inside_root(rel)
        p = self.path(rel)
        tmp = f"{p}.tmp-{uuid.uuid4().hex[:12]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC,
                     0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                for view in views:
                    f.write(view)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, p)
            if durable:
                _fsync_dir(os.path.dirname(p))  # the new name must survive a crash too
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def listdir(self, rel: str = "") -> list[tuple[str, str, int]]:
        """Entries directly under ``rel`` as ``(name, "file"|"directory", size)``; [] if absent."""
        p = self.path(rel)

        def _ls():
            try:
                entries = self.fs.ls(p, detail=True)
            except FileNotFoundError as exc:
                if _error_code(exc)[0] == "NoSuchBucket":
                    raise
                return []
            out = []
            for e in entries:
                name = e["name"].rstrip("/").rsplit("/", 1)[-1]
                if e["name"].rstrip("/") == p.rstrip("/"):
                    continue
                kind = "directory" if e.get("type") == "directory" else "file"
                # A folder's own size (4096 on local disks) is not data: report 0 everywhere.
                out.append((name, kind, int(e.get("size") or 0) if kind == "file" else 0))
            return out

        return self._wrap("list", rel, _ls)

    # -- writes ----------------------------------------------------------------------------
    def makedirs(self, rel: str) -> None:
        if self.is_s3:
            return  # prefixes need no creation
        self._wrap("create folder", rel, lambda: self.fs.makedirs(self.path(rel), exist_ok=True))

    def write_buffers(self, rel: str, buffers: Sequence[Any], *, durable: bool = True,
                      part_bytes: int = 32 << 20, max_concurrency: int = 8) -> None:
        """Write the concatenation of ``buffers`` (bytes-like, numpy arrays included) to ``rel``.

        Local files are fsync'd when ``durable``. On S3 an object larger than ``part_bytes``
        goes up as a parallel multipart upload of ``part_bytes`` parts (at least 5 MiB; larger
        if needed to stay within 10,000 parts), ``max_concurrency`` at a time; it appears only
        when the upload completes, and a failed upload is aborted. Buffers are never joined:
        each request body reads zero-copy slices of them, so the extra host memory is a few
        small read chunks per request in flight.
        """
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        views = [_byte_view(b) for b in buffers]
        p = self.path(rel)
        if self.is_local:
            self._wrap("write", rel, lambda: self._write_local(rel, views, durable))
            return
        if self.is_s3:
            total = sum(v.nbytes for v in views)
            part_bytes = max(part_bytes, MIN_PART_BYTES, -(-total // MAX_PARTS))
            if total <= part_bytes:
                bucket, key = self._bucket_key(rel)
                self._wrap("upload", rel, lambda: self.fs.call_s3(
                    "put_object", Bucket=bucket, Key=key, Body=_SegmentsReader(views)))
            else:
                self._guard("upload", rel, lambda: fsspec.asyn.sync(
                    self.fs.loop, self._multipart_upload, rel, _split_parts(views, part_bytes),
                    total, max_concurrency))
            return

        def _write_other():
            with self.fs.open(p, "wb") as f:
                for view in views:
                    f.write(view)
        self._wrap("write", rel, _write_other)

    async def _multipart_upload(self, rel: str, parts: list[list[memoryview]], total: int,
                                max_concurrency: int) -> None:
        """Create, upload ``parts`` (at most ``max_concurrency`` at once), complete; abort on
        any failure so no orphan parts remain. Each request is retried on its own."""
        bucket, key = self._bucket_key(rel)
        what = f"upload {self.describe(rel)}"
        call = self.fs._call_s3
        mpu = await self.retry.acall(f"{what} (create multipart upload)", lambda: call(
            "create_multipart_upload", Bucket=bucket, Key=key))
        upload_id = mpu["UploadId"]
        etags: list[str | None] = [None] * len(parts)
        gate = asyncio.Semaphore(max_concurrency)

        async def upload(i: int) -> None:
            async with gate:
                out = await self.retry.acall(f"{what} part {i + 1}/{len(parts)}", lambda: call(
                    "upload_part", Bucket=bucket, Key=key, UploadId=upload_id,
                    PartNumber=i + 1, Body=_SegmentsReader(parts[i])))
                etags[i] = out["ETag"]

        tasks = [asyncio.ensure_future(upload(i)) for i in range(len(parts))]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()
            num_complete_calls = 0

            async def complete():
                nonlocal num_complete_calls
                num_complete_calls += 1
                try:
                    return await call("complete_multipart_upload", Bucket=bucket, Key=key,
                                      UploadId=upload_id, MultipartUpload={"Parts": [
                                          {"PartNumber": i + 1, "ETag": e}
                                          for i, e in enumerate(etags)]})
                except Exception as exc:
                    # A retried complete whose first try landed finds the upload gone.
                    if num_complete_calls > 1 and _error_code(exc)[0] == "NoSuchUpload":
                        head = await call("head_object", Bucket=bucket, Key=key)
                        if int(head.get("ContentLength", -1)) == total:
                            return None
                    raise

            await self.retry.acall(f"{what} (complete multipart upload)", complete)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:
                await self.retry.acall(f"{what} (abort multipart upload)", lambda: call(
                    "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id))
            except Exception as exc:  # noqa: BLE001 - the upload's own error matters more
                log.warning("could not abort the multipart upload of %s (id %s): %s; a "
                            "bucket lifecycle rule for incomplete uploads will remove its "
                            "parts", self.describe(rel), upload_id, exc)
            raise

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
        p = self.path(rel)

        def refused(cause: BaseException | None = None) -> None:
            if self._read_or_none(p) == data:
                return  # ours already
            raise FileExistsError(errno.EEXIST,
                                  f"{self.describe(rel)} already exists") from cause

        if self.is_local:
            def _create():
                self._check_inside_root(rel)
                if not self._create_local(p, data):
                    refused()
        elif self.is_s3:
            bucket, key = self._bucket_key(rel)

            def _create():
                try:
                    self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data,
                                    IfNoneMatch="*")
                except Exception as exc:  # noqa: BLE001
                    if not _is_precondition_failed(exc):
                        raise
                    refused(exc)
        else:
            def _create():
                with _MEMORY_LOCK:
                    if self.fs.exists(p):
                        refused()
                    else:
                        self.fs.pipe_file(p, data)
        self._wrap("commit", rel, _create)

    def _read_or_none(self, p: str) -> bytes | None:
        try:
            if self.is_local:
                fd = os.open(p, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
                with os.fdopen(fd, "rb") as f:
                    return f.read()
            return self.fs.cat_file(p)
        except Exception:  # noqa: BLE001 - only used to recognise our own earlier write
            return None

    @staticmethod
    def _create_local(p: str, data: bytes) -> bool:
        """Link a fsync'd temporary file into place; False if ``p`` already exists."""
        tmp = f"{p}.tmp-{uuid.uuid4().hex[:12]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC,
                     0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, p)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            # A filesystem without hard links: O_EXCL still makes the create exclusive.
            try:
                fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        finally:
            os.unlink(tmp)
        _fsync_dir(os.path.dirname(p))
        return True

    def replace_if_unchanged(self, rel: str, data: bytes, expected: bytes) -> bool:
        """Overwrite ``rel`` with ``data`` only if it still holds ``expected``.

        Returns False when it is absent or someone else changed it first. Used by the lease's
        heartbeat and take-over. As for :meth:`create_exclusive`, finding exactly ``data``
        there (our own write whose answer was lost) counts as success. S3 reads the object
        with its ETag and writes with ``If-Match`` on that ETag. Local files swap under a short-lived lock folder
        (``mkdir`` is atomic, also on NFS) with ``os.replace``, so the file never disappears
        and an exclusive create cannot slip in between.
        """
        p = self.path(rel)
        if self.is_local:
            def _replace():
                self._check_inside_root(rel)
                return self._replace_local(p, data, expected)
            return self._wrap("replace", rel, _replace)
        if self.is_s3:
            bucket, key = self._bucket_key(rel)

            def _cas() -> bool:
                try:
                    etag, current = fsspec.asyn.sync(self.fs.loop, self._get_with_etag,
                                                     bucket, key)
                except FileNotFoundError as exc:
                    if _error_code(exc)[0] == "NoSuchBucket":
                        raise
                    return False
                if current != expected:
                    # A retry after a PUT whose answer was lost finds our own data.
                    return current == data
                try:
                    self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data,
                                    IfMatch=etag)
                except Exception as exc:  # noqa: BLE001
                    if _is_precondition_failed(exc) or isinstance(exc, FileNotFoundError):
                        return self._read_or_none(p) == data
                    raise
                return True
            return self._wrap("replace", rel, _cas)

        def _replace_other() -> bool:
            with _MEMORY_LOCK:
                if not self.fs.exists(p) or self.fs.cat_file(p) != expected:
                    return False
                self.fs.pipe_file(p, data)
                return True
        return self._wrap("replace", rel, _replace_other)

    async def _get_with_etag(self, bucket: str, key: str) -> tuple[str, bytes]:
        resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
        body = resp["Body"]
        try:
            data = await body.read()
        finally:
            body.close()
        return resp["ETag"], data

    @staticmethod
    def _replace_local(p: str, data: bytes, expected: bytes, lock_timeout: float = 10.0) -> bool:
        lock = f"{p}.swap-lock"
        deadline = time.monotonic() + lock_timeout
        while True:
            try:
                os.mkdir(lock)
                break
            except FileExistsError:
                if time.monotonic() > deadline:
                    # Held far longer than a swap takes: its owner died mid-swap.
                    log.warning("breaking stale lock %s", lock)
                    try:
                        os.rmdir(lock)
                    except FileNotFoundError:
                        pass
                    deadline = time.monotonic() + lock_timeout
                time.sleep(0.005)
        try:
            try:
                # Never through a link: a planted one reads as "someone else changed it".
                fd = os.open(p, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
                with os.fdopen(fd, "rb") as f:
                    if f.read() != expected:
                        return False
            except FileNotFoundError:
                return False
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    return False
                raise
            tmp = f"{p}.tmp-{uuid.uuid4().hex[:12]}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW
                             | _O_CLOEXEC, 0o644)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, p)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            _fsync_dir(os.path.dirname(p))
            return True
        finally:
            try:
                os.rmdir(lock)
            except FileNotFoundError:
                pass

    def delete(self, rel: str, recursive: bool = False) -> None:
        """Delete ``rel`` (a folder/prefix with ``recursive``); absent is not an error."""
        p = self.path(rel)

        def _rm():
            try:
                self.fs.rm(p, recursive=recursive)
            except FileNotFoundError as exc:
                if _error_code(exc)[0] == "NoSuchBucket":
                    raise
        self._wrap("delete", rel, _rm)

    def rename(self, src: str, dst: str) -> None:
        """Rename within the root (atomic on local disk; a copy and a delete on S3)."""
        self._wrap("rename", src, lambda: self.fs.mv(self.path(src), self.path(dst)))


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
