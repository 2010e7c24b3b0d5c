"""One small storage interface over fsspec: local paths, ``file://``, ``s3://``, ``memory://``.

Every backend goes through the same code; the few places where a backend needs its own
behaviour (durable local writes with fsync, exclusive creates, S3 conditional writes) are
chosen by capability, not by separate classes. Paths passed to methods are relative to the
storage root and use ``/``.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import time
import uuid
from typing import Any, Callable, Iterable, Sequence, TypeVar

import crc32c as _crc32c
import fsspec
from fsspec.implementations.local import LocalFileSystem

from ckpt.errors import StorageUnavailableError

__all__ = ["Storage", "RetryPolicy", "crc32c_of", "is_transient_error"]

log = logging.getLogger(__name__)
T = TypeVar("T")


def crc32c_of(buffers: Iterable[Any], value: int = 0) -> int:
    """CRC32C over the concatenation of ``buffers`` (bytes-like), continuing from ``value``."""
    for buf in buffers:
        value = _crc32c.crc32c(buf, value)
    return value


_TRANSIENT_NAMES = {
    "SlowDown",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "Throttling",
    "ThrottlingException",
    "503",
    "500",
}


def is_transient_error(exc: BaseException) -> bool:
    """True for errors worth retrying: timeouts, dropped connections, S3 throttling/5xx."""
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError)):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    name = type(exc).__name__
    if name in ("ClientConnectorError", "ServerDisconnectedError", "ClientOSError",
                "EndpointConnectionError", "ReadTimeoutError", "ConnectTimeoutError",
                "ServerTimeoutError", "ClientPayloadError"):
        return True
    code = getattr(exc, "response", None)
    if isinstance(code, dict):
        err = code.get("Error", {}).get("Code", "")
        status = str(code.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        return err in _TRANSIENT_NAMES or status.startswith("5")
    if isinstance(exc, OSError) and exc.errno in (errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET):
        return True
    return False


class RetryPolicy:
    """Exponential backoff with full jitter for transient storage errors."""

    def __init__(self, attempts: int = 5, base_seconds: float = 0.2, max_seconds: float = 10.0):
        if attempts < 1:
            raise ValueError("RetryPolicy.attempts must be >= 1")
        self.attempts = attempts
        self.base_seconds = base_seconds
        self.max_seconds = max_seconds
        self.num_retries = 0  # total retries performed, for events and metrics

    def call(self, what: str, fn: Callable[[], T]) -> T:
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - filtered below
                if attempt == self.attempts or not is_transient_error(exc):
                    raise
                delay = min(self.max_seconds, self.base_seconds * 2 ** (attempt - 1))
                delay = random.uniform(0, delay)
                self.num_retries += 1
                log.warning("%s failed (%s: %s); retry %d/%d in %.2fs", what,
                            type(exc).__name__, exc, attempt, self.attempts - 1, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")


class Storage:
    """A checkpoint root on any fsspec filesystem.

    ``Storage("s3://bucket/prefix", storage_options={"client_kwargs": {"endpoint_url": ...}})``
    or a plain local path. Methods take paths relative to the root. All methods are safe to
    call from several threads at once.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 retry: RetryPolicy | None = None):
        if not url:
            raise ValueError("checkpoint root is empty: give a local path or a URL such as "
                             "s3://bucket/prefix")
        self.url = str(url).rstrip("/") or "/"
        self.storage_options = dict(storage_options or {})
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        except (ImportError, ValueError) as exc:
            raise ValueError(f"cannot open checkpoint root {self.url!r}: {exc}") from exc
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.is_s3 = "s3" in (self.fs.protocol if isinstance(self.fs.protocol, tuple)
                              else (self.fs.protocol,))
        self.retry = retry or RetryPolicy()

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

    def _wrap(self, what: str, rel: str, fn: Callable[[], T]) -> T:
        try:
            return self.retry.call(f"{what} {self.describe(rel)}", fn)
        except (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError):
            raise
        except PermissionError as exc:
            raise StorageUnavailableError(
                f"permission denied for {self.describe(rel)}: {exc}. Check the credentials "
                f"(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or storage_options) and the ACLs."
            ) from exc
        except Exception as exc:
            if is_transient_error(exc) or _looks_unreachable(exc):
                raise StorageUnavailableError(
                    f"storage unreachable while trying to {what} {self.describe(rel)}: "
                    f"{type(exc).__name__}: {exc}. Check the URL, endpoint and network."
                ) from exc
            raise

    # -- reads -----------------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        return self._wrap("check", rel, lambda: self.fs.exists(self.path(rel)))

    def size(self, rel: str) -> int:
        return int(self._wrap("stat", rel, lambda: self.fs.size(self.path(rel))))

    def read_bytes(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``rel`` (the whole object when both are None)."""
        p = self.path(rel)
        if start is None and end is None:
            return self._wrap("read", rel, lambda: self.fs.cat_file(p))
        return self._wrap("read", rel, lambda: self.fs.cat_file(p, start=start, end=end))

    def listdir(self, rel: str = "") -> list[tuple[str, str, int]]:
        """Entries directly under ``rel`` as ``(name, "file"|"directory", size)``; [] if absent."""
        p = self.path(rel)

        def _ls():
            try:
                entries = self.fs.ls(p, detail=True, refresh=True) if self.is_s3 else \
                    self.fs.ls(p, detail=True)
            except FileNotFoundError:
                return []
            out = []
            for e in entries:
                name = e["name"].rstrip("/").rsplit("/", 1)[-1]
                if e["name"].rstrip("/") == p.rstrip("/"):
                    continue
                out.append((name, e.get("type", "file"), int(e.get("size") or 0)))
            return out

        return self._wrap("list", rel, _ls)

    # -- writes ----------------------------------------------------------------------------
    def makedirs(self, rel: str) -> None:
        if self.is_s3:
            return  # prefixes need no creation
        self._wrap("create folder", rel, lambda: self.fs.makedirs(self.path(rel), exist_ok=True))

    def write_buffers(self, rel: str, buffers: Sequence[Any], *, durable: bool = True,
                      part_bytes: int = 32 << 20, max_concurrency: int = 8) -> None:
        """Write the concatenation of ``buffers`` to ``rel`` (replacing any partial object).

        Local files are fsync'd when ``durable``. On S3 a large object is sent as a parallel
        multipart upload; the object appears only when the upload completes.
        """
        p = self.path(rel)
        if self.is_local:
            def _write_local():
                with open(p, "wb") as f:
                    for buf in buffers:
                        f.write(buf)
                    if durable:
                        f.flush()
                        os.fsync(f.fileno())
            self._wrap("write", rel, _write_local)
            return
        data = b"".join(bytes(b) if not isinstance(b, (bytes, bytearray)) else b for b in buffers) \
            if len(buffers) != 1 or not isinstance(buffers[0], bytes) else buffers[0]
        if self.is_s3:
            self._wrap("upload", rel, lambda: self.fs.pipe_file(
                p, data, chunksize=max(part_bytes, 5 << 20), max_concurrency=max_concurrency))
        else:
            self._wrap("write", rel, lambda: self.fs.pipe_file(p, data))

    def write_bytes(self, rel: str, data: bytes, *, durable: bool = True) -> None:
        self.write_buffers(rel, [data], durable=durable)

    def create_exclusive(self, rel: str, data: bytes) -> None:
        """Create ``rel`` with ``data`` only if it does not exist; else ``FileExistsError``.

        This is the commit primitive: local files are written to a temporary name, fsync'd,
        then hard-linked into place (``link`` fails if the target exists, unlike ``rename``);
        S3 uses a conditional PUT (``If-None-Match: *``), which is the commit itself.
        """
        p = self.path(rel)
        if self.is_local:
            tmp = f"{p}.tmp-{uuid.uuid4().hex[:12]}"

            def _commit_local():
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                try:
                    os.link(tmp, p)
                except FileExistsError:
                    raise FileExistsError(errno.EEXIST, f"{self.describe(rel)} already exists")
                finally:
                    os.unlink(tmp)
                _fsync_dir(os.path.dirname(p))

            self._wrap("commit", rel, _commit_local)
            return
        if self.is_s3:
            def _put():
                try:
                    self.fs.pipe_file(p, data, mode="create")
                except Exception as exc:  # noqa: BLE001
                    if _is_precondition_failed(exc):
                        raise FileExistsError(errno.EEXIST,
                                              f"{self.describe(rel)} already exists") from exc
                    raise
            self._wrap("commit", rel, _put)
            return
        # Other filesystems (memory://): single-process check-then-write.
        if self.fs.exists(p):
            raise FileExistsError(errno.EEXIST, f"{self.describe(rel)} already exists")
        self.fs.pipe_file(p, data)

    def replace_if_unchanged(self, rel: str, data: bytes, expected: bytes) -> bool:
        """Overwrite ``rel`` with ``data`` only if it still holds ``expected``.

        Returns False when someone else changed it first. Used by the lease's heartbeat and
        take-over. S3 uses ``If-Match`` on the ETag; local files use an exclusive rename of
        the old version out of the way, so of two racing writers only one wins.
        """
        p = self.path(rel)
        if self.is_local:
            try:
                with open(p, "rb") as f:
                    if f.read() != expected:
                        return False
            except FileNotFoundError:
                return False
            aside = f"{p}.old-{uuid.uuid4().hex[:12]}"
            try:
                os.rename(p, aside)
            except FileNotFoundError:
                return False
            try:
                with open(aside, "rb") as f:
                    if f.read() != expected:  # someone swapped it between our read and rename
                        os.rename(aside, p) if not os.path.exists(p) else os.unlink(aside)
                        return False
                self.create_exclusive(rel, data)
                return True
            except FileExistsError:
                return False
            finally:
                if os.path.exists(aside):
                    os.unlink(aside)
        if self.is_s3:
            bucket, key, _ = self.fs.split_path(p)
            try:
                head = self.fs.call_s3("head_object", Bucket=bucket, Key=key)
            except FileNotFoundError:
                return False
            if self.read_bytes(rel) != expected:
                return False
            try:
                self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data,
                                IfMatch=head["ETag"])
            except Exception as exc:  # noqa: BLE001
                if _is_precondition_failed(exc):
                    return False
                raise
            self.fs.invalidate_cache(p)
            return True
        if not self.fs.exists(p) or self.fs.cat_file(p) != expected:
            return False
        self.fs.pipe_file(p, data)
        return True

    def delete(self, rel: str, recursive: bool = False) -> None:
        p = self.path(rel)

        def _rm():
            try:
                self.fs.rm(p, recursive=recursive)
            except FileNotFoundError:
                pass
        self._wrap("delete", rel, _rm)

    def rename(self, src: str, dst: str) -> None:
        """Rename within the root (local only; atomic)."""
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


def _is_precondition_failed(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}"
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        text += " " + str(response.get("Error", {}).get("Code", ""))
    cause = exc.__cause__ or exc.__context__
    if cause is not None and cause is not exc:
        text += " " + f"{type(cause).__name__} {cause}"
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            text += " " + str(response.get("Error", {}).get("Code", ""))
    return "PreconditionFailed" in text or "412" in text or "ConditionalRequestConflict" in text


def _looks_unreachable(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}"
    return any(s in text for s in ("Could not connect", "Cannot connect", "Connection refused",
                                   "EndpointConnectionError", "NoCredentialsError",
                                   "InvalidAccessKeyId", "SignatureDoesNotMatch",
                                   "Name or service not known", "NoSuchBucket"))
