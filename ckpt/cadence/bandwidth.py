"""Storage bandwidth, measured: write then read one test object through fsspec.

``ckpt plan --measure URL`` uses it for the persist bandwidth (:mod:`ckpt.cadence.plan`).
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ckpt.storage import Storage

__all__ = ["BandwidthMeasurement", "measure_bandwidth"]


@dataclass(frozen=True)
class BandwidthMeasurement:
    """Throughput of writing then reading one test object of ``num_bytes`` at ``url``."""

    url: str
    num_bytes: int
    write_bytes_per_second: float
    read_bytes_per_second: float


def measure_bandwidth(
    url: str,
    num_bytes: int = 256 * 2**20,
    storage_options: dict[str, Any] | None = None,
    chunk_bytes: int = 8 * 2**20,
) -> BandwidthMeasurement:
    """Write ``num_bytes`` of random data to a new object under ``url``, read it back, delete it.

    Goes through ``fsspec.core.url_to_fs(url, **storage_options)``, so any fsspec URL works
    (local paths, ``file://``, ``s3://bucket/prefix``, ``memory://``). The write is timed until
    the object is closed (uploaded); on a local filesystem it is also fsync'ed and dropped from
    the page cache so both figures reflect the disk. A missing local directory is created. The
    test object is removed even if a step fails; I/O errors propagate as ``OSError``.
    """
    import fsspec

    if num_bytes < 1:
        raise ValueError(f"num_bytes={num_bytes!r} is invalid: pass a test object size >= 1 byte")
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    local = Storage(url, storage_options).local_path() is not None
    if local:
        fs.makedirs(root, exist_ok=True)
    path = f"{root.rstrip('/')}/.ckpt-plan-probe-{uuid.uuid4().hex}"
    chunk = os.urandom(min(chunk_bytes, num_bytes))
    try:
        start = time.perf_counter()
        with fs.open(path, "wb") as f:
            left = num_bytes
            while left > 0:
                f.write(chunk if left >= len(chunk) else chunk[:left])
                left -= len(chunk)
        if local:
            _sync_and_drop_cache(path)
        write_seconds = time.perf_counter() - start
        start = time.perf_counter()
        num_read = 0
        with fs.open(path, "rb") as f:
            while data := f.read(chunk_bytes):
                num_read += len(data)
        read_seconds = time.perf_counter() - start
    finally:
        try:
            fs.rm(path)
        except FileNotFoundError:
            pass
    if num_read != num_bytes:
        raise OSError(f"read back {num_read} bytes of the {num_bytes}-byte test object at {url!r}")
    return BandwidthMeasurement(url, num_bytes, num_bytes / max(write_seconds, 1e-9),
                                num_bytes / max(read_seconds, 1e-9))


def _sync_and_drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
