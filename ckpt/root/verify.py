"""Verification of a checkpoint's files against its manifest: sizes, then CRC32C.

Used by the read side (:class:`ckpt.root.store.CheckpointStore`) and by the life-cycle
before it re-commits a rolled-back version (:meth:`ckpt.root.lifecycle.Lifecycle.restore`).
"""

from __future__ import annotations

from typing import Callable

from ckpt.errors import crc_mismatch_error, missing_file_error, size_mismatch_error
from ckpt.format import Manifest, crc32c_of, step_dirname
from ckpt.storage import Storage

__all__ = ["verify_files", "VERIFY_BLOCK_BYTES"]

VERIFY_BLOCK_BYTES = 64 << 20
"""Bytes read per request while checksumming a file."""


def verify_files(storage: Storage, manifest: Manifest, *, full: bool = True,
                 progress: Callable[[int, int], None] | None = None) -> None:
    """Check every file of ``manifest``: present, of its size, and (``full``) of its CRC32C;
    raise the first error, naming the file. ``progress(done, total)``: bytes when ``full``,
    files otherwise."""
    d = step_dirname(manifest.step)
    sizes = {name: size for name, kind, size in storage.listdir(d) if kind == "file"}
    total = manifest.total_bytes if full else len(manifest.files)
    done = 0
    for name, rec in sorted(manifest.files.items()):
        rel = f"{d}/{name}"
        where = storage.describe(rel)
        if name not in sizes:
            raise missing_file_error(where)
        if sizes[name] != rec.size:
            raise size_mismatch_error(where, rec.size, sizes[name])
        if not full:
            done += 1
            if progress:
                progress(done, total)
            continue
        crc, offset = 0, 0
        while offset < rec.size:
            end = min(rec.size, offset + VERIFY_BLOCK_BYTES)
            block = storage.read_bytes(rel, offset, end)
            crc = crc32c_of([block], crc)
            offset = end
            done += len(block)
            if progress:
                progress(done, total)
        if crc != rec.crc32c:
            raise crc_mismatch_error(where, rec.crc32c, crc)
