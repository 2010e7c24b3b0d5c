"""S3 (``s3://``, ``s3a://``) through s3fs: conditional writes and parallel multipart uploads.

The commit is a conditional PUT (``If-None-Match: *``); the lease's swap reads the object
with its ETag and writes with ``If-Match`` on it. An object larger than one part goes up as
a multipart upload whose parts are zero-copy slices of the caller's buffers
(:class:`SegmentsReader`), at most ``max_concurrency`` in flight, each request retried on
its own; a failed upload is aborted. s3fs's and botocore's own retry loops are off for the
filesystems made here (:func:`open_s3`), so every retry is one of ``RetryPolicy``'s.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import threading
from typing import Any, Sequence

import fsspec
import fsspec.asyn

from ckpt._retry import RetryPolicy, error_code, is_precondition_failed
from ckpt.backends.base import FsspecBackend

__all__ = ["S3Backend", "SegmentsReader", "open_s3", "split_parts", "MIN_PART_BYTES",
           "MAX_PARTS", "PROTOCOLS"]

log = logging.getLogger("ckpt.storage")
PROTOCOLS = ("s3", "s3a")
MIN_PART_BYTES = 5 << 20  # S3's smallest part (all parts but the last)
MAX_PARTS = 10_000  # S3's most parts per upload

_S3_CACHE: dict[tuple, Any] = {}
_S3_CACHE_LOCK = threading.Lock()


def open_s3(url: str, options: dict[str, Any]):
    """``(fs, root)``: an S3FileSystem for ``url`` whose own retries are off (``RetryPolicy``
    does them), and the root as ``bucket/prefix``.

    Listing caches are off too: other processes (ranks, other jobs) write under the same
    root, and a stale listing could make a committed manifest look absent. Instances are
    shared per process and per options, but never with fsspec's global instance cache, so
    a user's own S3FileSystem keeps its settings.
    """
    opts = dict(options)
    config = dict(opts.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    opts["config_kwargs"] = config
    opts.setdefault("use_listings_cache", False)
    key = (os.getpid(), fsspec.utils.tokenize(opts))
    with _S3_CACHE_LOCK:
        fs = _S3_CACHE.get(key)
        if fs is None:
            fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
            fs.retries = 1  # s3fs's per-call retry loop: one attempt, ours does the rest
            _S3_CACHE[key] = fs
    return fs, fs._strip_protocol(url)


class S3Backend(FsspecBackend):
    """Objects under ``s3://bucket/prefix``. Existence, sizes, reads, listings and deletes are
    s3fs's; writes are botocore requests made here. There are no folders."""

    is_s3 = True

    def __init__(self, url: str, fs: Any, root: str, retry: RetryPolicy,
                 options: dict[str, Any]):
        super().__init__(url, fs, root, retry)
        if not self.root.strip("/"):
            raise ValueError(f"checkpoint root {url!r} names no bucket: use "
                             f"s3://bucket/prefix")
        self.options = options

    @property
    def endpoint(self) -> str:
        opts = self.options
        return (opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
                or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                or "the default AWS endpoint")

    def _bucket_key(self, rel: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(self.path(rel))
        return bucket, key

    def makedirs(self, rel: str) -> None:
        pass  # prefixes need no creation

    def write(self, rel: str, views: Sequence[memoryview], *, durable: bool, part_bytes: int,
              max_concurrency: int) -> None:
        """One PUT up to ``part_bytes`` (raised to at least 5 MiB, and enough to stay within
        10,000 parts), else a multipart upload. Every object is durable once acknowledged."""
        total = sum(v.nbytes for v in views)
        part_bytes = max(part_bytes, MIN_PART_BYTES, -(-total // MAX_PARTS))
        if total > part_bytes:
            fsspec.asyn.sync(self.fs.loop, self._multipart_upload, rel,
                             split_parts(views, part_bytes), total, max_concurrency)
            return
        bucket, key = self._bucket_key(rel)
        self.retry.call(f"upload {self.describe(rel)}", lambda: self.fs.call_s3(
            "put_object", Bucket=bucket, Key=key, Body=SegmentsReader(views)))

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
                    PartNumber=i + 1, Body=SegmentsReader(parts[i])))
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
                    if num_complete_calls > 1 and error_code(exc)[0] == "NoSuchUpload":
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

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """A conditional PUT (``If-None-Match: *``), which is the commit itself."""
        bucket, key = self._bucket_key(rel)
        try:
            self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        except Exception as exc:  # noqa: BLE001
            if not is_precondition_failed(exc):
                raise
            return False
        return True

    def replace_if_unchanged(self, rel: str, data: bytes, expected: bytes) -> bool:
        """Read the object with its ETag, then PUT with ``If-Match`` on that ETag."""
        bucket, key = self._bucket_key(rel)
        try:
            etag, current = fsspec.asyn.sync(self.fs.loop, self._get_with_etag, bucket, key)
        except FileNotFoundError as exc:
            if error_code(exc)[0] == "NoSuchBucket":
                raise
            return False
        if current != expected:
            # A retry after a PUT whose answer was lost finds our own data.
            return current == data
        try:
            self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfMatch=etag)
        except Exception as exc:  # noqa: BLE001
            if is_precondition_failed(exc) or isinstance(exc, FileNotFoundError):
                return self.read_or_none(rel) == data
            raise
        return True

    async def _get_with_etag(self, bucket: str, key: str) -> tuple[str, bytes]:
        resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
        body = resp["Body"]
        try:
            data = await body.read()
        finally:
            body.close()
        return resp["ETag"], data


class SegmentsReader(io.RawIOBase):
    """A seekable read-only file over a list of byte views, without joining them.

    Used as an S3 request body: botocore reads it in small chunks (to checksum and to send)
    and seeks back to retry, so a part is never copied whole.
    """

    def __init__(self, segments: Sequence[memoryview]):
        super().__init__()
        self._segments = list(segments)
        self._starts = []
        total = 0
        for s in self._segments:
            self._starts.append(total)
            total += s.nbytes
        self._size = total
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def __len__(self) -> int:
        return self._size

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        n = 0
        while n < len(out) and self._pos < self._size:
            i = self._segment_at(self._pos)
            seg, local = self._segments[i], self._pos - self._starts[i]
            take = min(len(out) - n, seg.nbytes - local)
            out[n:n + take] = seg[local:local + take]
            n += take
            self._pos += take
        return n

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = self._size - self._pos
        size = max(0, min(size, self._size - self._pos))
        buf = bytearray(size)
        n = self.readinto(buf)
        return bytes(buf[:n]) if n != size else bytes(buf)

    def _segment_at(self, pos: int) -> int:
        lo, hi = 0, len(self._starts) - 1
        while lo < hi:  # the last segment starting at or before pos (skipping empty ones)
            mid = (lo + hi + 1) // 2
            if self._starts[mid] <= pos:
                lo = mid
            else:
                hi = mid - 1
        while self._segments[lo].nbytes == 0 or pos >= self._starts[lo] + self._segments[lo].nbytes:
            lo += 1
        return lo


def split_parts(views: Sequence[memoryview], part_bytes: int) -> list[list[memoryview]]:
    """Cut the concatenation of ``views`` into parts of ``part_bytes`` (the last may be
    smaller); each part is a list of zero-copy slices."""
    parts: list[list[memoryview]] = []
    current: list[memoryview] = []
    filled = 0
    for view in views:
        offset = 0
        while offset < view.nbytes:
            take = min(part_bytes - filled, view.nbytes - offset)
            current.append(view[offset:offset + take])
            filled += take
            offset += take
            if filled == part_bytes:
                parts.append(current)
                current, filled = [], 0
    if current:
        parts.append(current)
    return parts
