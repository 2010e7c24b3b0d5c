"""S3 helpers: filesystems without their own retry loops, and zero-copy multipart bodies."""

from __future__ import annotations

import io
import os
import threading
from typing import Any, Sequence

import fsspec

# -- S3 filesystems --------------------------------------------------------------------------
_S3_CACHE: dict[tuple, Any] = {}
_S3_CACHE_LOCK = threading.Lock()
_MEMORY_LOCK = threading.Lock()  # makes memory:// check-then-write atomic within the process


def _open_s3(url: str, options: dict[str, Any]):
    """An S3FileSystem for ``url`` whose own retries are off (``RetryPolicy`` does them).

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


class _SegmentsReader(io.RawIOBase):
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


def _byte_view(buf: Any) -> memoryview:
    """A flat unsigned-byte view of a bytes-like object (numpy arrays included), zero-copy
    unless it is not contiguous."""
    view = memoryview(buf)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _split_parts(views: Sequence[memoryview], part_bytes: int) -> list[list[memoryview]]:
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
