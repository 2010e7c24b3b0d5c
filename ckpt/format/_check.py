"""Checking a root manifest: its digest, then every MUST of docs/format.md.

A manifest is untrusted input. :func:`read_manifest_fields` checks its digest
(``manifest_sha256``) before anything else, parses it with :mod:`ckpt.format.jsonio` and validates
every MUST of the format (types, bounds, file names, chunk coverage without gaps or
overlaps, item ranges inside their files, planner paths, parts, lineage, span) before any
caller allocates or reads a byte on its word; it returns the fields of a
:class:`ckpt.format.manifest.Manifest`. :func:`sealed_bytes` writes the digest line that a
reader checks (:func:`check_digest`), for the manifest and for parts (:mod:`ckpt.format.part`).
Per-item checks shared with the parts are in :mod:`ckpt.format._items`.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any

from ckpt.errors import CorruptCheckpointError, FormatVersionError
from ckpt.format import jsonio
from ckpt.format._items import (
    MAX_DIMS,
    MAX_INT,
    box_problem,
    check_items_disjoint,
    fail,
    is_int,
    itemsize,
    location_problem,
    need,
    parse_crc,
)
from ckpt.format._schema import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_ATTACHMENT_BYTES,
    Attachment,
    FileRecord,
    ItemLocation,
    PartRecord,
    check_attachment_name,
    part_name,
)
from ckpt.format.coverage import coverage_problem
from ckpt.format.lineage import parse_lineage
from ckpt.format.span import parse_span

__all__ = [
    "DIGEST_KEY",
    "MAX_PATH_COMPONENTS",
    "MAX_MANIFEST_BYTES",
    "manifest_bytes",
    "sealed_bytes",
    "check_digest",
    "read_manifest_fields",
]

DIGEST_KEY = "manifest_sha256"
MAX_PATH_COMPONENTS = 64
MAX_MANIFEST_BYTES = 64 << 20
"""The most a manifest (or a rolled-back one) may hold: a reader refuses a larger file
before it reads it (``Storage.read_bytes(..., max_bytes=)``)."""
_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


# -- the digest ------------------------------------------------------------------------------
def sealed_bytes(doc: dict[str, Any], key: str, *, compact: bool = False) -> bytes:
    """The bytes of a JSON file holding ``doc`` whose first line carries its digest under
    ``key`` (any existing ``key`` member is replaced).

    The first line is ``{"<key>": "<hex>",``; the digest is the SHA-256 of every byte after
    that line's newline, so a reader checks it before parsing anything. The rest is the
    object's other members, one per line (``compact``: all on one line, as parts are).
    """
    body = {k: v for k, v in doc.items() if k != key}
    if not body:
        raise ValueError("a sealed document needs at least one member")
    if compact:
        rest = jsonio.dumps(body)
        assert rest.startswith(b"{"), rest[:10]
        rest = rest[1:]
    else:
        rest = jsonio.dumps(body, indent=1)
        assert rest.startswith(b"{\n"), rest[:10]
        rest = rest[2:]
    digest = hashlib.sha256(rest).hexdigest()
    return b'{"' + key.encode() + b'": "' + digest.encode() + b'",\n' + rest


def manifest_bytes(doc: dict[str, Any]) -> bytes:
    """The bytes of a manifest file holding ``doc`` (see :func:`sealed_bytes`)."""
    return sealed_bytes(doc, DIGEST_KEY)


def check_digest(data: bytes, source: str, key: str = DIGEST_KEY,
                 what: str = "manifest") -> bool:
    """True when ``data`` starts with a digest line of ``key`` and the digest matches; raise
    on a mismatch; False for a file without one (a manifest written before digests)."""
    m = re.match(rb'\{"' + re.escape(key.encode()) + rb'": "([0-9a-f]{64})",\n', data)
    if m is None:
        return False
    actual = hashlib.sha256(memoryview(data)[m.end():]).hexdigest()
    expected = m.group(1).decode("ascii")
    if actual != expected:
        raise CorruptCheckpointError(
            f"{source}: {what} is damaged: its content does not match its {key} "
            f"(expected {expected}, got {actual}); load an earlier step", path=source,
            expected=expected, actual=actual)
    return True


def read_manifest_fields(data: bytes, source: str) -> dict[str, Any]:
    """Check the digest, parse and validate ``data`` (the bytes of ``source``): the keyword
    arguments of a ``Manifest``.

    Every problem raises ``CorruptCheckpointError`` (``FormatVersionError`` for a newer
    format) naming ``source``. A manifest that declares a newer ``format_version`` is
    refused as newer even when its digest does not check (a newer format may seal its
    manifests otherwise): an older reader never takes a newer version for damage.
    """
    try:
        sealed = check_digest(data, source)
    except CorruptCheckpointError:
        _raise_if_newer(data, source)
        raise
    try:
        doc = jsonio.loads(data, source, max_bytes=MAX_MANIFEST_BYTES)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"manifest is damaged: {exc}", path=source) from None
    if not sealed and isinstance(doc, dict) and DIGEST_KEY in doc:
        _raise_if_newer(data, source)
        raise CorruptCheckpointError(
            f"{source}: manifest is damaged: it has a {DIGEST_KEY!r} member that is not "
            f"its first line (the file was edited or overwritten); load an earlier step",
            path=source)
    return _parse(doc, source)


def _raise_if_newer(data: bytes, source: str) -> None:
    """Raise ``FormatVersionError`` when ``data`` parses and declares a ckpt format newer
    than this reader's; return otherwise (nothing else about it is trusted)."""
    try:
        doc = jsonio.loads(data, source, max_bytes=MAX_MANIFEST_BYTES)
    except CorruptCheckpointError:
        return
    if isinstance(doc, dict) and doc.get("format") == FORMAT_NAME \
            and is_int(doc.get("format_version"), 1) and doc["format_version"] > FORMAT_VERSION:
        _check_version(doc, source)


# -- validation ----------------------------------------------------------------------------------
def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _parse_location(d: Any, files: dict[str, FileRecord], source: str, where: str) -> ItemLocation:
    if type(d) is not dict:
        fail(source, f"{where} must be an object")
    name, off, length = d.get("file"), d.get("offset"), d.get("length")
    problem = location_problem(name, off, length, files)
    if problem is not None:
        fail(source, where + problem)
    return ItemLocation(name, off, length, parse_crc(d.get("crc32c"), source, where))


def _check_version(doc: dict, source: str) -> int:
    if doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(
            f"{source}: not a ckpt manifest (format={str(doc.get('format'))[:100]!r}); this "
            f"folder was written by another tool", path=source)
    version = doc.get("format_version")
    if not is_int(version, 1):
        raise FormatVersionError(
            f"{source}: format_version {str(version)[:40]!r} is not a positive int; the "
            f"manifest is damaged, load an earlier step", path=source)
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{source}: format_version {version} is newer than this ckpt reads "
            f"({FORMAT_VERSION}); upgrade ckpt to load it", path=source)
    return version


def _parse_files(raw: Any, source: str) -> dict[str, FileRecord]:
    need(isinstance(raw, dict), source, "'files' must be an object")
    files: dict[str, FileRecord] = {}
    for name, rec in raw.items():
        # File names are plain names inside the checkpoint folder: nothing may escape it.
        need(_FILE_RE.fullmatch(name) is not None and ".." not in name, source,
              f"file name {name[:200]!r} is not a plain file name inside the checkpoint "
              f"folder (no '/', '..' or leading '.')")
        need(isinstance(rec, dict) and is_int(rec.get("size")), source,
              f"files[{name!r}].size must be an int in [0, 2**63)")
        rank = rec.get("rank", -1)
        files[name] = FileRecord(rec["size"], parse_crc(rec.get("crc32c"), source,
                                                        f"files[{name!r}]"),
                                 rank if is_int(rank, -1) else -1)
    return files


def _parse_shape(t: dict, source: str, where: str) -> tuple[list[int], int]:
    """A tensor record's ``shape`` and its dtype's item size, checked (at most ``MAX_DIMS``
    ints, ``prod(shape) * itemsize < 2**63``)."""
    item_bytes = itemsize(t.get("dtype"), f"{source}: {where}")
    shape = t.get("shape")
    need(type(shape) is list and len(shape) <= MAX_DIMS and all(is_int(s) for s in shape),
          source, f"{where}.shape must be a list of at most {MAX_DIMS} ints >= 0")
    need(math.prod(shape) * item_bytes <= MAX_INT, source, f"{where}.shape {shape} is too large")
    return shape, item_bytes


def _parse_tensor(fqn: str, t: Any, files: dict[str, FileRecord], source: str,
                  version: int) -> dict:
    where = f"tensors[{fqn[:200]!r}]"
    need(type(t) is dict, source, f"{where} must be an object")
    shape, item_bytes = _parse_shape(t, source, where)
    sharded = t.get("sharded", False)
    need(type(sharded) is bool and (version >= 2 or not sharded), source,
          f"{where}.sharded must be true or false (format version 2 and later)")
    raw_chunks = t.get("chunks")
    need(type(raw_chunks) is list, source, f"{where}.chunks must be a list")
    chunks = []
    for i, c in enumerate(raw_chunks):
        if type(c) is not dict:
            fail(source, f"{where}.chunks[{i}] must be an object")
        offs, sizes = c.get("offsets"), c.get("sizes")
        name, off, length = c.get("file"), c.get("offset"), c.get("length")
        problem = box_problem(offs, sizes, shape) or location_problem(name, off, length, files)
        if problem is None and length != math.prod(sizes) * item_bytes:
            problem = f" length {length} != {math.prod(sizes)} elements x {item_bytes} bytes"
        if problem is not None:
            fail(source, f"{where}.chunks[{i}]{problem}")
        loc = ItemLocation(name, off, length,
                           parse_crc(c.get("crc32c"), source, f"{where}.chunks[{i}]"))
        chunks.append({"offsets": offs, "sizes": sizes, "location": loc})
    if not sharded:  # a sharded tensor's chunks are checked with its parts'
        problem = coverage_problem(shape, [(c["offsets"], c["sizes"]) for c in chunks],
                                   where=where)
        if problem is not None:
            fail(source, problem)
    return {"dtype": t["dtype"], "shape": shape, "chunks": chunks, "sharded": sharded}


def _path_key(path: list) -> tuple:
    return tuple((0, p, "") if isinstance(p, int) else (1, 0, p) for p in path)


def _parse_planner_data(raw: Any, source: str) -> dict[str, list]:
    need(isinstance(raw, dict), source, "planner_data must be an object")
    out: dict[str, list] = {}
    for key, path in raw.items():
        need(isinstance(path, list) and 1 <= len(path) <= MAX_PATH_COMPONENTS and all(
            isinstance(p, str) or (is_int(p) and p < (1 << 31)) for p in path), source,
            f"planner_data[{key[:200]!r}] must be a list of 1 to {MAX_PATH_COMPONENTS} strings "
            f"or ints in [0, 2**31)")
        out[key] = path
    # Paths must name distinct leaves: no duplicate, none the prefix of another (sorted,
    # a prefix comes right before the paths it starts).
    ordered = sorted(out.items(), key=lambda kv: _path_key(kv[1]))
    for (ka, a), (kb, b) in zip(ordered, ordered[1:]):
        need(b[:len(a)] != a, source,
              f"planner_data paths of {ka[:200]!r} and {kb[:200]!r} collide ({a} is "
              f"{'the same as' if len(a) == len(b) else 'a prefix of'} {b})")
    return out


def _parse_attachments(raw: Any, files: dict[str, FileRecord], item_files: set[str],
                       source: str) -> dict[str, Attachment]:
    """``attachments``: name -> a file of ``files`` that holds no item, at most
    ``MAX_ATTACHMENT_BYTES``, with the same size and crc32c as its ``files`` record."""
    need(isinstance(raw, dict), source, "'attachments' must be an object")
    out: dict[str, Attachment] = {}
    used: dict[str, str] = {}
    for name, rec in raw.items():
        try:
            problem = None
            check_attachment_name(name)
        except ValueError as exc:
            problem = exc.args[0]
        need(problem is None, source, f"attachments: {problem}")
        where = f"attachments[{name!r}]"
        need(isinstance(rec, dict), source, f"{where} must be an object")
        file, size = rec.get("file"), rec.get("size")
        need(isinstance(file, str) and file in files, source,
              f"{where}.file {str(file)[:100]!r} is not listed in 'files'")
        need(is_int(size) and size <= MAX_ATTACHMENT_BYTES, source,
              f"{where}.size must be an int in [0, {MAX_ATTACHMENT_BYTES}]")
        crc = parse_crc(rec.get("crc32c"), source, where)
        need(size == files[file].size and crc == files[file].crc32c, source,
              f"{where} (size {size}, crc32c {crc:08x}) disagrees with files[{file!r}]")
        need(file not in item_files, source, f"{where}.file {file!r} also holds tensor data")
        need(file not in used, source,
              f"{where} and attachments[{used.get(file)!r}] share the file {file!r}")
        used[file] = name
        out[name] = Attachment(file, size, crc)
    return out


def _parse_parts(raw: Any, files: dict[str, FileRecord], used: set[str], save_id: str,
                 world_size: int, source: str) -> dict[str, PartRecord]:
    """``parts`` (format version 2): name -> the rank that wrote it and its SHA-256. Each is
    listed in ``files`` under the name :func:`part_name` gives, with its rank, one per rank
    of ``world_size``, and holds no item or attachment (``used``: those files)."""
    need(type(raw) is dict, source, "'parts' must be an object")
    out: dict[str, PartRecord] = {}
    ranks: set[int] = set()
    for name, rec in raw.items():
        where = f"parts[{name[:200]!r}]"
        need(type(rec) is dict, source, f"{where} must be an object")
        rank, sha = rec.get("rank"), rec.get("sha256")
        need(is_int(rank) and rank < world_size and rank not in ranks, source,
              f"{where}.rank must be an int in [0, world_size={world_size}), one part per rank")
        need(type(sha) is str and _SHA256_RE.fullmatch(sha) is not None, source,
              f"{where}.sha256 must be 64 lowercase hex digits")
        need(name == part_name(rank, save_id), source,
              f"{where} must be named {part_name(rank, save_id)!r} (its rank and save id)")
        need(name in files and files[name].rank == rank, source,
              f"{where} is not listed in 'files' with rank {rank}")
        need(name not in used, source, f"{where} also holds items or an attachment")
        ranks.add(rank)
        out[name] = PartRecord(rank, sha)
    return out


def _item_label(ref: tuple[str, int | None]) -> str:
    fqn, i = ref
    return f"objects[{fqn[:200]!r}]" if i is None else f"tensors[{fqn[:200]!r}].chunks[{i}]"


def _parse(doc: Any, source: str) -> dict[str, Any]:
    need(isinstance(doc, dict), source, "top level must be a JSON object")
    version = _check_version(doc, source)
    need(is_int(doc.get("step")), source, "step must be an int in [0, 2**63)")
    need(isinstance(doc.get("save_id"), str), source, "save_id must be a string")
    need(_is_number(doc.get("created_unix")), source, "created_unix must be a finite number")
    for key in ("layout", "user_metadata", "versions", "writer"):
        need(isinstance(doc.get(key, {}), dict), source, f"'{key}' must be an object")
    files = _parse_files(doc.get("files"), source)
    raw_tensors = doc.get("tensors")
    need(isinstance(raw_tensors, dict), source, "'tensors' must be an object")
    tensors = {fqn: _parse_tensor(fqn, t, files, source, version)
               for fqn, t in raw_tensors.items()}
    raw_objects = doc.get("objects", {})
    need(isinstance(raw_objects, dict), source, "'objects' must be an object")
    objects = {fqn: _parse_location(o, files, source, f"objects[{fqn[:200]!r}]")
               for fqn, o in raw_objects.items()}
    need(not (tensors.keys() & objects.keys()), source,
          f"keys {sorted(tensors.keys() & objects.keys())[:3]} are both tensors and objects")
    items = [(c["location"].file, c["location"].offset, c["location"].length, (fqn, i))
             for fqn, t in tensors.items() for i, c in enumerate(t["chunks"])]
    items += [(loc.file, loc.offset, loc.length, (fqn, None)) for fqn, loc in objects.items()]
    check_items_disjoint(items, _item_label, source)
    planner_data = _parse_planner_data(doc.get("planner_data", {}), source)
    item_files = {it[0] for it in items}
    attachments = _parse_attachments(doc.get("attachments", {}), files, item_files, source)
    world_size = doc.get("world_size", 1)
    world_size = world_size if is_int(world_size, 1) else 1
    parts: dict[str, PartRecord] = {}
    if version >= 2:
        used = item_files | {a.file for a in attachments.values()}
        parts = _parse_parts(doc.get("parts", {}), files, used, doc["save_id"], world_size,
                             source)
    return dict(
        step=doc["step"], save_id=doc["save_id"], created_unix=float(doc["created_unix"]),
        tensors=tensors, objects=objects, files=files, world_size=world_size,
        layout=doc.get("layout", {}), user_metadata=doc.get("user_metadata", {}),
        versions=doc.get("versions", {}), writer=doc.get("writer", {}),
        planner_data=planner_data, format_version=version, attachments=attachments,
        parts=parts, lineage=parse_lineage(doc.get("lineage"), source),
        span=parse_span(doc.get("span"), source, world_size))
