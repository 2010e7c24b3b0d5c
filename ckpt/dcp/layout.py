"""How tensors become a data file's bytes and back, shared by the DCP writer and reader.

A data file (``r<rank>_<save_id>_<k>.bin``, named by :mod:`ckpt.dcp.writer`) is its items'
bytes packed back to back: no header, no padding, each tensor's elements in native byte
order. The manifest's ``ItemLocation`` (file, offset, length, crc32c) finds each item
(``docs/format.md``). :func:`tensor_view_bytes` is the writer's direction,
:func:`tensor_from_bytes` the reader's.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from ckpt.errors import CorruptCheckpointError
from ckpt.format import ItemLocation

__all__ = ["tensor_view_bytes", "buffer_nbytes", "tensor_from_bytes"]


def tensor_view_bytes(t: torch.Tensor) -> Any:
    """A zero-copy uint8 view of a CPU tensor's bytes (copying only if not contiguous/CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def buffer_nbytes(buf: Any) -> int:
    """The byte length of an item's buffer (an array view or ``bytes``)."""
    return int(buf.nbytes) if hasattr(buf, "nbytes") else len(buf)


def tensor_from_bytes(piece: memoryview, dtype: torch.dtype, where: str, loc: ItemLocation
                      ) -> torch.Tensor:
    """A flat ``dtype`` tensor of ``piece``'s bytes: a view when its address suits the
    dtype's alignment, else an aligned copy (never a misaligned tensor).

    ``piece`` holds the item ``loc`` of the file ``where`` (named in the error when its
    length is not a whole number of elements).
    """
    size = dtype.itemsize
    if len(piece) % size:
        raise CorruptCheckpointError(
            f"{where} bytes [{loc.offset}, {loc.offset + loc.length}): {len(piece)} bytes is "
            f"not a whole number of {dtype} elements; the manifest is corrupt. Load an "
            f"earlier step.", path=where)
    if not len(piece):
        return torch.empty(0, dtype=dtype)
    array = np.frombuffer(piece, dtype=np.uint8)
    if array.ctypes.data % size:
        aligned = torch.empty(len(piece), dtype=torch.uint8)
        aligned.numpy()[:] = array
        return aligned.view(dtype)
    if not piece.readonly:
        return torch.frombuffer(piece, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only bytes: only ever copied from
        return torch.frombuffer(piece, dtype=dtype)
