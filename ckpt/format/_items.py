"""Checking items: the chunks and objects a manifest or a part locates in data files.

Shared by the root manifest's check (:mod:`ckpt.format._check`) and the parts'
(:mod:`ckpt.format.part`): one chunk lies inside its tensor and its file, holds exactly its
elements' bytes, and no two items share a byte of a file. The checks run once per chunk of
every manifest a load trusts, so they are written for speed: no message is formatted unless
a check fails, and a label names an item only then.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

import torch

from ckpt.errors import CorruptCheckpointError
from ckpt.format._schema import FileRecord, ItemLocation, dtype_from_name

__all__ = [
    "MAX_INT",
    "MAX_DIMS",
    "fail",
    "need",
    "is_int",
    "parse_crc",
    "itemsize",
    "box_problem",
    "location_problem",
    "chunk_problem",
    "check_items_disjoint",
]

MAX_INT = (1 << 63) - 1  # every size, offset, length and step fits an int64
MAX_DIMS = 32
_HEX8 = re.compile(r"[0-9a-f]{8}")
_ITEMSIZE: dict[str, int] = {}


def fail(source: str, what: str, document: str = "manifest") -> None:
    raise CorruptCheckpointError(
        f"{source}: invalid {document}: {what}; the checkpoint is damaged or was not written "
        f"by ckpt. Load an earlier step.", path=source)


def need(cond: bool, source: str, what: str) -> None:
    if not cond:
        fail(source, what)


def is_int(v: Any, minimum: int = 0) -> bool:
    return type(v) is int and minimum <= v <= MAX_INT


def parse_crc(v: Any, source: str, where: str) -> int:
    if type(v) is not str or _HEX8.fullmatch(v) is None:
        fail(source, f"{where}.crc32c must be 8 hex digits")
    return int(v, 16)


def itemsize(dtype_name: Any, where: str) -> int:
    """Bytes per element of the dtype named ``dtype_name`` (``CorruptCheckpointError``
    naming ``where`` for a name the format does not define)."""
    size = _ITEMSIZE.get(dtype_name) if type(dtype_name) is str else None
    if size is None:
        dtype = dtype_from_name(dtype_name, where)
        size = _ITEMSIZE[dtype_name] = torch.empty((), dtype=dtype).element_size()
    return size


def box_problem(offs: Any, sizes: Any, shape: list[int]) -> str | None:
    """What is wrong with a chunk's box (None: an int list each of ``shape``'s rank, >= 0,
    inside ``shape``), as the rest of a sentence that starts with the chunk's name."""
    if type(offs) is not list or type(sizes) is not list or \
            not len(offs) == len(sizes) == len(shape):
        return f" offsets/sizes must be int lists of the tensor's rank ({len(shape)})"
    for o, s, d in zip(offs, sizes, shape):
        if type(o) is not int or type(s) is not int or o < 0 or s < 0:
            return f" offsets/sizes must be int lists of the tensor's rank ({len(shape)})"
        if o + s > d:
            return f" (offsets {offs}, sizes {sizes}) lies outside the tensor's shape {shape}"
    return None


def location_problem(name: Any, offset: Any, length: Any,
                     files: dict[str, FileRecord]) -> str | None:
    """What is wrong with an item's location (None: a byte range inside a listed file), as
    the rest of a sentence that starts with the item's name."""
    rec = files.get(name) if type(name) is str else None
    if rec is None:
        return f".file {str(name)[:100]!r} is not listed in 'files'"
    if not (is_int(offset) and is_int(length)):
        return " offset/length must be ints in [0, 2**63)"
    if offset + length > rec.size:
        return (f" range [{offset}, {offset + length}) lies outside file {name!r} of "
                f"{rec.size} bytes")
    return None


def chunk_problem(offs: Any, sizes: Any, shape: list[int], item_bytes: int,
                  loc: ItemLocation, files: dict[str, FileRecord]) -> str | None:
    """What is wrong with one chunk (None: nothing): its box, its file, its byte range, its
    length; as the rest of a sentence that starts with the chunk's name."""
    problem = box_problem(offs, sizes, shape) or \
        location_problem(loc.file, loc.offset, loc.length, files)
    if problem is None and loc.length != math.prod(sizes) * item_bytes:
        problem = f" length {loc.length} != {math.prod(sizes)} elements x {item_bytes} bytes"
    return problem


def check_items_disjoint(items: list[tuple[str, int, int, Any]],
                         label: Callable[[Any], str], source: str) -> None:
    """Items ``(file, offset, length, ref)`` MUST NOT share bytes: then what a load
    allocates is bounded by the files. ``label(ref)`` names an item in the error."""
    items = sorted((it for it in items if it[2]), key=lambda it: (it[0], it[1]))
    for a, b in zip(items, items[1:]):
        if a[0] == b[0] and a[1] + a[2] > b[1]:
            fail(source, f"{label(a[3])} and {label(b[3])} share bytes of file {a[0]!r} "
                         f"(items must not overlap)")
