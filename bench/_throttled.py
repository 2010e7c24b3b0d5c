"""A slow store for benchmarks: local disk behind a bandwidth limit, as an fsspec filesystem.

``register(bytes_per_second)`` makes ``throttled:///abs/path`` a root whose reads and writes
each go through a token bucket of that rate (per process, so per node when each process is
one): a file of ``n`` bytes takes at least ``n / rate`` seconds to read or to write, after the
bytes before it. Everything else (listing, sizes, deletes) is the local file system's, at
its speed. ``ckpt.storage`` opens it with its generic fsspec backend, like any filesystem
that is not local disk or S3 (``memory://`` in the tests): the same code path a network
store takes. Used by ``bench_copies.py`` as the durable tier.

``register(rate, shared=PATH)``: the reads of every process that registers the same
``PATH`` share one bucket (a file holding when it is next free, under an exclusive
``flock``): the store's own bandwidth, which every reader of a job shares, rather than each
reader's link. ``bench_coop_load.py`` reads so.
"""

from __future__ import annotations

import fcntl
import io
import os
import struct
import threading
import time

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

__all__ = ["register", "PROTOCOL"]

PROTOCOL = "throttled"


class _Bucket:
    """Bytes at ``rate`` per second, one after the other."""

    def __init__(self, rate: float):
        self.rate, self._free, self._lock = float(rate), 0.0, threading.Lock()

    def take(self, nbytes: int) -> None:
        with self._lock:
            start = max(time.monotonic(), self._free)
            self._free = start + nbytes / self.rate
            until = self._free
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class _SharedBucket:
    """A :class:`_Bucket` shared by processes: its next free time (``time.monotonic``, the
    same clock in every process of a host) lives in ``path``, updated under ``flock``."""

    def __init__(self, rate: float, path: str):
        self.rate, self.path = float(rate), path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        os.close(fd)

    def take(self, nbytes: int) -> None:
        fd = os.open(self.path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, 8, 0)
            free = struct.unpack("d", raw)[0] if len(raw) == 8 else 0.0
            until = max(time.monotonic(), free) + nbytes / self.rate
            os.pwrite(fd, struct.pack("d", until), 0)
        finally:
            os.close(fd)  # releases the lock
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay)


_READS = _WRITES = _Bucket(1.0)


class _Writer(io.RawIOBase):
    def __init__(self, f):
        self._f = f

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        n = self._f.write(b)
        _WRITES.take(n)
        return n

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()


class ThrottledFileSystem(AbstractFileSystem):
    """Local files at a limited bandwidth (module docstring)."""

    protocol = PROTOCOL
    root_marker = "/"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.local = LocalFileSystem()

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3:]
        return path.rstrip("/") or "/"

    def ls(self, path, detail=True, **kwargs):
        return self.local.ls(path, detail=detail, **kwargs)

    def info(self, path, **kwargs):
        return self.local.info(path, **kwargs)

    def makedirs(self, path, exist_ok=False):
        self.local.makedirs(path, exist_ok=exist_ok)

    def mkdir(self, path, create_parents=True, **kwargs):
        self.local.mkdir(path, create_parents=create_parents, **kwargs)

    def rmdir(self, path):
        self.local.rmdir(path)

    def rm(self, path, recursive=False, maxdepth=None):
        self.local.rm(path, recursive=recursive, maxdepth=maxdepth)

    def rm_file(self, path):
        self.local.rm_file(path)

    def cat_file(self, path, start=None, end=None, **kwargs):
        data = self.local.cat_file(path, start=start, end=end)
        _READS.take(len(data))
        return data

    def pipe_file(self, path, value, **kwargs):
        _WRITES.take(len(value))
        self.local.pipe_file(path, value)

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode:
            return _Writer(self.local.open(path, mode))
        data = self.cat_file(path)
        return io.BytesIO(data)


def register(bytes_per_second: float, shared: str | None = None) -> None:
    """Make ``throttled://`` roots available in this process, at ``bytes_per_second`` for
    reads and, separately, for writes. ``shared``: a file through which every process
    registered with it shares one read bucket (the module docstring)."""
    global _READS, _WRITES
    _READS = _Bucket(bytes_per_second) if shared is None else \
        _SharedBucket(bytes_per_second, shared)
    _WRITES = _Bucket(bytes_per_second)
    fsspec.register_implementation(PROTOCOL, ThrottledFileSystem, clobber=True)
