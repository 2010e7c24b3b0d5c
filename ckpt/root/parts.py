"""Reading a checkpoint's parts (format version 2) from storage.

A root manifest lists each part with its size (in ``files``) and SHA-256 (in ``parts``);
a part is read whole, at most ``MAX_PART_BYTES`` and never more than its recorded size (a
larger file is refused before it is read), checked against both before it is parsed
(:meth:`ckpt.format.Part.from_json_bytes`) and refused, naming the file, when it is missing,
truncated, replaced or damaged. :func:`parts_for_rank` reads what one loading rank needs
(its own part and those its refs name), :func:`complete_parts` every part (resharding, export,
``ckpt verify``/``show``/``diff``), in parallel.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

from ckpt.errors import CorruptCheckpointError, missing_file_error, size_mismatch_error
from ckpt.format import (
    MAX_PART_BYTES,
    Manifest,
    Part,
    complete_manifest,
    step_dirname,
    step_file,
)
from ckpt.storage import Storage

__all__ = ["read_part", "read_parts", "parts_for_rank", "complete_parts"]


def read_part(storage: Storage, manifest: Manifest, name: str) -> Part:
    """Part ``name`` of ``manifest``: read, checked against the root, parsed, validated."""
    rel = step_file(manifest.step, name)
    where = storage.describe(rel)
    record = manifest.files.get(name)
    if record is None or name not in manifest.parts:
        raise CorruptCheckpointError(
            f"{where}: not a part of this checkpoint (its manifest lists no part {name!r}); "
            f"load an earlier step", path=where)
    if record.size > MAX_PART_BYTES:
        raise CorruptCheckpointError(
            f"{where}: the manifest says this part is {record.size} bytes, more than the "
            f"{MAX_PART_BYTES} a reader reads; the checkpoint is damaged, load an earlier "
            f"step", path=where)
    try:  # never more than the root says: a larger file is refused unread
        data = storage.read_bytes(rel, max_bytes=record.size)
    except FileNotFoundError:
        raise missing_file_error(where) from None
    if len(data) != record.size:
        raise size_mismatch_error(where, record.size, len(data))
    return Part.from_json_bytes(data, where, manifest, name)


def read_parts(storage: Storage, manifest: Manifest, names: Iterable[str], *,
               num_threads: int | None = None) -> dict[str, Part]:
    """Parts ``names`` of ``manifest``, read on up to ``num_threads`` threads (reads and
    checksums run in parallel; parsing holds the GIL)."""
    names = sorted(set(names))
    threads = min(len(names), max(1, num_threads or storage.default_threads))
    if threads <= 1:
        return {name: read_part(storage, manifest, name) for name in names}
    with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-parts") as pool:
        return dict(zip(names, pool.map(lambda n: read_part(storage, manifest, n), names)))


def parts_for_rank(storage: Storage, manifest: Manifest, rank: int, *,
                   num_threads: int | None = None) -> dict[str, Part]:
    """The parts a rank of an unchanged layout needs: its own (when it wrote one) and the
    parts of the ranks that wrote the chunks its refs name. Empty when it wrote none."""
    by_rank = {rec.rank: name for name, rec in manifest.parts.items()}
    own = by_rank.get(rank)
    if own is None:
        return {}
    parts = {own: read_part(storage, manifest, own)}
    writers = {writer for refs in parts[own].refs.values() for _, writer in refs}
    parts.update(read_parts(storage, manifest, [by_rank[w] for w in writers],
                            num_threads=num_threads))
    return parts


def complete_parts(storage: Storage, manifest: Manifest, *, num_threads: int | None = None,
                   known: dict[str, Part] | None = None) -> Manifest:
    """``manifest`` with every chunk of its parts merged in and checked as a whole
    (:func:`ckpt.format.complete_manifest`); ``manifest`` itself when it is complete.
    ``known``: parts already read (by :func:`parts_for_rank`), not read again."""
    if manifest.complete:
        return manifest
    known = dict(known or {})
    known.update(read_parts(storage, manifest, set(manifest.parts) - set(known),
                            num_threads=num_threads))
    return complete_manifest(manifest, known,
                             storage.describe(step_dirname(manifest.step)))
