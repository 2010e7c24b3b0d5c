"""Host staging buffers: the only part of a save that stalls the training loop.

``StagingBuffers.stage(state_dict)`` copies every tensor of a (possibly sharded) state dict
into host buffers that are allocated once and reused by every later save, so a save in
steady state allocates nothing. Non-tensor values are deep-copied (they are small).

On CUDA the buffers are pinned and ``stage`` does not wait for the copies: it issues them on
a side stream of its own (one per device, created once) after that stream waits for the
current (training) stream, and makes the current stream wait, on the device, for an event
recorded after them. So the host returns once the copies are enqueued, and the next kernel
of the training stream (an optimizer step that overwrites the parameters) cannot run before
they are done. Until then the buffers hold no data yet: whoever reads them on the host
calls ``wait_ready()`` first (the manager's persist thread does, before writing a byte).
The source tensors are marked as used by the side stream (``record_stream``), so the
caching allocator does not hand their memory out again before the copies finish. CPU
tensors are copied synchronously; a stage of CPU tensors only has nothing to wait for. A
staged DTensor is the live one's spec (mesh, placements, global shape and stride) around
the host buffer itself, so ``torch.distributed.checkpoint`` plans the same chunks as for
the live state, and nothing of it is moved back to the device.

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

__all__ = ["StagingBuffers", "CopyReady"]


def _dtensor_cls():
    try:
        from torch.distributed.tensor import DTensor

        return DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None


class CopyReady:
    """The device-to-host copies of one ``stage``: ``wait()`` blocks the calling thread
    until they are done and returns their duration on the device, in seconds (the slowest
    device's, measured between two CUDA events around the copies)."""

    def __init__(self, events: list[tuple[Any, Any]]):
        self._events = events  # (start, end) CUDA events, one pair per device
        self._seconds: float | None = None

    def done(self) -> bool:
        """True when every copy has finished (never blocks)."""
        return all(end.query() for _, end in self._events)

    def wait(self) -> float:
        if self._seconds is None:
            for _, end in self._events:
                end.synchronize()
            self._seconds = max(start.elapsed_time(end) for start, end in self._events) / 1e3
        return self._seconds


class StagingBuffers:
    def __init__(self, pin_memory: bool | None = None):
        self.pin_memory = (torch.cuda.is_available() if pin_memory is None else pin_memory)
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.num_allocations = 0  # buffers allocated so far; flat in steady state
        self._streams: dict[torch.device, Any] = {}  # the side stream of each CUDA device
        # The last stage's pending device-to-host copies (None: nothing pending, e.g. CPU).
        self.ready: CopyReady | None = None

    def wait_ready(self) -> float | None:
        """Block until the last ``stage``'s copies are in the buffers; call before reading
        them on the host. Returns the copies' device time in seconds, or None when that
        stage had no asynchronous copies (CPU tensors only). Cheap when already done."""
        ready = self.ready
        return ready.wait() if ready is not None else None

    def _side_stream(self, pending: dict, device: torch.device):
        """The side stream for ``device``, made to wait for the current stream (once per
        stage), with a timing event recorded on it before the first copy."""
        if device not in pending:
            side = self._streams.get(device)
            if side is None:
                side = self._streams[device] = torch.cuda.Stream(device=device)
            side.wait_stream(torch.cuda.current_stream(device))
            start = torch.cuda.Event(enable_timing=True)
            start.record(side)
            pending[device] = (side, start)
        return pending[device][0]

    @staticmethod
    def _fence(pending: dict) -> CopyReady:
        """After the copies: an event on each side stream, waited for by the device's
        current (training) stream on the device, not by the host."""
        events = []
        for device, (side, start) in pending.items():
            end = torch.cuda.Event(enable_timing=True)
            end.record(side)
            torch.cuda.current_stream(device).wait_event(end)
            events.append((start, end))
        return CopyReady(events)

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
        self.wait_ready()  # no copy of the last stage may still land in a lent buffer
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
        """Copy ``state_dict`` into the buffers; returns (staged copy, tensor bytes staged).

        CUDA tensors into pinned buffers: the copies are only enqueued (see the module
        docstring); ``wait_ready()`` before reading the staged tensors on the host.
        """
        dtensor = _dtensor_cls()
        total = 0
        seen: set[tuple] = set()
        pending: dict[torch.device, tuple[Any, Any]] = {}  # device -> (side stream, start)

        def visit(path: tuple, value: Any) -> Any:
            nonlocal total
            if isinstance(value, torch.Tensor):
                is_d = dtensor is not None and isinstance(value, dtensor)
                local = value.to_local() if is_d else value
                local = local.detach()
                buf = self._buffer(path, local)
                seen.add(path)
                if local.device.type == "cuda" and buf.is_pinned():
                    side = self._side_stream(pending, local.device)
                    with torch.cuda.stream(side):
                        buf.copy_(local, non_blocking=True)
                    local.record_stream(side)  # its memory is not reused before the copy
                else:  # CPU, or a pageable buffer: a synchronous copy
                    buf.copy_(local)
                total += buf.numel() * buf.element_size()
                if is_d:
                    # The same spec (mesh, placements, global shape and stride) around the
                    # host buffer itself. Not ``DTensor.from_local``: it moves a local tensor
                    # to the mesh's device type, i.e. back to the GPU while the copy into it
                    # is still running (stale values, and a second copy of the shard there).
                    return dtensor(buf, value._spec, requires_grad=False)
                return buf
            if isinstance(value, dict):
                return {k: visit(path + (k,), v) for k, v in value.items()}
            if isinstance(value, list):
                return [visit(path + (i,), v) for i, v in enumerate(value)]
            if isinstance(value, tuple):
                return tuple(visit(path + (i,), v) for i, v in enumerate(value))
            return copy.deepcopy(value)

        self.wait_ready()  # the host reads these buffers no more (normally long done)
        with self._lock:
            self.ready = None
            try:
                staged = visit((), state_dict)
            finally:  # the training stream waits for whatever copy was issued, even on error
                if pending:
                    self.ready = self._fence(pending)
            for path in [p for p in self._buffers if p not in seen]:
                del self._buffers[path]  # the state no longer has this tensor
        return staged, total
