"""Host staging buffers: the only part of a save that stalls the training loop.

``StagingBuffers.stage(state_dict)`` copies every tensor of a (possibly sharded) state dict
into host buffers that are allocated once and reused by every later save. Non-tensor
values are deep-copied (they are small).

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

The buffers are typed views into one host arena (:mod:`ckpt.dcp._host_arena`): one allocation
of the sum of this rank's shards, each slot aligned to 512 bytes, pinned when the state has
CUDA tensors (page-locked in place: not rounded up to a power of two as torch's pinned
allocator rounds each block; a state of CPU tensors only is copied synchronously and gains
nothing from pinned memory).
It is reused by every later save while the state keeps its tensors (same paths, shapes and
dtypes), so a save in steady state allocates nothing; it is built anew, once, when they
change; ``close()`` frees it. Host memory: about one copy of this rank's shard. ``prepare``
allocates (and touches) the arena ahead of time, e.g. on a background thread right after
the model is built, so even the first save's stall is only the copy.

Device: the buffers remember the CUDA device of the tensors they hold (``device``, the first
one's where there are several), and every CUDA call they make off the training thread runs
under ``torch.cuda.device`` of its device: the arena's page locking and unlocking (the
first ``prepare`` may run on the manager's persist thread) and ``CopyReady``'s event waits
(the persist thread waits for the copies). A thread that never selected a device starts on
device 0, and these calls have no device guard of their own: without it every rank would
create a CUDA context (hundreds of MB) on GPU 0. ``stage`` itself runs on the training
thread and names the device of every stream and event it uses.

Loads borrow the same memory (``borrow``) as scratch to read into before the checksums are
verified: one copy of the shard that exists anyway, already touched, instead of fresh
memory whose first touch costs about as much as the read.

Shared (``shared=True``): the arena is in shared memory (``/dev/shm``) and a staged copy can
be handed to another process, the manager's writer process, as a JSON description of where
each tensor lies (:meth:`StagingBuffers.handoff`, :mod:`ckpt.dcp._shm`): the other process
maps the same pages, nothing is copied or pickled. The arena is reused by every save as
above and its file is removed by ``close()``. Shared memory is not pinned by CUDA's
allocator fallback: where page-locking it in place fails, device copies are synchronous.

Budget (``budget_bytes``): the host memory a save may take for the state's copy. When the
state's tensors fit, nothing changes. When they do not, the arena holds the tensors that
fit, in state order, into ``budget_bytes - window_bytes``, and the others are not copied:
the staged copy holds the live tensors themselves (``unstaged_bytes`` says how many bytes),
which the writer reads while the caller waits (the save is no longer asynchronous: a
``CheckpointManager`` blocks until it is committed), CPU tensors in place and device tensors
through host copies of at most ``window_bytes`` at a time. So a state larger than the
budget is saved in pieces, never with more host memory than the budget (an item larger than
the window excepted: it is copied whole); the stall grows to the whole save.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch

from ckpt.dcp._host_arena import HostArena, aligned_bytes
from ckpt.dcp._shm import describe_staged

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
    device's, measured between two CUDA events around the copies).

    ``events``: (device, start, end) per device. Any thread may call ``done`` and ``wait``:
    each event is queried and waited for under ``torch.cuda.device(device)``, never under
    the calling thread's current device (see the module docstring)."""

    def __init__(self, events: list[tuple[torch.device, Any, Any]]):
        self._events = events
        self._seconds: float | None = None

    def done(self) -> bool:
        """True when every copy has finished (never blocks)."""
        for device, _, end in self._events:
            with torch.cuda.device(device):
                if not end.query():
                    return False
        return True

    def wait(self) -> float:
        if self._seconds is None:
            slowest_ms = 0.0
            for device, start, end in self._events:
                with torch.cuda.device(device):
                    end.synchronize()
                    slowest_ms = max(slowest_ms, start.elapsed_time(end))
            self._seconds = slowest_ms / 1e3
        return self._seconds


class StagingBuffers:
    """The host copy of one rank's state for saves (see the module docstring).

    Used by one saving thread at a time: ``stage``, ``borrow`` and ``close`` wait for the
    previous stage's copies; ``prepare`` may run on another thread (it takes the lock).
    ``pin_memory`` (default: whether CUDA is available): pin the buffers when the state has
    CUDA tensors. ``budget_bytes``: the most host memory a save of the state may take (the
    module docstring; None: no bound, the arena holds the whole shard). ``shared``: keep the
    buffers in shared memory, for :meth:`handoff` to another process (module docstring).
    """

    def __init__(self, pin_memory: bool | None = None, budget_bytes: int | None = None,
                 shared: bool = False):
        if budget_bytes is not None and (isinstance(budget_bytes, bool)
                                         or not isinstance(budget_bytes, int)
                                         or budget_bytes <= 0):
            raise ValueError(f"staging_budget_bytes={budget_bytes!r}: expected a positive "
                             f"number of bytes (e.g. 8 << 30), or None for no bound")
        self.budget_bytes = budget_bytes
        self.shared = shared
        # Tensor bytes of the state the arena does not hold (0: the whole state is staged).
        self.unstaged_bytes = 0
        self.pin_memory = (torch.cuda.is_available() if pin_memory is None else pin_memory)
        self._arena: HostArena | None = None
        self._layout: dict[tuple, tuple[tuple[int, ...], torch.dtype]] = {}  # path -> slot
        self._buffers: dict[tuple, torch.Tensor] = {}  # path -> its typed view of the arena
        self._lock = threading.Lock()
        self.num_allocations = 0  # host allocations so far (one per layout); flat when steady
        self._streams: dict[torch.device, Any] = {}  # the side stream of each CUDA device
        # The last stage's pending device-to-host copies (None: nothing pending, e.g. CPU).
        self.ready: CopyReady | None = None
        # What ``handoff`` described of the tensors already, by flattened key, and the
        # DTensor specs it holds for: kept while the arena, its layout and the specs stay.
        self._described: dict[str, dict[str, Any]] = {}
        self._specs: dict[tuple, Any] = {}

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
            events.append((device, start, end))
        return CopyReady(events)

    @property
    def window_bytes(self) -> int | None:
        """The most bytes of unstaged device tensors the writer may hold on the host at
        once (a quarter of the budget; None without a budget, or when the state fits)."""
        if self.budget_bytes is None or not self.unstaged_bytes:
            return None
        return _window(self.budget_bytes)

    @property
    def device(self) -> torch.device | None:
        """The CUDA device the buffers are pinned for: that of the state's (first) CUDA
        tensor; None when not pinned."""
        return self._arena.device if self._arena is not None and self._arena.pinned else None

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors the buffers hold (the state's shard, without padding)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    @property
    def arena_bytes(self) -> int:
        """Bytes of host memory held: the tensors, each slot aligned (0 after ``close``)."""
        return self._arena.nbytes if self._arena is not None else 0

    @property
    def pinned(self) -> bool:
        """Whether the buffers are page-locked (device-to-host copies are asynchronous)."""
        return self._arena is not None and self._arena.pinned

    def _fit(self, tensors: list[tuple[tuple, torch.Tensor]]) -> None:
        """Make the buffers hold ``tensors`` (path, local tensor), all of them or, over the
        budget, those that fit (the module docstring): the arena is kept while every path
        has the same shape and dtype, and built anew (one allocation) otherwise. The caller
        holds the lock."""
        layout = {path: (tuple(t.shape), t.dtype) for path, t in tensors}
        if layout == self._layout and self._arena is not None:
            return
        self._release()  # the old arena first: never two of them at once, as far as it can
        sizes = [t.numel() * t.element_size() for _, t in tensors]
        kept = list(range(len(tensors)))
        if self.budget_bytes is not None and \
                sum(aligned_bytes(n) for n in sizes) > self.budget_bytes:
            room, kept = self.budget_bytes - _window(self.budget_bytes), []
            for i, n in enumerate(sizes):
                if aligned_bytes(n) <= room:
                    kept.append(i)
                    room -= aligned_bytes(n)
        cuda = next((t.device for _, t in tensors if t.device.type == "cuda"), None)
        arena = HostArena([sizes[i] for i in kept], pin_on=cuda if self.pin_memory else None,
                          shared=self.shared)
        self.num_allocations += arena.nbytes > 0
        self._arena, self._layout = arena, layout
        self._described = {}
        self._buffers = {tensors[i][0]: arena.view(slot, tensors[i][1].shape, tensors[i][1].dtype)
                         for slot, i in enumerate(kept)}
        self.unstaged_bytes = sum(sizes) - sum(sizes[i] for i in kept)

    def _release(self) -> None:
        arena, self._arena = self._arena, None
        self._buffers, self._layout, self.unstaged_bytes = {}, {}, 0
        self._described = {}
        if arena is not None:
            arena.release()  # under its own device, whichever thread this is

    def close(self) -> None:
        """Free the buffers (``nbytes`` and ``arena_bytes`` become 0): the page lock now,
        the memory once no staged copy that views it is referenced any more (drop those
        first). A later ``prepare``/``stage`` allocates again."""
        self.wait_ready()
        with self._lock:
            self.ready = None
            self._release()
            self._streams.clear()

    def handoff(self, staged: Any) -> dict[str, Any]:
        """The JSON description of ``staged`` (the copy the last ``stage`` returned, its
        copies done: ``wait_ready()``) for another process that maps these shared buffers
        (:func:`ckpt.dcp._shm.describe_staged`; ``shared`` buffers only). Its tensors are
        described once per layout (a new arena, or a DTensor of another spec, describes
        them again); its objects at every call."""
        with self._lock:
            if self._arena is None or not self.shared:
                raise ValueError("StagingBuffers.handoff: the buffers are not shared (make "
                                 "them with shared=True) or hold nothing (stage first)")
            return describe_staged(staged, self._arena, self._described)

    @property
    def shared_path(self) -> str | None:
        """The file of the shared buffers (None when not shared, or nothing allocated)."""
        return self._arena.path if self._arena is not None else None

    def borrow(self, sizes: list[int]) -> list[torch.Tensor | None]:
        """Flat uint8 views of the buffers' memory, one per requested byte size, disjoint,
        each starting aligned (``ckpt.dcp._host_arena.ALIGN_BYTES``); None where what is left
        is too small (the largest requests are placed first).

        For scratch use between saves: the caller must not borrow while a save is staging
        or persisting from these buffers, and must drop the views before the next ``stage``.
        """
        self.wait_ready()  # no copy of the last stage may still land in a lent buffer
        with self._lock:
            data = self._arena.data if self._arena is not None else None
        out: list[torch.Tensor | None] = [None] * len(sizes)
        offset = 0
        for j in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
            n = sizes[j]
            if data is None or n <= 0 or offset + n > data.numel():
                continue
            out[j] = data[offset:offset + n]
            offset += aligned_bytes(n)
        return out

    def prepare(self, state_dict: Any) -> None:
        """Allocate the buffers for every tensor in ``state_dict`` without copying data."""
        tensors = [(path, local) for path, _, local in _tensor_leaves(state_dict)]
        with self._lock:
            self._fit(tensors)

    def stage(self, state_dict: Any) -> tuple[Any, int]:
        """Copy ``state_dict`` into the buffers; returns (staged copy, tensor bytes staged).

        CUDA tensors into pinned buffers: the copies are only enqueued (see the module
        docstring); ``wait_ready()`` before reading the staged tensors on the host. Over the
        budget, the tensors the arena does not hold stay the live ones in the staged copy
        (``unstaged_bytes`` > 0): the caller must not change them until the copy is saved.
        """
        dtensor = _dtensor_cls()
        leaves = _tensor_leaves(state_dict)
        pending: dict[torch.device, tuple[Any, Any]] = {}  # device -> (side stream, start)
        staged_at: dict[tuple, torch.Tensor] = {}
        specs: dict[tuple, Any] = {}  # path -> the spec of each DTensor
        total = 0
        self.wait_ready()  # the host reads these buffers no more (normally long done)
        with self._lock:
            self.ready = None
            self._fit([(path, local) for path, _, local in leaves])
            pinned = self._arena.pinned
            try:
                for path, value, local in leaves:
                    buf = self._buffers.get(path)
                    if buf is None:  # over the budget: saved from the live tensor
                        staged_at[path] = value.detach()
                        continue
                    if local.device.type == "cuda" and pinned:
                        side = self._side_stream(pending, local.device)
                        with torch.cuda.stream(side):
                            buf.copy_(local, non_blocking=True)
                        local.record_stream(side)  # its memory is not reused before the copy
                    else:  # CPU, or pageable buffers: a synchronous copy
                        buf.copy_(local)
                    total += buf.numel() * buf.element_size()
                    if dtensor is not None and isinstance(value, dtensor):
                        # The same spec (mesh, placements, global shape and stride) around
                        # the host buffer itself. Not ``DTensor.from_local``: it moves a
                        # local tensor to the mesh's device type, i.e. back to the GPU while
                        # the copy into it is still running (stale values, and a second
                        # copy of the shard on the device).
                        buf = dtensor(buf, value._spec, requires_grad=False)
                        specs[path] = value._spec
                    staged_at[path] = buf
                if specs != self._specs:  # resharded alike: its shards are described anew
                    self._specs, self._described = specs, {}
            finally:  # the training stream waits for whatever copy was issued, even on error
                if pending:
                    self.ready = self._fence(pending)
        return _rebuild(state_dict, (), staged_at), total


def _window(budget_bytes: int) -> int:
    """The writer's window of a state over ``budget_bytes`` (``window_bytes``)."""
    return max(1, budget_bytes // 4)


def _tensor_leaves(value: Any, path: tuple = ()) -> list[tuple[tuple, torch.Tensor, torch.Tensor]]:
    """(path, tensor, its local data: a DTensor's shard, detached) of every tensor in a
    nested dict/list/tuple, in order."""
    if isinstance(value, torch.Tensor):
        dtensor = _dtensor_cls()
        local = value.to_local() if dtensor is not None and isinstance(value, dtensor) else value
        return [(path, value, local.detach())]
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return []
    return [leaf for k, v in items for leaf in _tensor_leaves(v, path + (k,))]


def _rebuild(value: Any, path: tuple, staged_at: dict[tuple, torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by its staged copy; other leaves deep-copied."""
    if isinstance(value, torch.Tensor):
        return staged_at[path]
    if isinstance(value, dict):
        return {k: _rebuild(v, path + (k,), staged_at) for k, v in value.items()}
    if isinstance(value, list):
        return [_rebuild(v, path + (i,), staged_at) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(_rebuild(v, path + (i,), staged_at) for i, v in enumerate(value))
    return copy.deepcopy(value)
