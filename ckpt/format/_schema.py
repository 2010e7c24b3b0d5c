"""The names, records and dtypes of the checkpoint format (docs/format.md).

The lowest layer of the manifest: what a manifest is made of (file, item and attachment
records), the dtype names it may hold, the format's name and version, and the names of the
manifest file, of the step folders and of every file in them (each built by one function
here, recognised by one pattern here). :mod:`ckpt.format._check` validates untrusted
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
    "data_file_name",
    "marker_name",
    "attachment_file",
    "rolled_back_name",
    "fenced_name",
    "damaged_manifest_name",
    "step_file",
    "data_file_id",
    "is_data_file",
    "marker_id",
    "rolled_back_id",
    "fenced_id",
    "is_damaged_manifest",
    "LEGACY_MARKER_NAME",
    "LEGACY_ROLLED_NAME",
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


def step_file(step: int, name: str) -> str:
    """The path, relative to the root, of file ``name`` of step ``step``'s folder."""
    return f"{step_dirname(step)}/{name}"


# The names inside a step folder: each built by one function here and recognised by one
# pattern here (docs/format.md; the life-cycle, :mod:`ckpt.root.lifecycle`, says which
# transition writes which). Attempt (save) ids are lowercase hex.
_ID = r"[0-9a-f]{6,64}"
_DATA_RE = re.compile(rf"^r\d{{5}}_({_ID})_\d+\.bin$")
_PART_RE = re.compile(rf"^part-r\d{{5}}_({_ID})\.json$")
_ATTACHMENT_RE = re.compile(rf"^a_({_ID})_[A-Za-z0-9][A-Za-z0-9._-]*$")
_MARKER_RE = re.compile(rf"^pending-({_ID})\.json$")
_ROLLED_RE = re.compile(rf"^rolled-back-({_ID})\.json$")
_FENCED_RE = re.compile(rf"^fenced-({_ID})\.json$")
_DAMAGED_RE = re.compile(r"^damaged-manifest-[0-9a-f]{6,64}\.json$")
LEGACY_MARKER_NAME = "pending.json"
"""An attempt marker of an older writer (no save id in its name)."""
LEGACY_ROLLED_NAME = "rolled-back-manifest.json"
"""An un-committed manifest of an older writer (no save id in its name)."""


def part_name(rank: int, save_id: str) -> str:
    """The file name of rank ``rank``'s part of attempt ``save_id`` (format version 2)."""
    return f"part-r{rank:05d}_{save_id}.json"


def data_file_name(rank: int, save_id: str, k: int) -> str:
    """The name of rank ``rank``'s ``k``-th data file of attempt ``save_id``."""
    return f"r{rank:05d}_{save_id}_{k}.bin"


def attachment_file(save_id: str, name: str) -> str:
    """The stored name of attachment ``name`` (already validated) of attempt ``save_id``."""
    return f"a_{save_id}_{name}"


def marker_name(save_id: str) -> str:
    """The attempt marker of attempt ``save_id``, written before any of its data."""
    return f"pending-{save_id}.json"


def rolled_back_name(save_id: str) -> str:
    """Where the manifest of attempt ``save_id`` goes when it is un-committed (restorable)."""
    return f"rolled-back-{save_id}.json"


def fenced_name(save_id: str) -> str:
    """Where a fenced-off writer's late manifest of attempt ``save_id`` is moved aside."""
    return f"fenced-{save_id}.json"


def damaged_manifest_name(tag: str) -> str:
    """Where a damaged manifest is moved aside (``tag``: 12 random hex digits)."""
    return f"damaged-manifest-{tag}.json"


def data_file_id(name: str) -> str | None:
    """The attempt id in a data, part or attachment file's name, or None for a name not ours.

    Every rule that decides which files belong to an attempt (abandon, cleanup's leftovers,
    the size of an incomplete attempt) goes through this one function.
    """
    m = _DATA_RE.match(name) or _PART_RE.match(name) or _ATTACHMENT_RE.match(name)
    return m.group(1) if m else None


def is_data_file(name: str) -> bool:
    """Whether ``name`` (a file name, no folder) is a data file (not a part or attachment)."""
    return _DATA_RE.match(name) is not None


def marker_id(name: str) -> str | None:
    """The attempt id of an attempt marker's name, or None."""
    m = _MARKER_RE.match(name)
    return m.group(1) if m else None


def rolled_back_id(name: str) -> str | None:
    """The attempt id of an un-committed manifest's name, or None."""
    m = _ROLLED_RE.match(name)
    return m.group(1) if m else None


def fenced_id(name: str) -> str | None:
    """The attempt id of a fenced-off manifest's name, or None."""
    m = _FENCED_RE.match(name)
    return m.group(1) if m else None


def is_damaged_manifest(name: str) -> bool:
    """Whether ``name`` is a damaged manifest moved aside."""
    return _DAMAGED_RE.match(name) is not None


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
