"""A part (format version 2): the chunks of sharded tensors one rank wrote, and the chunks
it holds that another rank wrote.

A checkpoint's root manifest stays small (what is O(keys) or O(ranks)); the per-chunk
entries of sharded tensors, O(ranks x keys), live in one part per rank, written by that rank
in parallel before the commit and listed in the root with its SHA-256. A loading rank reads
the root, its own part and the parts its ``refs`` name; resharding, export and ``ckpt
verify`` read them all (:func:`complete_manifest`). See docs/format.md, *Parts*.

Encoding, chosen by measurement (``bench/bench_parts.py``; docs/performance.md): compact
JSON with one array per chunk, ``[offsets, sizes, file index, offset, length, crc32c]``, is
44% smaller than one object per chunk and parses in 0.6-0.8 of its time. A binary table
parses in a fifth of that, but checking each chunk against its tensor and its file costs
two to three times the JSON parse: parsing does not dominate, so the part stays strict
JSON, read by the same parser as every other file.

Nothing here reads storage; :mod:`ckpt.root.parts` does.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterable

from ckpt.errors import CorruptCheckpointError
from ckpt.format import jsonio
from ckpt.format._check import check_digest, sealed_bytes
from ckpt.format._items import (
    box_problem,
    check_items_disjoint,
    fail,
    is_int,
    itemsize,
    location_problem,
)
from ckpt.format._schema import FORMAT_VERSION, PART_FORMAT_NAME, ItemLocation
from ckpt.format.coverage import coverage_problem
from ckpt.format.manifest import Manifest

__all__ = ["Part", "PART_DIGEST_KEY", "MAX_PART_BYTES", "part_sha256", "merge_chunks",
           "complete_manifest"]

PART_DIGEST_KEY = "part_sha256"
MAX_PART_BYTES = 64 << 20
"""The largest part readers read (the JSON rules' limit); writers refuse to write more."""
_MAX_CRC = (1 << 32) - 1


def _refuse(source: str, what: str) -> None:
    fail(source, what, "part")


def part_sha256(data: bytes) -> str:
    """The SHA-256 the root manifest records for a part's bytes."""
    return hashlib.sha256(data).hexdigest()


@dataclass
class Part:
    """One rank's part. ``chunks``: key -> chunks this rank wrote (``{"offsets", "sizes",
    "location"}`` as in a manifest's tensors, plus ``"part"``: the part's name, once read);
    ``refs``: key -> ``(offsets, writer rank)`` of chunks this rank holds but another rank
    wrote."""

    rank: int
    chunks: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    refs: dict[str, list[tuple[list[int], int]]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.chunks or self.refs)

    def to_json_bytes(self, step: int, save_id: str) -> bytes:
        files: dict[str, int] = {}
        rows: dict[str, list] = {}
        for key, chunks in self.chunks.items():
            rows[key] = [[list(c["offsets"]), list(c["sizes"]),
                          files.setdefault(c["location"].file, len(files)),
                          c["location"].offset, c["location"].length, c["location"].crc32c]
                         for c in chunks]
        doc = {"format": PART_FORMAT_NAME, "format_version": FORMAT_VERSION, "step": step,
               "save_id": save_id, "rank": self.rank, "files": list(files), "chunks": rows,
               "refs": {key: [[list(offs), writer] for offs, writer in refs]
                        for key, refs in self.refs.items()}}
        data = sealed_bytes(doc, PART_DIGEST_KEY, compact=True)
        if len(data) > MAX_PART_BYTES:  # never commit what readers refuse
            raise ValueError(
                f"cannot write the part of rank {self.rank} of step {step}: {len(data)} bytes, "
                f"more than the {MAX_PART_BYTES} readers accept ({sum(map(len, rows.values()))} "
                f"chunks); save fewer, larger chunks per rank")
        return data

    @classmethod
    def from_json_bytes(cls, data: bytes, source: str, root: Manifest, name: str) -> "Part":
        """Check ``data`` (the bytes of part ``name``, read from ``source``) against the
        root manifest that lists it, then parse and validate it.

        The SHA-256 the root records is compared before anything is parsed; every chunk must
        belong to a sharded tensor of the root, lie inside it and inside a file of this
        rank, and no two items may share bytes. Every problem raises
        ``CorruptCheckpointError`` naming ``source``.
        """
        record = root.parts.get(name)
        if record is None:
            raise CorruptCheckpointError(
                f"{source}: not a part of this checkpoint (its manifest lists no part "
                f"{name!r}); load an earlier step", path=source)
        actual = part_sha256(data)
        if actual != record.sha256:
            raise CorruptCheckpointError(
                f"{source}: part is damaged or was replaced: its SHA-256 is {actual}, the "
                f"manifest says {record.sha256}; load an earlier step", path=source,
                expected=record.sha256, actual=actual)
        check_digest(data, source, PART_DIGEST_KEY, "part")
        try:
            doc = jsonio.loads(data, source)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"part is damaged: {exc}", path=source) from None
        return _parse(doc, source, root, name, record.rank)


def _parse(doc: Any, source: str, root: Manifest, name: str, rank: int) -> Part:
    def need(cond: bool, what: str) -> None:
        if not cond:
            _refuse(source, what)

    need(type(doc) is dict and doc.get("format") == PART_FORMAT_NAME,
         f"not a ckpt part (format {str(doc.get('format') if type(doc) is dict else doc)[:80]!r})")
    need(is_int(doc.get("format_version"), 2) and doc["format_version"] <= FORMAT_VERSION,
         f"format_version {str(doc.get('format_version'))[:40]} is not one this ckpt reads "
         f"(2 to {FORMAT_VERSION})")
    need(doc.get("step") == root.step and doc.get("save_id") == root.save_id
         and doc.get("rank") == rank,
         f"part of step {str(doc.get('step'))[:40]}, save id {str(doc.get('save_id'))[:40]!r}, "
         f"rank {str(doc.get('rank'))[:40]} does not belong here (step {root.step}, save id "
         f"{root.save_id!r}, rank {rank})")
    names = doc.get("files")
    attached = {a.file for a in root.attachments.values()}
    need(type(names) is list and len(set(map(str, names))) == len(names) and all(
        type(n) is str and n in root.files and root.files[n].rank == rank
        and n not in root.parts and n not in attached for n in names),
         f"'files' must list distinct data files of rank {rank} that the manifest lists")
    raw_chunks, raw_refs = doc.get("chunks"), doc.get("refs")
    need(type(raw_chunks) is dict and type(raw_refs) is dict, "'chunks' and 'refs' must be objects")
    chunks: dict[str, list[dict[str, Any]]] = {}
    items: list[tuple[str, int, int, Any]] = []
    files = root.files
    for key, rows in raw_chunks.items():
        t = root.tensors.get(key)
        where = f"chunks[{key[:200]!r}]"
        need(t is not None and t["sharded"] and type(rows) is list,
             f"{where}: not a sharded tensor of the manifest (or not a list)")
        shape = t["shape"]
        item_bytes = itemsize(t["dtype"], source)
        out = []
        for i, row in enumerate(rows):
            if type(row) is not list or len(row) != 6:
                _refuse(source, f"{where}[{i}] must be [offsets, sizes, file, offset, length, "
                             f"crc32c]")
            offs, sizes, fi, off, length, crc = row
            if type(fi) is not int or not 0 <= fi < len(names):
                _refuse(source, f"{where}[{i}]: file index {str(fi)[:40]} is not in 'files'")
            problem = box_problem(offs, sizes, shape) or \
                location_problem(names[fi], off, length, files)
            if problem is None:
                numel = 1
                for s in sizes:
                    numel *= s
                if length != numel * item_bytes:
                    problem = f" length {length} != {numel} elements x {item_bytes} bytes"
                elif type(crc) is not int or not 0 <= crc <= _MAX_CRC:
                    problem = " crc32c must be an int in [0, 2**32)"
            if problem is not None:
                _refuse(source, f"{where}[{i}]{problem}")
            loc = ItemLocation(names[fi], off, length, crc)
            out.append({"offsets": offs, "sizes": sizes, "location": loc, "part": name})
            items.append((loc.file, off, length, (key, i)))
        chunks[key] = out
    ranks = {r.rank for r in root.parts.values()}
    refs: dict[str, list[tuple[list[int], int]]] = {}
    for key, rows in raw_refs.items():
        t = root.tensors.get(key)
        where = f"refs[{key[:200]!r}]"
        need(t is not None and t["sharded"] and type(rows) is list,
             f"{where}: not a sharded tensor of the manifest (or not a list)")
        shape = t["shape"]
        out_refs = []
        for i, row in enumerate(rows):
            ok = type(row) is list and len(row) == 2 and type(row[0]) is list \
                and len(row[0]) == len(shape) and row[1] in ranks and row[1] != rank \
                and type(row[1]) is int
            ok = ok and all(type(o) is int and 0 <= o <= d for o, d in zip(row[0], shape))
            need(ok, f"{where}[{i}] must be [offsets, writer rank] naming another rank's part")
            out_refs.append((row[0], row[1]))
        refs[key] = out_refs
    check_items_disjoint(items, lambda ref: f"chunks[{ref[0][:200]!r}][{ref[1]}]", source)
    return Part(rank, chunks, refs)


def merge_chunks(root: Manifest, parts: Iterable[tuple[str, Part]], source: str
                 ) -> dict[str, list[dict[str, Any]]]:
    """Every chunk the root and ``parts`` (``(name, part)`` pairs, as read) list, by key.
    Refuses (``CorruptCheckpointError`` naming ``source``) a chunk listed twice and two
    items that share bytes of a file."""
    out = {fqn: t["chunks"] for fqn, t in root.tensors.items()}
    parts = [(name, part) for name, part in parts if part.chunks]
    if not parts:
        return out
    items: list[tuple[str, int, int, Any]] = [
        (c["location"].file, c["location"].offset, c["location"].length, (fqn, None))
        for fqn, chunks in out.items() for c in chunks]
    items += [(loc.file, loc.offset, loc.length, (fqn, None)) for fqn, loc in root.objects.items()]
    keys = {key for _, part in parts for key in part.chunks}
    for key in keys:
        listed = out[key] = list(out[key])
        for _, part in parts:
            listed.extend(part.chunks.get(key, ()))
        if len({tuple(c["offsets"]) for c in listed}) != len(listed):
            seen: dict[tuple, str] = {}
            for c in listed:
                where = c.get("part", "the manifest")
                offs = tuple(c["offsets"])
                if offs in seen:
                    _refuse(source, f"chunk {list(offs)} of {key[:200]!r} is listed twice (in "
                                 f"{seen[offs]} and {where})")
                seen[offs] = where
        items += [(c["location"].file, c["location"].offset, c["location"].length,
                   (key, c.get("part"))) for c in listed if "part" in c]
    check_items_disjoint(items, lambda ref: f"an item of {ref[0][:200]!r}"
                         + (f" in {ref[1]}" if ref[1] else ""), source)
    return out


def complete_manifest(root: Manifest, parts: dict[str, Part], source: str) -> Manifest:
    """``root`` with every chunk of every part merged into its tensors: the whole checkpoint,
    checked as a version 1 manifest is (every tensor tiled exactly, no item sharing bytes),
    and every ``ref`` of a part naming a chunk its writer's part holds. A root with a
    ``span`` (one node's share) is its whole share: its sharded tensors' chunks lie inside
    them and never overlap, but may leave the other nodes' shares uncovered."""
    missing = sorted(set(root.parts) - set(parts))
    if missing:
        raise ValueError(f"complete_manifest needs every part; missing {missing[:3]}")
    chunks = merge_chunks(root, sorted(parts.items()), source)
    tensors = {}
    for fqn, t in root.tensors.items():
        listed = chunks[fqn]
        if t["sharded"]:
            problem = coverage_problem(
                t["shape"], [(c["offsets"], c["sizes"]) for c in listed],
                where=f"tensors[{fqn[:200]!r}]",
                name=lambda i: f"chunks[{i}] (from {listed[i].get('part', 'the manifest')})",
                partial=root.span is not None)
            if problem is not None:
                _refuse(source, problem)
        tensors[fqn] = {**t, "chunks": listed}
    held = {(part.rank, key, tuple(c["offsets"])) for part in parts.values()
            for key, listed in part.chunks.items() for c in listed}
    for name, part in parts.items():
        for key, refs in part.refs.items():
            for offs, writer in refs:
                if (writer, key, tuple(offs)) not in held:
                    _refuse(source, f"part {name!r} refers to chunk {offs} of {key[:200]!r} in "
                                 f"the part of rank {writer}, which does not hold it")
    return dataclasses.replace(root, tensors=tensors, complete=True)

