"""The names, records and dtypes of the checkpoint format (docs/format.md).

The lowest layer of the manifest: what a manifest is made of (file, item and attachment
records), the dtype names it may hold, the format's name and version, and the names of the
manifest file and of the step folders. :mod:`ckpt.format._check` validates untrusted
documents into these records; :mod:`ckpt.format.manifest` holds the :class:`Manifest` that puts
them together. Nothing here reads storage.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from ckpt.errors import CorruptCheckpointError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "PART_FORMAT_NAME",
    "MANIFEST_NAME",
    "ItemLocation",
    "FileRecord",
    "Attachment",
    "PartRecord",
    "part_name",
    "MAX_ATTACHMENT_BYTES",
    "check_attachment_name",
    "step_dirname",
    "parse_step_dirname",
    "FORMAT_DTYPE_NAMES",
    "DTYPE_NAMES",
    "PACKED_DTYPE_NAMES",
    "dtype_name",
    "dtype_from_name",
    "is_packed",
]

FORMAT_NAME = "ckpt"
FORMAT_VERSION = 2  # 1: one manifest names every chunk; 2: a root manifest and per-rank parts
PART_FORMAT_NAME = "ckpt-part"
MANIFEST_NAME = "manifest.json"

_STEP_RE = re.compile(r"^step_(\d{9,})$")
# Attachments: plain file names (short enough that the stored name, with its "a_<id>_"
# prefix, is still a valid file name) and small files.
_ATTACHMENT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_ATTACHMENT_BYTES = 64 << 20

# Every dtype the format defines (docs/format.md): whole-byte elements stored as raw bytes,
# little-endian. Not here: quantized dtypes (their scale and zero point are not bytes of the
# tensor) and the sub-byte uintN/intN and bitsN types (torch cannot copy or stage them).
FORMAT_DTYPE_NAMES: tuple[str, ...] = (
    "float64", "float32", "float16", "bfloat16", "complex64", "complex128",
    "int64", "int32", "int16", "int8", "uint8", "bool",
    "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
)
# Packed dtypes: one element (one byte) holds two 4-bit values. torch converts them to no
# other dtype, so they are only ever copied, compared and exported as bytes.
PACKED_DTYPE_NAMES: tuple[str, ...] = ("float4_e2m1fn_x2",)

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in FORMAT_DTYPE_NAMES
    if isinstance(getattr(torch, name, None), torch.dtype)
}
DTYPE_NAMES: tuple[str, ...] = tuple(_DTYPES)  # the dtypes a manifest may hold (this torch has)


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype} is not supported by the checkpoint format")
    return name


def is_packed(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` packs several values per element (no numeric conversion exists)."""
    return str(dtype).removeprefix("torch.") in PACKED_DTYPE_NAMES


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


def part_name(rank: int, save_id: str) -> str:
    """The file name of rank ``rank``'s part of attempt ``save_id`` (format version 2)."""
    return f"part-r{rank:05d}_{save_id}.json"


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
    """A file of a version (data or attachment): its size, crc32c and writing rank (-1:
    not recorded)."""

    size: int
    crc32c: int
    rank: int


@dataclass(frozen=True)
class Attachment:
    """A small file kept with a checkpoint: its stored file (also listed in ``files``)."""

    file: str
    size: int
    crc32c: int

    def to_json(self) -> dict:
        return {"file": self.file, "size": self.size, "crc32c": f"{self.crc32c:08x}"}


@dataclass(frozen=True)
class PartRecord:
    """A part as the root manifest lists it: the rank that wrote it and the SHA-256 of its
    bytes (its size and CRC32C are in the root's ``files``, like every file's)."""

    rank: int
    sha256: str

    def to_json(self) -> dict:
        return {"rank": self.rank, "sha256": self.sha256}


def check_attachment_name(name: Any) -> str:
    """``name`` if it is a valid attachment name, else ``ValueError`` saying what is allowed."""
    if not isinstance(name, str) or _ATTACHMENT_NAME_RE.fullmatch(name) is None \
            or ".." in name:
        raise ValueError(
            f"attachment name {str(name)[:200]!r} is not a plain file name: use 1 to 128 "
            f"letters, digits, '.', '_' or '-', starting with a letter or digit, without "
            f"'/' or '..' (e.g. 'config.json')")
    return name
