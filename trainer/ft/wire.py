"""A replica's state as bytes and back, without pickle: what a rejoining group receives.

torchft's own transports unpickle what a peer sends (``HTTPTransport`` calls
``torch.load(weights_only=False)``, ``PGTransport`` ``pickle.loads`` its metadata), so a
peer could run code in the receiver. This encoding carries a state tree of dicts, lists,
JSON-like values and tensors, and decoding only ever builds plain data and tensors:

====================  =========================================================================
bytes                 content
====================  =========================================================================
8                     magic ``b"CKPTFT1\\n"``
8                     header length ``H``, unsigned little-endian
H                     header: strict JSON (``ckpt.format.codec``): ``{"step", "tree",
                      "tensors", "body_bytes"}``; in ``tree`` every tensor is replaced by
                      ``{"__tensor__": i}``; ``tensors[i]`` is ``[dtype, shape, offset,
                      nbytes, crc32c]``
``body_bytes``        the tensors' bytes, each at its ``offset`` (a multiple of 64) in the body
====================  =========================================================================

Every field is checked before a byte of the body is trusted (dtype known, shape and size
agreeing, offsets aligned and inside the body, the CRC32C of each tensor); a bad message is a
:class:`WireError` naming what is wrong.
"""

from __future__ import annotations

import math
import struct
from typing import Any, BinaryIO, Iterator

import torch

from ckpt.format import codec, crc32c_of, dtype_from_name, dtype_name

__all__ = ["WireError", "Encoded", "encode", "decode", "MAGIC", "MAX_HEADER_BYTES"]

MAGIC = b"CKPTFT1\n"
MAX_HEADER_BYTES = 256 << 20
_ALIGN = 64
_TENSOR = "__tensor__"
_CHUNK = 8 << 20


class WireError(ValueError):
    """A replica state message is malformed; the message says what is wrong."""


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor (contiguous) as a flat memoryview."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


class Encoded:
    """A state tree ready to send: its header bytes and its tensors' bytes, in order.

    Tensors are referenced, not copied (CUDA tensors are copied to the host once, here): the
    state must not change until every receiver has read it (``StateTransport``
    holds it back from the optimizer step).
    """

    def __init__(self, step: int, tree: Any):
        self.tensors: list[memoryview] = []
        self._keep: list[torch.Tensor] = []
        entries: list[list[Any]] = []
        offset = 0

        def strip(value: Any, where: str) -> Any:
            nonlocal offset
            if isinstance(value, torch.Tensor):
                t = value.detach()
                if t.device.type != "cpu":
                    t = t.cpu()
                t = t.contiguous()
                self._keep.append(t)
                data = _as_bytes(t)
                entries.append([dtype_name(t.dtype), list(t.shape), offset, data.nbytes,
                                crc32c_of([data])])
                self.tensors.append(data)
                offset = _aligned(offset + data.nbytes)
                return {_TENSOR: len(entries) - 1}
            if isinstance(value, dict):
                if any(not isinstance(k, str) for k in value):
                    raise TypeError(f"{where}: keys must be strings")
                if set(value) == {_TENSOR}:
                    raise TypeError(f"{where}: a dict keyed {_TENSOR!r} is reserved")
                return {k: strip(v, f"{where}.{k}") for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                out = [strip(v, f"{where}[{i}]") for i, v in enumerate(value)]
                return tuple(out) if isinstance(value, tuple) else out
            return value

        skeleton = strip(tree, "state")
        self.body_bytes = offset
        self.header = codec.encode_object({"step": int(step), "tree": skeleton,
                                           "tensors": entries, "body_bytes": offset})
        self.offsets = [e[2] for e in entries]

    def chunks(self) -> Iterator[bytes | memoryview]:
        """The whole message, in pieces (no copy of tensor bytes)."""
        yield MAGIC + struct.pack("<Q", len(self.header)) + self.header
        pos = 0
        for off, data in zip(self.offsets, self.tensors):
            if off > pos:
                yield bytes(off - pos)
            for i in range(0, data.nbytes, _CHUNK):
                yield data[i:i + _CHUNK]
            pos = off + data.nbytes
        if self.body_bytes > pos:
            yield bytes(self.body_bytes - pos)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def encode(step: int, tree: Any) -> Encoded:
    """:class:`Encoded` of ``tree`` at ``step`` (``TypeError`` for values JSON cannot hold)."""
    return Encoded(step, tree)


def _read_exact(stream: BinaryIO, n: int, what: str) -> bytes:
    data = stream.read(n)
    if data is None or len(data) != n:
        raise WireError(f"message ends inside its {what} ({len(data or b'')} of {n} bytes)")
    return data


def decode(stream: BinaryIO, *, expect_step: int | None = None,
           max_body_bytes: int = 1 << 44) -> tuple[int, Any]:
    """Read one message from ``stream``: ``(step, tree)`` with fresh CPU tensors.

    Raises :class:`WireError` for anything malformed, and when ``expect_step`` is given
    and the message holds another step.
    """
    if _read_exact(stream, len(MAGIC), "magic") != MAGIC:
        raise WireError("not a replica state message (bad magic)")
    (hlen,) = struct.unpack("<Q", _read_exact(stream, 8, "header length"))
    if hlen > MAX_HEADER_BYTES:
        raise WireError(f"header of {hlen} bytes is larger than {MAX_HEADER_BYTES}")
    try:
        header = codec.decode_object(_read_exact(stream, hlen, "header"), "replica state header")
    except (ValueError, TypeError, RuntimeError) as exc:
        raise WireError(f"bad header: {exc}") from None
    if not isinstance(header, dict) or set(header) != {"step", "tree", "tensors", "body_bytes"}:
        raise WireError("bad header: expected the keys step, tree, tensors, body_bytes")
    step, body_bytes, entries = header["step"], header["body_bytes"], header["tensors"]
    if not _is_int(step) or not _is_int(body_bytes) or not 0 <= body_bytes <= max_body_bytes:
        raise WireError(f"bad header: step {step!r}, body_bytes {body_bytes!r}")
    if expect_step is not None and step != expect_step:
        raise WireError(f"holds step {step}, expected {expect_step}")
    if not isinstance(entries, list):
        raise WireError("bad header: tensors is not a list")
    specs = [_check_entry(i, e, body_bytes) for i, e in enumerate(entries)]
    # Each tensor is read straight into its own storage (a view into one shared buffer
    # would carry a storage offset, which e.g. torch.set_rng_state ignores).
    tensors, pos = [], 0
    for i, (dtype, shape, offset, nbytes, crc) in sorted(enumerate(specs),
                                                         key=lambda x: x[1][2]):
        if offset < pos:
            raise WireError(f"tensor {i}: bytes [{offset}, {offset + nbytes}) overlap another")
        _skip(stream, offset - pos)
        t = torch.empty(shape, dtype=dtype)
        view = memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B") if nbytes \
            else memoryview(b"")
        _read_into(stream, view, f"tensor {i}")
        if crc32c_of([view]) != crc:
            raise WireError(f"tensor {i}: checksum mismatch (damaged in transit)")
        tensors.append((i, t))
        pos = offset + nbytes
    _skip(stream, body_bytes - pos)
    tensors = [t for _, t in sorted(tensors, key=lambda x: x[0])]
    return step, _rebuild(header["tree"], tensors, set())


def _read_into(stream: BinaryIO, view: memoryview, what: str) -> None:
    got = 0
    while got < view.nbytes:
        n = stream.readinto(view[got:got + _CHUNK])
        if not n:
            raise WireError(f"message ends inside {what} ({got} of {view.nbytes} bytes)")
        got += n


def _skip(stream: BinaryIO, n: int) -> None:
    if n:
        _read_into(stream, memoryview(bytearray(n)), "padding")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_entry(i: int, e: Any, body_bytes: int) -> tuple[torch.dtype, list[int], int, int, int]:
    if not (isinstance(e, list) and len(e) == 5 and isinstance(e[0], str)
            and isinstance(e[1], list) and all(_is_int(x) and x >= 0 for x in e[1])
            and all(_is_int(x) and x >= 0 for x in e[2:])):
        raise WireError(f"tensor {i}: bad entry {str(e)[:200]}")
    try:
        dtype = dtype_from_name(e[0], f"tensor {i}")
    except ValueError as exc:
        raise WireError(str(exc)) from None
    shape, offset, nbytes, crc = e[1], e[2], e[3], e[4]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if math.prod(shape) * itemsize != nbytes:
        raise WireError(f"tensor {i}: shape {shape} of {e[0]} is not {nbytes} bytes")
    if offset % _ALIGN or offset + nbytes > body_bytes:
        raise WireError(f"tensor {i}: bytes [{offset}, {offset + nbytes}) not aligned or "
                        f"outside the body of {body_bytes}")
    return dtype, shape, offset, nbytes, crc


def _rebuild(value: Any, tensors: list[torch.Tensor], used: set[int]) -> Any:
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            i = value[_TENSOR]
            if not _is_int(i) or not 0 <= i < len(tensors) or i in used:
                raise WireError(f"bad tensor reference {i!r}")
            used.add(i)
            return tensors[i]
        return {k: _rebuild(v, tensors, used) for k, v in value.items()}
    if isinstance(value, list):
        return [_rebuild(v, tensors, used) for v in value]
    if isinstance(value, tuple):
        return tuple(_rebuild(v, tensors, used) for v in value)
    return value
