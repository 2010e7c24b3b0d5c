"""Checking a manifest: its digest, then every MUST of docs/format.md.

A manifest is untrusted input. :func:`read_manifest_fields` checks its digest
(``manifest_sha256``) before anything else, parses it with :mod:`ckpt.format.jsonio` and validates
every MUST of the format (types, bounds, file names, chunk coverage without gaps or
overlaps, item ranges inside their files, planner paths) before any caller allocates or
reads a byte on its word; it returns the fields of a :class:`ckpt.format.manifest.Manifest`.
:func:`manifest_bytes` writes the digest line that a reader checks.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import re
from typing import Any

import torch

from ckpt.errors import CorruptCheckpointError, FormatVersionError
from ckpt.format import jsonio
from ckpt.format._schema import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_ATTACHMENT_BYTES,
    Attachment,
    FileRecord,
    ItemLocation,
    check_attachment_name,
    dtype_from_name,
)

__all__ = [
    "DIGEST_KEY",
    "MAX_DIMS",
    "MAX_GRID_CELLS",
    "MAX_PATH_COMPONENTS",
    "manifest_bytes",
    "read_manifest_fields",
]

DIGEST_KEY = "manifest_sha256"
MAX_INT = (1 << 63) - 1  # every size, offset, length and step fits an int64
MAX_DIMS = 32
MAX_GRID_CELLS = 1 << 24  # see _check_coverage
MAX_PATH_COMPONENTS = 64
# The digest line: the first line of every manifest written since the digest exists.
_DIGEST_LINE = re.compile(rb'\{"manifest_sha256": "([0-9a-f]{64})",\n')
_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


# -- the digest ------------------------------------------------------------------------------
def manifest_bytes(doc: dict[str, Any]) -> bytes:
    """The bytes of a manifest file holding ``doc`` (any existing digest is replaced).

    The first line is ``{"manifest_sha256": "<hex>",``; the digest is the SHA-256 of every
    byte after that line's newline, so a reader checks it before parsing anything.
    """
    body = {k: v for k, v in doc.items() if k != DIGEST_KEY}
    if not body:
        raise ValueError("a manifest document needs at least one member")
    rest = jsonio.dumps(body, indent=1)
    assert rest.startswith(b"{\n"), rest[:10]
    rest = rest[2:]
    digest = hashlib.sha256(rest).hexdigest()
    return b'{"' + DIGEST_KEY.encode() + b'": "' + digest.encode() + b'",\n' + rest


def _check_digest(data: bytes, source: str) -> bool:
    """True when ``data`` carries a digest line and the digest matches; raise on mismatch;
    False for a manifest without one (written before digests existed)."""
    m = _DIGEST_LINE.match(data)
    if m is None:
        return False
    actual = hashlib.sha256(memoryview(data)[m.end():]).hexdigest()
    expected = m.group(1).decode("ascii")
    if actual != expected:
        raise CorruptCheckpointError(
            f"{source}: manifest is damaged: its content does not match its {DIGEST_KEY} "
            f"(expected {expected}, got {actual}); load an earlier step", path=source,
            expected=expected, actual=actual)
    return True


def read_manifest_fields(data: bytes, source: str) -> dict[str, Any]:
    """Check the digest, parse and validate ``data`` (the bytes of ``source``): the keyword
    arguments of a ``Manifest``.

    Every problem raises ``CorruptCheckpointError`` (``FormatVersionError`` for a newer
    format) naming ``source``.
    """
    sealed = _check_digest(data, source)
    try:
        doc = jsonio.loads(data, source)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"manifest is damaged: {exc}", path=source) from None
    if not sealed and isinstance(doc, dict) and DIGEST_KEY in doc:
        raise CorruptCheckpointError(
            f"{source}: manifest is damaged: it has a {DIGEST_KEY!r} member that is not "
            f"its first line (the file was edited or overwritten); load an earlier step",
            path=source)
    return _parse(doc, source)


# -- validation ----------------------------------------------------------------------------------
def _need(cond: bool, source: str, what: str) -> None:
    if not cond:
        raise CorruptCheckpointError(
            f"{source}: invalid manifest: {what}; the checkpoint is damaged or was not written "
            f"by ckpt. Load an earlier step.", path=source)


def _is_int(v: Any, minimum: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and minimum <= v <= MAX_INT


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _parse_crc(v: Any, source: str, where: str) -> int:
    _need(isinstance(v, str) and re.fullmatch(r"[0-9a-f]{8}", v) is not None, source,
          f"{where}.crc32c must be 8 hex digits")
    return int(v, 16)


def _parse_location(d: Any, files: dict[str, FileRecord], source: str, where: str) -> ItemLocation:
    _need(isinstance(d, dict), source, f"{where} must be an object")
    name = d.get("file")
    _need(isinstance(name, str) and name in files, source,
          f"{where}.file {str(name)[:100]!r} is not listed in 'files'")
    off, length = d.get("offset"), d.get("length")
    _need(_is_int(off) and _is_int(length), source,
          f"{where} offset/length must be ints in [0, 2**63)")
    _need(off + length <= files[name].size, source,
          f"{where} range [{off}, {off + length}) lies outside file {name!r} "
          f"of {files[name].size} bytes")
    return ItemLocation(name, off, length, _parse_crc(d.get("crc32c"), source, where))


def _check_version(doc: dict, source: str) -> int:
    if doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(
            f"{source}: not a ckpt manifest (format={str(doc.get('format'))[:100]!r}); this "
            f"folder was written by another tool", path=source)
    version = doc.get("format_version")
    if not _is_int(version, 1):
        raise FormatVersionError(
            f"{source}: format_version {str(version)[:40]!r} is not a positive int; the "
            f"manifest is damaged, load an earlier step", path=source)
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{source}: format_version {version} is newer than this ckpt reads "
            f"({FORMAT_VERSION}); upgrade ckpt to load it", path=source)
    return version


def _parse_files(raw: Any, source: str) -> dict[str, FileRecord]:
    _need(isinstance(raw, dict), source, "'files' must be an object")
    files: dict[str, FileRecord] = {}
    for name, rec in raw.items():
        # File names are plain names inside the checkpoint folder: nothing may escape it.
        _need(_FILE_RE.fullmatch(name) is not None and ".." not in name, source,
              f"file name {name[:200]!r} is not a plain file name inside the checkpoint "
              f"folder (no '/', '..' or leading '.')")
        _need(isinstance(rec, dict) and _is_int(rec.get("size")), source,
              f"files[{name!r}].size must be an int in [0, 2**63)")
        rank = rec.get("rank", -1)
        files[name] = FileRecord(rec["size"], _parse_crc(rec.get("crc32c"), source,
                                                         f"files[{name!r}]"),
                                 rank if _is_int(rank, -1) else -1)
    return files


def _parse_tensor(fqn: str, t: Any, files: dict[str, FileRecord], source: str) -> dict:
    where = f"tensors[{fqn[:200]!r}]"
    _need(isinstance(t, dict), source, f"{where} must be an object")
    dtype = dtype_from_name(t.get("dtype"), f"{source}: {where}")
    shape = t.get("shape")
    _need(isinstance(shape, list) and len(shape) <= MAX_DIMS and all(_is_int(s) for s in shape),
          source, f"{where}.shape must be a list of at most {MAX_DIMS} ints >= 0")
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(shape)
    _need(numel * itemsize <= MAX_INT, source, f"{where}.shape {shape} is too large")
    raw_chunks = t.get("chunks")
    _need(isinstance(raw_chunks, list), source, f"{where}.chunks must be a list")
    chunks = []
    for i, c in enumerate(raw_chunks):
        cw = f"{where}.chunks[{i}]"
        _need(isinstance(c, dict), source, f"{cw} must be an object")
        offs, sizes = c.get("offsets"), c.get("sizes")
        _need(isinstance(offs, list) and isinstance(sizes, list)
              and len(offs) == len(shape) == len(sizes)
              and all(_is_int(x) for x in offs + sizes), source,
              f"{cw} offsets/sizes must be int lists of the tensor's rank ({len(shape)})")
        _need(all(o + s <= d for o, s, d in zip(offs, sizes, shape)), source,
              f"{cw} (offsets {offs}, sizes {sizes}) lies outside the tensor's shape {shape}")
        loc = _parse_location(c, files, source, cw)
        chunk_numel = math.prod(sizes)
        _need(loc.length == chunk_numel * itemsize, source,
              f"{cw} length {loc.length} != {chunk_numel} elements x {itemsize} bytes")
        chunks.append({"offsets": offs, "sizes": sizes, "location": loc})
    _check_coverage(shape, chunks, source, where)
    return {"dtype": t["dtype"], "shape": shape, "chunks": chunks}


def _check_coverage(shape: list[int], chunks: list[dict], source: str, where: str) -> None:
    """The chunks MUST cover the tensor exactly once: no gap, no overlap.

    The distinct chunk boundaries of each dimension cut the tensor into a grid of cells;
    every chunk is a box of whole cells. One flag per cell (not per element) finds overlaps
    and gaps in time linear in the cells, so the grid is bounded by ``MAX_GRID_CELLS``
    (a layout of DTensor shards has one cell per chunk).
    """
    numel = math.prod(shape)
    if not shape:  # a scalar: exactly one chunk
        _need(len(chunks) == 1, source, f"{where} is a scalar and needs exactly one chunk, "
                                        f"has {len(chunks)}")
        return
    if numel == 0:
        return
    boxes = [(c["offsets"], c["sizes"], i) for i, c in enumerate(chunks)
             if math.prod(c["sizes"]) > 0]
    covered = sum(math.prod(sizes) for _, sizes, _ in boxes)
    _need(covered == numel, source,
          f"{where}: chunks hold {covered} elements, the shape {shape} has {numel} "
          f"(chunks are missing, duplicated or overlap)")
    cuts = [sorted({0, dim, *(o[d] for o, _, _ in boxes), *(o[d] + s[d] for o, s, _ in boxes)})
            for d, dim in enumerate(shape)]
    grid_shape = [len(c) - 1 for c in cuts]
    num_cells = math.prod(grid_shape)
    _need(num_cells <= MAX_GRID_CELLS, source,
          f"{where}: {len(boxes)} chunks cut the tensor into a grid of {num_cells} cells, "
          f"more than the {MAX_GRID_CELLS} a reader checks")
    grid = torch.zeros(grid_shape, dtype=torch.bool)
    for offs, sizes, i in boxes:
        index = tuple(slice(bisect.bisect_left(c, o), bisect.bisect_left(c, o + s))
                      for c, o, s in zip(cuts, offs, sizes))
        cells = grid[index]
        _need(not bool(cells.any()), source,
              f"{where}.chunks[{i}] (offsets {offs}, sizes {sizes}) overlaps another chunk")
        cells.fill_(True)
    _need(bool(grid.all()), source, f"{where}: chunks leave part of the tensor uncovered")


def _check_items_disjoint(manifest_items: list[tuple[str, ItemLocation]], source: str) -> None:
    """Items MUST NOT share bytes: then what a load allocates is bounded by the files."""
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for where, loc in manifest_items:
        if loc.length:
            by_file.setdefault(loc.file, []).append((loc.offset, loc.length, where))
    for name, items in by_file.items():
        items.sort()
        for (off_a, len_a, a), (off_b, _, b) in zip(items, items[1:]):
            _need(off_a + len_a <= off_b, source,
                  f"{a} and {b} share bytes of file {name!r} (items must not overlap)")


def _path_key(path: list) -> tuple:
    return tuple((0, p, "") if isinstance(p, int) else (1, 0, p) for p in path)


def _parse_planner_data(raw: Any, source: str) -> dict[str, list]:
    _need(isinstance(raw, dict), source, "planner_data must be an object")
    out: dict[str, list] = {}
    for key, path in raw.items():
        _need(isinstance(path, list) and 1 <= len(path) <= MAX_PATH_COMPONENTS and all(
            isinstance(p, str) or (_is_int(p) and p < (1 << 31)) for p in path), source,
            f"planner_data[{key[:200]!r}] must be a list of 1 to {MAX_PATH_COMPONENTS} strings "
            f"or ints in [0, 2**31)")
        out[key] = path
    # Paths must name distinct leaves: no duplicate, none the prefix of another (sorted,
    # a prefix comes right before the paths it starts).
    ordered = sorted(out.items(), key=lambda kv: _path_key(kv[1]))
    for (ka, a), (kb, b) in zip(ordered, ordered[1:]):
        _need(b[:len(a)] != a, source,
              f"planner_data paths of {ka[:200]!r} and {kb[:200]!r} collide ({a} is "
              f"{'the same as' if len(a) == len(b) else 'a prefix of'} {b})")
    return out


def _parse_attachments(raw: Any, files: dict[str, FileRecord], item_files: set[str],
                       source: str) -> dict[str, Attachment]:
    """``attachments``: name -> a file of ``files`` that holds no item, at most
    ``MAX_ATTACHMENT_BYTES``, with the same size and crc32c as its ``files`` record."""
    _need(isinstance(raw, dict), source, "'attachments' must be an object")
    out: dict[str, Attachment] = {}
    used: dict[str, str] = {}
    for name, rec in raw.items():
        try:
            problem = None
            check_attachment_name(name)
        except ValueError as exc:
            problem = exc.args[0]
        _need(problem is None, source, f"attachments: {problem}")
        where = f"attachments[{name!r}]"
        _need(isinstance(rec, dict), source, f"{where} must be an object")
        file, size = rec.get("file"), rec.get("size")
        _need(isinstance(file, str) and file in files, source,
              f"{where}.file {str(file)[:100]!r} is not listed in 'files'")
        _need(_is_int(size) and size <= MAX_ATTACHMENT_BYTES, source,
              f"{where}.size must be an int in [0, {MAX_ATTACHMENT_BYTES}]")
        crc = _parse_crc(rec.get("crc32c"), source, where)
        _need(size == files[file].size and crc == files[file].crc32c, source,
              f"{where} (size {size}, crc32c {crc:08x}) disagrees with files[{file!r}]")
        _need(file not in item_files, source, f"{where}.file {file!r} also holds tensor data")
        _need(file not in used, source,
              f"{where} and attachments[{used.get(file)!r}] share the file {file!r}")
        used[file] = name
        out[name] = Attachment(file, size, crc)
    return out


def _parse(doc: Any, source: str) -> dict[str, Any]:
    _need(isinstance(doc, dict), source, "top level must be a JSON object")
    version = _check_version(doc, source)
    _need(_is_int(doc.get("step")), source, "step must be an int in [0, 2**63)")
    _need(isinstance(doc.get("save_id"), str), source, "save_id must be a string")
    _need(_is_number(doc.get("created_unix")), source, "created_unix must be a finite number")
    for key in ("layout", "user_metadata", "versions", "writer"):
        _need(isinstance(doc.get(key, {}), dict), source, f"'{key}' must be an object")
    files = _parse_files(doc.get("files"), source)
    raw_tensors = doc.get("tensors")
    _need(isinstance(raw_tensors, dict), source, "'tensors' must be an object")
    tensors = {fqn: _parse_tensor(fqn, t, files, source) for fqn, t in raw_tensors.items()}
    raw_objects = doc.get("objects", {})
    _need(isinstance(raw_objects, dict), source, "'objects' must be an object")
    objects = {fqn: _parse_location(o, files, source, f"objects[{fqn[:200]!r}]")
               for fqn, o in raw_objects.items()}
    _need(not (tensors.keys() & objects.keys()), source,
          f"keys {sorted(tensors.keys() & objects.keys())[:3]} are both tensors and objects")
    _check_items_disjoint(
        [(f"tensors[{fqn[:200]!r}].chunks[{i}]", c["location"])
         for fqn, t in tensors.items() for i, c in enumerate(t["chunks"])]
        + [(f"objects[{fqn[:200]!r}]", loc) for fqn, loc in objects.items()], source)
    planner_data = _parse_planner_data(doc.get("planner_data", {}), source)
    item_files = {c["location"].file for t in tensors.values() for c in t["chunks"]} \
        | {loc.file for loc in objects.values()}
    attachments = _parse_attachments(doc.get("attachments", {}), files, item_files, source)
    world_size = doc.get("world_size", 1)
    return dict(
        step=doc["step"], save_id=doc["save_id"], created_unix=float(doc["created_unix"]),
        tensors=tensors, objects=objects, files=files,
        world_size=world_size if _is_int(world_size, 1) else 1,
        layout=doc.get("layout", {}), user_metadata=doc.get("user_metadata", {}),
        versions=doc.get("versions", {}), writer=doc.get("writer", {}),
        planner_data=planner_data, format_version=version, attachments=attachments)
