"""The safetensors header, parsed here: an 8-byte little-endian length ``N``, then ``N``
bytes of JSON, ``{name: {"dtype": ..., "shape": [...], "data_offsets": [begin, end]},
"__metadata__": {str: str}}``, then the tensors' bytes (offsets relative to byte ``8 + N``).

The header is untrusted input read from storage, so :func:`parse_header` refuses, with one
line naming the file and what is wrong (``CorruptCheckpointError``): a length over
:data:`MAX_HEADER_BYTES` or past the end of the file, JSON that is not strict JSON (the
project's parser, :mod:`ckpt.format.jsonio`: bounded depth, no duplicate keys), an entry
that is not exactly those three fields, a dtype it does not know, a shape that is not a
list of non-negative integers, offsets past the end of the file, a byte size that is not
the shape's (computed in Python integers, so a huge shape cannot overflow), and two tensors
whose bytes overlap. Nothing is allocated from the header's numbers: memory is bounded by
the header's length. Nothing here unpickles, and no safetensors library is needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ckpt.errors import CorruptCheckpointError
from ckpt.format import jsonio

__all__ = ["MAX_HEADER_BYTES", "SAFETENSORS_DTYPES", "TensorEntry", "SafetensorsHeader",
           "parse_header", "read_header"]

MAX_HEADER_BYTES = 100 << 20  # 100 MiB: real headers are kilobytes (a 70B model: ~100 KiB)
_FIRST_READ_BYTES = 64 << 10  # one request holds the length and a typical header
_MAX_DIMS = 64

# The safetensors dtype names this torch can hold (float4 and float6 pack several values in
# a byte with shapes of their own: refused as unknown).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu, "C64": torch.complex64,
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: its bytes are ``[begin, end)`` of the file (absolute
    offsets, the header's plus its start)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along dim 0 (the whole tensor for a 0-d one)."""
        return math.prod(self.shape[1:]) * self.dtype.itemsize


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed header: the tensors by name, ``__metadata__``, and where the data starts."""

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int
    file_bytes: int


def _refuse(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where}: {what}; it is not a valid safetensors file (damaged, truncated or not "
        f"safetensors): download or convert it again", path=where)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry(where: str, name: str, spec: Any, data_start: int, file_bytes: int) -> TensorEntry:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise _refuse(where, f"tensor {name[:200]!r} is not "
                             f"{{'dtype', 'shape', 'data_offsets'}}")
    dtype = SAFETENSORS_DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
    if dtype is None:
        raise _refuse(where, f"tensor {name[:200]!r} has dtype {str(spec['dtype'])[:40]!r}, "
                             f"not one of {', '.join(SAFETENSORS_DTYPES)}")
    shape, offsets = spec["shape"], spec["data_offsets"]
    if (not isinstance(shape, list) or len(shape) > _MAX_DIMS
            or not all(_is_int(d) and d >= 0 for d in shape)):
        raise _refuse(where, f"tensor {name[:200]!r} has shape {str(shape)[:80]}, not a list "
                             f"of at most {_MAX_DIMS} non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_int(o) for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
        raise _refuse(where, f"tensor {name[:200]!r} has data_offsets {str(offsets)[:80]}, "
                             f"not [begin, end] with 0 <= begin <= end")
    begin, end = data_start + offsets[0], data_start + offsets[1]
    if end > file_bytes:
        raise _refuse(where, f"tensor {name[:200]!r} ends at byte {end}, past the end of "
                             f"the file ({file_bytes} bytes)")
    size = math.prod(shape) * dtype.itemsize  # Python integers: no overflow
    if size != end - begin:
        raise _refuse(where, f"tensor {name[:200]!r}: shape {shape} of {spec['dtype']} is "
                             f"{size} bytes but its data_offsets span {end - begin}")
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def parse_header(raw: bytes, data_start: int, file_bytes: int, where: str) -> SafetensorsHeader:
    """The header whose JSON is ``raw`` (the ``N`` bytes after the length), the data starting
    at ``data_start = 8 + N`` of a file of ``file_bytes``; ``where`` names it in errors."""
    doc = jsonio.loads(raw, where, max_bytes=MAX_HEADER_BYTES)
    if not isinstance(doc, dict):
        raise _refuse(where, f"the header is JSON {type(doc).__name__}, not an object")
    metadata = doc.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _refuse(where, "__metadata__ is not an object of strings")
    tensors = {name: _entry(where, name, spec, data_start, file_bytes)
               for name, spec in doc.items()}
    previous = None
    for entry in sorted(tensors.values(), key=lambda e: (e.begin, e.end)):
        if entry.nbytes == 0:
            continue
        if previous is not None and entry.begin < previous.end:
            raise _refuse(where, f"the bytes of tensors {previous.name[:200]!r} "
                                 f"[{previous.begin}, {previous.end}) and {entry.name[:200]!r} "
                                 f"[{entry.begin}, {entry.end}) overlap")
        previous = entry
    return SafetensorsHeader(tensors, dict(metadata), data_start, file_bytes)


def read_header(read: Callable[[int, int], bytes], file_bytes: int, where: str
                ) -> SafetensorsHeader:
    """The header of a file of ``file_bytes`` whose bytes ``[start, end)`` ``read`` returns:
    one read of the first 64 KiB, a second one only for a longer header. At most
    ``8 + MAX_HEADER_BYTES`` bytes are read, whatever the file says."""
    if file_bytes < 8:
        raise _refuse(where, f"{file_bytes} bytes, shorter than the 8-byte header length")
    first = read(0, min(file_bytes, _FIRST_READ_BYTES))
    if len(first) < 8:
        raise _refuse(where, f"read {len(first)} bytes where 8 were expected")
    length = int.from_bytes(first[:8], "little")
    if length > MAX_HEADER_BYTES:
        raise _refuse(where, f"the header claims {length} bytes, more than the "
                             f"{MAX_HEADER_BYTES >> 20} MiB allowed")
    if 8 + length > file_bytes:
        raise _refuse(where, f"the header claims {length} bytes, past the end of the file "
                             f"({file_bytes} bytes)")
    raw = first[8:8 + length]
    if len(raw) < length:
        raw += read(len(first), 8 + length)
    if len(raw) != length:
        raise _refuse(where, f"read {len(raw)} header bytes where {length} were expected")
    return parse_header(raw, 8 + length, file_bytes, where)
