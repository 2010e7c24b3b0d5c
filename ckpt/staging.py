"""Host staging buffers: the only part of a save that stalls the training loop.

``StagingBuffers.stage(state_dict)`` copies every tensor of a (possibly sharded) state dict
into host buffers that are allocated once and reused by every later save, so a save in
steady state allocates nothing. On CUDA the buffers are pinned and the copies are
non-blocking, with one synchronisation at the end. Non-tensor values are deep-copied (they
are small). DTensors keep their mesh and placements around the staged local shard, so
``torch.distributed.checkpoint`` plans the same chunks as for the live state.

Host memory added is about one copy of this rank's shard (buffers of tensors that are no
longer in the state are dropped at the next ``stage``). ``prepare`` allocates (and
touches) the buffers ahead of time, e.g. on a background thread right after the model is
built, so even the first save's stall is only the copy.

Loads borrow the same buffers (``borrow``) as scratch memory to read into before the
checksums are verified: one copy of the shard that exists anyway, already touched, instead
of fresh memory whose first touch costs about as much as the read.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch

__all__ = ["StagingBuffers"]


def _dtensor_cls():
    try:
        from torch.distributed.tensor import DTensor

        return DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None


class StagingBuffers:
    def __init__(self, pin_memory: bool | None = None):
        self.pin_memory = (torch.cuda.is_available() if pin_memory is None else pin_memory)
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.num_allocations = 0  # buffers allocated so far; flat in steady state

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def _buffer(self, path: tuple, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu",
                              pin_memory=self.pin_memory and torch.cuda.is_available())
            if buf.numel():
                buf.view(-1)[:: max(1, 4096 // max(1, buf.element_size()))].zero_()  # fault in
            self._buffers[path] = buf
            self.num_allocations += 1
        return buf

    def borrow(self, sizes: list[int]) -> list[torch.Tensor | None]:
        """Flat uint8 views of distinct buffers, one per requested byte size (best fit), or
        None where no unlent buffer is large enough.

        For scratch use between saves: the caller must not borrow while a save is staging
        or persisting from these buffers, and must drop the views before the next ``stage``.
        """
        with self._lock:
            free = sorted((b.numel() * b.element_size(), i, b)
                          for i, b in enumerate(self._buffers.values()))
        out: list[torch.Tensor | None] = [None] * len(sizes)
        import bisect

        keys = [f[0] for f in free]
        for j in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
            k = bisect.bisect_left(keys, sizes[j])
            if sizes[j] <= 0 or k == len(keys):
                continue
            buf = free[k][2]
            out[j] = buf.view(-1).view(torch.uint8)[: sizes[j]]
            del keys[k], free[k]
        return out

    def prepare(self, state_dict: Any) -> None:
        """Allocate buffers for every tensor in ``state_dict`` without copying data."""
        dtensor = _dtensor_cls()

        def visit(path: tuple, value: Any) -> None:
            if isinstance(value, torch.Tensor):
                local = value.to_local() if dtensor and isinstance(value, dtensor) else value
                with self._lock:
                    self._buffer(path, local)
            elif isinstance(value, dict):
                for k, v in value.items():
                    visit(path + (k,), v)
            elif isinstance(value, (list, tuple)):
                for i, v in enumerate(value):
                    visit(path + (i,), v)

        visit((), state_dict)

    def stage(self, state_dict: Any) -> tuple[Any, int]:
        """Copy ``state_dict`` into the buffers; returns (staged copy, tensor bytes staged)."""
        dtensor = _dtensor_cls()
        total = 0
        cuda_used = False
        seen: set[tuple] = set()

        def visit(path: tuple, value: Any) -> Any:
            nonlocal total, cuda_used
            if isinstance(value, torch.Tensor):
                is_d = dtensor is not None and isinstance(value, dtensor)
                local = value.to_local() if is_d else value
                local = local.detach()
                buf = self._buffer(path, local)
                seen.add(path)
                non_blocking = local.device.type == "cuda" and buf.is_pinned()
                cuda_used |= local.device.type == "cuda"
                buf.copy_(local, non_blocking=non_blocking)
                total += buf.numel() * buf.element_size()
                if is_d:
                    return dtensor.from_local(buf, value.device_mesh, value.placements,
                                              run_check=False, shape=value.shape,
                                              stride=value.stride())
                return buf
            if isinstance(value, dict):
                return {k: visit(path + (k,), v) for k, v in value.items()}
            if isinstance(value, list):
                return [visit(path + (i,), v) for i, v in enumerate(value)]
            if isinstance(value, tuple):
                return tuple(visit(path + (i,), v) for i, v in enumerate(value))
            return copy.deepcopy(value)

        with self._lock:
            staged = visit((), state_dict)
            for path in [p for p in self._buffers if p not in seen]:
                del self._buffers[path]  # the state no longer has this tensor
        if cuda_used:
            torch.cuda.synchronize()
        return staged, total
