"""Bytes between two ranks: one message out to a rank while one comes in from another.

``swap_bytes`` is the one point-to-point primitive of the store (the copies of a node's
local checkpoints on its neighbour, ``ckpt.job._copies``). Each message is its length
(one int64) and then its bytes, sent with ``isend`` and received with ``irecv`` on a gloo
group the caller owns and uses from one thread (never the training group): sending to one
rank and receiving from another at once, a ring of ranks swaps without deadlock, and a pair
of ranks swaps both ways.

Contract: for every message a rank sends to ``r``, rank ``r`` makes one call that receives
from it, in the same order. A side with nothing to send (or to receive) passes None and
the other side does not expect (or send) anything on that channel in that call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["swap_bytes", "CHUNK_BYTES"]

CHUNK_BYTES = 64 << 20
"""The largest message callers send: a file goes as messages of at most this many bytes
(a receiver holds a few in memory, and no message length nears a 32-bit limit)."""

_LENGTH_TAG, _DATA_TAG = 71, 72  # a message's length, then its bytes


def swap_bytes(group: Any, *, send_to: int | None, payload: torch.Tensor | None,
               recv_from: int | None) -> torch.Tensor | None:
    """Send ``payload`` (a 1-D uint8 CPU tensor) to global rank ``send_to`` while receiving
    one message from global rank ``recv_from``; returns it (a uint8 tensor; None when
    ``recv_from`` is None). Either side may be None: then nothing goes out, or comes in.
    Blocks until both are done (or raises: a peer that died fails the call after the
    group's timeout)."""
    sends = []
    if send_to is not None:
        if payload is None or payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError("swap_bytes sends a 1-D uint8 tensor")
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        sends.append(dist.isend(length, dst=send_to, group=group, tag=_LENGTH_TAG))
        if payload.numel():
            sends.append(dist.isend(payload, dst=send_to, group=group, tag=_DATA_TAG))
    received = None
    try:
        if recv_from is not None:
            length = torch.empty(1, dtype=torch.int64)
            dist.irecv(length, src=recv_from, group=group, tag=_LENGTH_TAG).wait()
            n = int(length[0])
            if n < 0:
                raise ValueError(f"rank {recv_from} announced a message of {n} bytes")
            received = torch.empty(n, dtype=torch.uint8)
            if n:
                dist.irecv(received, src=recv_from, group=group, tag=_DATA_TAG).wait()
    finally:
        for work in sends:
            work.wait()
    return received
