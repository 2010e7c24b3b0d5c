"""What "this checkpoint is good" means: the one definition every judge of a version uses
(``ckpt verify``, ``ckpt list --check``, ``ckpt pin``, ``ckpt rollback``,
:meth:`ckpt.root.lifecycle.Lifecycle.restore`, retention, and the walk to the newest
checkpoint that every load and resume goes through: :func:`ckpt.root.store.walk_newest`).

:func:`verify_checkpoint` checks, in this order, each step before anything the next reads:

1. sizes (always): every file the manifest lists is in its folder (one listing) with the
   size the manifest records. Nothing of the version is read before: a size the manifest
   contradicts (a part or data file replaced by a large sparse file) is refused unread.
2. parts (``full``): every part read (never more than its recorded size), checked against
   its SHA-256 and every rule of the format, and the whole checked as one (every tensor
   tiled exactly, no two items sharing bytes): :func:`ckpt.root.parts.complete_parts`.
3. checksums (``full``): every file read once, in blocks of ``VERIFY_BLOCK_BYTES``: its
   CRC32C, and the CRC32C of every item in it (each chunk of a tensor, the parts' included,
   and each object), as a load checks each item it reads.

A load checks what it reads (the items' CRC32C, the parts it needs) as it reads it, and
the files no load reads (:func:`verify_attachments`: small) before it applies anything. So a version that a load or a resume takes passes
``full``, and one that fails a load fails ``full``: ``ckpt verify`` never passes what every
load refuses, and ``ckpt restore`` never re-commits what ``ckpt verify`` refuses. Memory:
one block (``VERIFY_BLOCK_BYTES``) and the parts, never a size the manifest or a file
claims.
"""

from __future__ import annotations

from typing import Callable

from ckpt.errors import crc_mismatch_error, missing_file_error, size_mismatch_error
from ckpt.format import Manifest, crc32c_of, step_dirname
from ckpt.root.parts import complete_parts
from ckpt.storage import Storage

__all__ = ["verify_checkpoint", "verify_attachments", "VERIFY_BLOCK_BYTES"]

VERIFY_BLOCK_BYTES = 64 << 20
"""Bytes read per request while checksumming a file."""


def verify_checkpoint(storage: Storage, manifest: Manifest, *, full: bool = True,
                      progress: Callable[[int, int], None] | None = None) -> Manifest:
    """Check the version ``manifest`` describes (the module's steps 1-3; sizes only unless
    ``full``) and raise the first problem, a ``CorruptCheckpointError`` naming the file.
    Returns ``manifest``, complete (every part merged in) when ``full``.
    ``progress(done, total)``: bytes when ``full``, files otherwise."""
    _check_sizes(storage, manifest, None if full else progress)
    if not full:
        return manifest
    complete = complete_parts(storage, manifest)
    _check_checksums(storage, complete, progress)
    return complete


def verify_attachments(storage: Storage, manifest: Manifest) -> None:
    """Read each attachment of ``manifest`` (at most its recorded size) and check its
    CRC32C: the files a load never reads, checked by a resume before it takes the version.
    Raises ``CorruptCheckpointError`` naming the file."""
    d = step_dirname(manifest.step)
    for name, rec in sorted(manifest.attachments.items()):
        rel = f"{d}/{rec.file}"
        where = storage.describe(rel)
        context = f"attachment {name!r}: "
        try:
            data = storage.read_bytes(rel, max_bytes=rec.size)
        except FileNotFoundError:
            raise missing_file_error(where, context) from None
        if len(data) != rec.size:
            raise size_mismatch_error(where, rec.size, len(data), context)
        crc = crc32c_of([data])
        if crc != rec.crc32c:
            raise crc_mismatch_error(where, rec.crc32c, crc, context=context)


def _check_sizes(storage: Storage, manifest: Manifest,
                 progress: Callable[[int, int], None] | None) -> None:
    d = step_dirname(manifest.step)
    sizes = {name: size for name, kind, size in storage.listdir(d) if kind == "file"}
    for done, (name, rec) in enumerate(sorted(manifest.files.items()), 1):
        where = storage.describe(f"{d}/{name}")
        if name not in sizes:
            raise missing_file_error(where)
        if sizes[name] != rec.size:
            raise size_mismatch_error(where, rec.size, sizes[name])
        if progress:
            progress(done, len(manifest.files))


def _items_by_file(manifest: Manifest) -> dict[str, list[tuple[int, int, int]]]:
    """``(offset, length, crc32c)`` of every item of a complete ``manifest``, by file,
    sorted by offset (items never share bytes: the parser and ``complete_parts`` refuse
    a version where they do)."""
    out: dict[str, list[tuple[int, int, int]]] = {}
    locations = [c["location"] for t in manifest.tensors.values() for c in t["chunks"]]
    locations += list(manifest.objects.values())
    for loc in locations:
        out.setdefault(loc.file, []).append((loc.offset, loc.length, loc.crc32c))
    for items in out.values():
        items.sort()
    return out


def _check_checksums(storage: Storage, manifest: Manifest,
                     progress: Callable[[int, int], None] | None) -> None:
    """Step 3: each file read once, its CRC32C and its items' checked as the blocks come."""
    d = step_dirname(manifest.step)
    items_of = _items_by_file(manifest)
    total, done = manifest.total_bytes, 0
    for name, rec in sorted(manifest.files.items()):
        rel = f"{d}/{name}"
        where = storage.describe(rel)
        items = items_of.get(name, [])
        k, item_crc = 0, 0  # the item being checked, and its CRC so far
        crc, offset = 0, 0
        while offset < rec.size:
            end = min(rec.size, offset + VERIFY_BLOCK_BYTES)
            block = storage.read_bytes(rel, offset, end)
            if len(block) != end - offset:  # shortened since its size was checked
                raise size_mismatch_error(where, rec.size, offset + len(block))
            crc = crc32c_of([block], crc)
            view = memoryview(block)
            while k < len(items) and items[k][0] < end:
                start, length, expected = items[k]
                lo, hi = max(start, offset), min(start + length, end)
                if hi > lo:
                    item_crc = crc32c_of([view[lo - offset:hi - offset]], item_crc)
                if start + length > end:
                    break  # goes on in the next block
                _check_item(where, start, length, expected, item_crc)
                k, item_crc = k + 1, 0
            offset = end
            done += len(block)
            if progress:
                progress(done, total)
        for start, length, expected in items[k:]:  # empty items at the file's end
            _check_item(where, start, length, expected, item_crc)
            item_crc = 0
        if crc != rec.crc32c:
            raise crc_mismatch_error(where, rec.crc32c, crc)


def _check_item(where: str, start: int, length: int, expected: int, actual: int) -> None:
    if actual != expected:
        raise crc_mismatch_error(where, expected, actual, span=(start, start + length))
