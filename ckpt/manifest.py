"""The checkpoint manifest: the JSON document whose existence commits a checkpoint.

See docs/format.md for the normative description. This module parses and validates a
manifest strictly (a manifest is untrusted input) and converts it to and from the metadata
that ``torch.distributed.checkpoint``'s planners work with.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckpt.errors import CorruptCheckpointError, FormatVersionError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "PENDING_NAME",
    "ItemLocation",
    "FileRecord",
    "Manifest",
    "step_dirname",
    "parse_step_dirname",
    "dtype_name",
    "dtype_from_name",
]

FORMAT_NAME = "ckpt"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
PENDING_NAME = "pending.json"

_STEP_RE = re.compile(r"^step_(\d{9,})$")
_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "complex64", "complex128",
        "int64", "int32", "int16", "int8", "uint8", "bool",
        "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype} is not supported by the checkpoint format")
    return name


def dtype_from_name(name: str, where: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(f"{where}: unknown dtype {name!r}", path=where) from None


def step_dirname(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:09d}"


def parse_step_dirname(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ItemLocation:
    """Where one saved chunk (or object) lives: a byte range of a data file."""

    file: str
    offset: int
    length: int
    crc32c: int

    def to_json(self) -> dict:
        return {"file": self.file, "offset": self.offset, "length": self.length,
                "crc32c": f"{self.crc32c:08x}"}


@dataclass(frozen=True)
class FileRecord:
    size: int
    crc32c: int
    rank: int


@dataclass
class Manifest:
    """A parsed, validated manifest. ``tensors`` maps FQN -> {dtype, shape, chunks}."""

    step: int
    save_id: str
    created_unix: float
    tensors: dict[str, dict[str, Any]]
    objects: dict[str, ItemLocation]
    files: dict[str, FileRecord]
    world_size: int = 1
    layout: dict[str, Any] = field(default_factory=dict)
    user_metadata: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    writer: dict[str, Any] = field(default_factory=dict)
    planner_data: dict[str, list] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    # -- serialisation ---------------------------------------------------------------------
    def to_json_bytes(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "step": self.step,
            "save_id": self.save_id,
            "created_unix": self.created_unix,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created_unix)),
            "world_size": self.world_size,
            "layout": self.layout,
            "versions": self.versions,
            "writer": self.writer,
            "user_metadata": self.user_metadata,
            "files": {name: {"size": r.size, "crc32c": f"{r.crc32c:08x}", "rank": r.rank}
                      for name, r in sorted(self.files.items())},
            "tensors": {fqn: {"dtype": t["dtype"], "shape": list(t["shape"]),
                              "chunks": [{"offsets": list(c["offsets"]),
                                          "sizes": list(c["sizes"]),
                                          **c["location"].to_json()} for c in t["chunks"]]}
                        for fqn, t in self.tensors.items()},
            "objects": {fqn: loc.to_json() for fqn, loc in self.objects.items()},
            "planner_data": self.planner_data,
        }
        return json.dumps(doc, indent=1, allow_nan=False).encode("utf-8")

    @classmethod
    def from_json_bytes(cls, data: bytes, source: str) -> "Manifest":
        """Parse and validate; every problem raises ``CorruptCheckpointError`` naming ``source``."""
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptCheckpointError(
                f"{source}: manifest is not valid JSON ({exc}); the checkpoint is corrupt or "
                f"was not written by ckpt. Load an earlier step or delete this folder.",
                path=source) from None
        return _parse(doc, source)

    # -- conversion for torch.distributed.checkpoint ----------------------------------------
    def to_dcp_metadata(self) -> Metadata:
        sd_md: dict[str, Any] = {}
        storage: dict[MetadataIndex, ItemLocation] = {}
        for fqn, t in self.tensors.items():
            chunks = []
            for c in t["chunks"]:
                chunk = ChunkStorageMetadata(offsets=torch.Size(c["offsets"]),
                                             sizes=torch.Size(c["sizes"]))
                chunks.append(chunk)
                storage[MetadataIndex(fqn, chunk.offsets)] = c["location"]
            sd_md[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype_from_name(t["dtype"], fqn)),
                size=torch.Size(t["shape"]), chunks=chunks)
        for fqn, loc in self.objects.items():
            sd_md[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = loc
        planner_data = {k: tuple(v) for k, v in self.planner_data.items()}
        return Metadata(state_dict_metadata=sd_md, planner_data=planner_data,
                        storage_data=storage)


def _need(cond: bool, source: str, what: str) -> None:
    if not cond:
        raise CorruptCheckpointError(f"{source}: invalid manifest: {what}", path=source)


def _is_int(v: Any, minimum: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _parse_crc(v: Any, source: str, where: str) -> int:
    _need(isinstance(v, str) and re.fullmatch(r"[0-9a-f]{8}", v) is not None, source,
          f"{where}.crc32c must be 8 hex digits")
    return int(v, 16)


def _parse_location(d: Any, files: dict[str, FileRecord], source: str, where: str) -> ItemLocation:
    _need(isinstance(d, dict), source, f"{where} must be an object")
    name = d.get("file")
    _need(isinstance(name, str) and name in files, source,
          f"{where}.file {name!r} is not listed in 'files'")
    off, length = d.get("offset"), d.get("length")
    _need(_is_int(off) and _is_int(length), source, f"{where} offset/length must be ints >= 0")
    _need(off + length <= files[name].size, source,
          f"{where} range [{off}, {off + length}) lies outside file {name!r} "
          f"of {files[name].size} bytes")
    return ItemLocation(name, off, length, _parse_crc(d.get("crc32c"), source, where))


def _parse(doc: Any, source: str) -> Manifest:
    _need(isinstance(doc, dict), source, "top level must be a JSON object")
    if doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(
            f"{source}: not a ckpt manifest (format={doc.get('format')!r}); this folder was "
            f"written by another tool", path=source)
    version = doc.get("format_version")
    if not _is_int(version, 1):
        raise FormatVersionError(f"{source}: format_version {version!r} is not a positive int",
                                 path=source)
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{source}: format_version {version} is newer than this ckpt reads "
            f"({FORMAT_VERSION}); upgrade ckpt to load it", path=source)
    _need(_is_int(doc.get("step")), source, "step must be an int >= 0")
    _need(isinstance(doc.get("save_id"), str), source, "save_id must be a string")
    _need(isinstance(doc.get("created_unix"), (int, float)), source, "created_unix must be a number")
    raw_files = doc.get("files")
    _need(isinstance(raw_files, dict), source, "'files' must be an object")
    files: dict[str, FileRecord] = {}
    for name, rec in raw_files.items():
        # File names are plain names inside the checkpoint folder: nothing may escape it.
        _need(isinstance(name, str) and _FILE_RE.match(name) is not None and ".." not in name,
              source, f"file name {name!r} is not a plain file name inside the checkpoint "
                      f"folder (no '/', '..' or leading '.')")
        _need(isinstance(rec, dict) and _is_int(rec.get("size")), source,
              f"files[{name!r}].size must be an int >= 0")
        files[name] = FileRecord(rec["size"], _parse_crc(rec.get("crc32c"), source,
                                                         f"files[{name!r}]"),
                                 rec.get("rank", -1) if _is_int(rec.get("rank", -1), -1) else -1)
    tensors: dict[str, dict[str, Any]] = {}
    raw_tensors = doc.get("tensors")
    _need(isinstance(raw_tensors, dict), source, "'tensors' must be an object")
    for fqn, t in raw_tensors.items():
        where = f"tensors[{fqn!r}]"
        _need(isinstance(t, dict), source, f"{where} must be an object")
        dtype = dtype_from_name(t.get("dtype"), f"{source}: {where}")
        shape = t.get("shape")
        _need(isinstance(shape, list) and all(_is_int(s) for s in shape), source,
              f"{where}.shape must be a list of ints >= 0")
        itemsize = torch.empty((), dtype=dtype).element_size()
        chunks = []
        _need(isinstance(t.get("chunks"), list), source, f"{where}.chunks must be a list")
        for i, c in enumerate(t["chunks"]):
            cw = f"{where}.chunks[{i}]"
            _need(isinstance(c, dict), source, f"{cw} must be an object")
            offs, sizes = c.get("offsets"), c.get("sizes")
            _need(isinstance(offs, list) and isinstance(sizes, list)
                  and len(offs) == len(shape) == len(sizes)
                  and all(_is_int(x) for x in offs + sizes), source,
                  f"{cw} offsets/sizes must be int lists of the tensor's rank")
            _need(all(o + s <= d for o, s, d in zip(offs, sizes, shape)), source,
                  f"{cw} lies outside the tensor's shape {shape}")
            loc = _parse_location(c, files, source, cw)
            numel = 1
            for s in sizes:
                numel *= s
            _need(loc.length == numel * itemsize, source,
                  f"{cw} length {loc.length} != {numel} elements x {itemsize} bytes")
            chunks.append({"offsets": offs, "sizes": sizes, "location": loc})
        tensors[fqn] = {"dtype": t["dtype"], "shape": shape, "chunks": chunks}
    raw_objects = doc.get("objects", {})
    _need(isinstance(raw_objects, dict), source, "'objects' must be an object")
    objects = {fqn: _parse_location(o, files, source, f"objects[{fqn!r}]")
               for fqn, o in raw_objects.items()}
    planner_data = doc.get("planner_data") or {}
    _need(isinstance(planner_data, dict) and all(
        isinstance(v, list) and all(isinstance(p, (str, int)) for p in v)
        for v in planner_data.values()), source, "planner_data must map keys to paths")
    for key in ("layout", "user_metadata", "versions", "writer"):
        _need(isinstance(doc.get(key, {}), dict), source, f"'{key}' must be an object")
    return Manifest(
        step=doc["step"], save_id=doc["save_id"], created_unix=float(doc["created_unix"]),
        tensors=tensors, objects=objects, files=files,
        world_size=doc.get("world_size", 1) if _is_int(doc.get("world_size", 1), 1) else 1,
        layout=doc.get("layout", {}), user_metadata=doc.get("user_metadata", {}),
        versions=doc.get("versions", {}), writer=doc.get("writer", {}),
        planner_data=planner_data, format_version=version)
