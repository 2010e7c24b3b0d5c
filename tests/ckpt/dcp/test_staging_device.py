"""Staging's CUDA calls off the training thread run on the rank's own device, never GPU 0.

The CUDA runtime keeps a current device per host thread, and a thread that never selected
one is on device 0. The page locking of the staging arena (``cudaHostRegister``, through a
binding with no device guard) and the waits for the copies' events (``cudaEventSynchronize``,
``cudaEventQuery``) act on the calling thread's current device: called from the manager's
persist thread of a rank whose GPU is not 0, they would create a CUDA context on GPU 0 in
that rank's process (hundreds of MB each, one per rank of the node).

No GPU here, so the real staging and manager code runs its CUDA branch against a recorder:
CUDA's few entry points that the code reaches (the device selection, the runtime binding,
streams and events, stream and device synchronisation) are replaced by stand-ins that keep
a current device per thread, as the runtime does, and note which device was current at
each call. With a writer process, these calls are the training process's (the writer is
started with no GPU visible). The tensors are CPU tensors that report a CUDA device
(``_on_device``), so the data is really copied and the checkpoint really written. What the code calls, on which thread, is what it does on a GPU.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from ckpt.dcp import StagingBuffers
from ckpt.dcp.staging import CopyReady
from ckpt.dcp._host_arena import HostArena
from ckpt.job import CheckpointManager, ManagerOptions

pytestmark = pytest.mark.timeout(60)

RANK_DEVICE = 1  # the GPU of a rank that is not the node's first


class _Runtime:
    """CUDA as the staging code reaches it, recorded. ``calls``: (entry point, thread name,
    current device of that thread) for every call that acts on the current device; the
    calls torch guards itself (those given a device or a stream) are noted under the device
    torch would select."""

    def __init__(self, monkeypatch):
        self._local = threading.local()
        self.calls: list[tuple[str, str, int]] = []
        self.registered: dict[int, int] = {}
        self._lock = threading.Lock()
        runtime = self

        class Stream:
            def __init__(self, device=None, priority: int = 0):
                self.device = torch.device("cuda", runtime._index(device))
                runtime.note("cudaStreamCreate", self.device.index)

            def wait_stream(self, other):
                runtime.note("cudaStreamWaitEvent", self.device.index)

            def wait_event(self, event):
                runtime.note("cudaStreamWaitEvent", self.device.index)

            def synchronize(self) -> None:
                runtime.note("cudaStreamSynchronize", self.device.index)  # torch guards it

            def query(self) -> bool:
                runtime.note("cudaStreamQuery", self.device.index)  # torch guards it
                return True

        class Event:
            def __init__(self, enable_timing: bool = False):
                self.device: torch.device | None = None
                self.ms = 0.0

            def record(self, stream=None):
                stream = stream if stream is not None else runtime.current_stream()
                self.device = stream.device
                self.ms = time.perf_counter() * 1e3
                runtime.note("cudaEventRecord", self.device.index)

            def query(self) -> bool:
                runtime.note("cudaEventQuery")  # no guard in torch: the current device
                return True

            def synchronize(self) -> None:
                runtime.note("cudaEventSynchronize")  # no guard in torch either

            def elapsed_time(self, end) -> float:
                runtime.note("cudaEventElapsedTime", self.device.index)  # torch guards it
                return max(end.ms - self.ms, 0.0)

        class StreamContext:
            """``torch.cuda.stream(s)``: selects the stream's device while it is current."""

            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                self.prev = runtime.current_device()
                runtime.set_device(self.stream.device)

            def __exit__(self, *exc):
                runtime.set_device(self.prev)

        class DeviceContext:
            """``torch.cuda.device(d)``: selects ``d``, then the previous device again."""

            def __init__(self, device):
                self.idx = runtime._index(device)

            def __enter__(self):
                self.prev = runtime.current_device()
                runtime.set_device(self.idx)

            def __exit__(self, *exc):
                runtime.set_device(self.prev)

        self.Stream, self.Event = Stream, Event
        for name, value in {
            "is_available": lambda: True,
            "current_device": self.current_device,
            "set_device": self.set_device,
            "device": DeviceContext,
            "cudart": lambda: self,
            "Stream": Stream,
            "Event": Event,
            "current_stream": self.current_stream,
            "stream": StreamContext,
            "synchronize": self.synchronize,
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)

    # -- the per-thread current device ---------------------------------------------------------
    def current_device(self) -> int:
        return getattr(self._local, "device", 0)  # a thread that never selected one: 0

    def set_device(self, device) -> None:
        self._local.device = self._index(device)

    def _index(self, device) -> int:
        if device is None:
            return self.current_device()
        if isinstance(device, (str, torch.device)):
            device = torch.device(device)
            assert device.type == "cuda", device
            return device.index if device.index is not None else self.current_device()
        return int(device)

    def current_stream(self, device=None):
        return self.Stream(device)

    def synchronize(self, device=None) -> None:
        """``torch.cuda.synchronize``: the given device, else the thread's current one."""
        self.note("cudaDeviceSynchronize", None if device is None else self._index(device))

    def note(self, call: str, device: int | None = None) -> None:
        with self._lock:
            self.calls.append((call, threading.current_thread().name,
                               self.current_device() if device is None else device))

    # -- the runtime binding (``torch.cuda.cudart()``) -----------------------------------------
    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802
        self.note("cudaHostRegister")
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.note("cudaHostUnregister")
        return 0 if self.registered.pop(ptr, None) is not None else 1

    # -- what the tests ask --------------------------------------------------------------------
    def devices(self, call: str) -> list[tuple[str, int]]:
        """(thread, current device) of each call of ``call``, in order."""
        return [(thread, device) for c, thread, device in self.calls if c == call]

    def wait_for(self, call: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.devices(call):
            assert time.monotonic() < deadline, f"no {call} within {timeout} s: {self.calls}"
            time.sleep(0.01)


class _OnDevice(torch.Tensor):
    """A CPU tensor that says it lives on the rank's GPU (its data is copied for real);
    ``record_stream`` is noted instead of handed to a caching allocator it is not in."""

    runtime: _Runtime

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", RANK_DEVICE)

    @property
    def is_cuda(self) -> bool:
        return True

    def record_stream(self, stream) -> None:
        type(self).runtime.note("recordStream", stream.device.index)


@pytest.fixture
def runtime(monkeypatch):
    rt = _Runtime(monkeypatch)
    monkeypatch.setattr(_OnDevice, "runtime", rt, raising=False)
    return rt


def _on_device(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(_OnDevice)


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": _on_device(torch.randn(64, 16, generator=g)),
                      "b": _on_device(torch.randn(16, generator=g).bfloat16())},
            "step": 3}


def _plain(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.as_subclass(torch.Tensor).clone() for k, v in state["model"].items()}


def _assert_all_on_the_rank_device(runtime: _Runtime) -> None:
    wrong = [c for c in runtime.calls if c[2] != RANK_DEVICE]
    assert not wrong, f"CUDA calls under another device than {RANK_DEVICE}: {wrong}"


def _writer_environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv]
    return {k.decode(): v.decode() for k, v in pairs}


@pytest.mark.parametrize("writer,prepared", [("thread", False), ("thread", True),
                                             ("process", False)],
                         ids=["executor_prepare", "prepare", "writer_process"])
def test_a_rank_off_gpu_0_makes_every_cuda_call_on_its_own_device(runtime, tmp_path,
                                                                   writer, prepared):
    """The trainer's order: select the rank's GPU on the main thread, build the manager,
    then save. Without ``prepare()`` the first ``maybe_save`` allocates (and page-locks)
    the buffers on the persist thread; either way the persist thread waits for the copies
    and ``close`` unlocks the buffers. With a writer process the same calls are the
    training process's (the shared block page-locked, the events waited for before the
    hand-off), and the writer, which makes none, sees no GPU."""
    torch.cuda.set_device(RANK_DEVICE)
    state = _state()
    expected = _plain(state)
    mgr = CheckpointManager(str(tmp_path / "r"),
                            ManagerOptions(use_lease=False, writer=writer), cadence="2")
    try:
        if prepared:
            mgr.prepare(state)
        assert not mgr.maybe_save(1, state)  # not due; without prepare() it starts one
        runtime.wait_for("cudaHostRegister")
        assert mgr.maybe_save(2, state)
        mgr.wait()
        assert mgr.events.of_kind("save_committed")[-1].fields["copy_seconds"] is not None
        if writer == "process":
            assert mgr.staging.shared_path is not None  # the block the writer maps
            assert _writer_environ(mgr._persister.pid).get("CUDA_VISIBLE_DEVICES") == ""
    finally:
        mgr.close()
    (register,) = runtime.devices("cudaHostRegister")
    assert register[0].startswith("MainThread" if prepared else "ckpt-persist"), register
    assert any(t.startswith("ckpt-persist") for t, _ in runtime.devices("cudaEventSynchronize"))
    assert len(runtime.devices("cudaHostUnregister")) == 1 and not runtime.registered
    _assert_all_on_the_rank_device(runtime)
    loaded = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}, "step": 0}
    with CheckpointManager(str(tmp_path / "r"), ManagerOptions(use_lease=False)) as reader:
        reader.load_latest(loaded)
    for k, v in expected.items():
        assert torch.equal(loaded["model"][k], v), k


def test_staging_keeps_to_its_tensors_device_on_any_thread(runtime):
    """A thread on device 0 (one that never selected a device, or the main thread of a
    program that addresses its GPU only through its tensors) stages, waits and closes:
    every call still goes to the tensors' device."""
    state = _state()
    staging = StagingBuffers()
    staged, nbytes = staging.stage(state)
    assert staging.pinned and staging.device == torch.device("cuda", RANK_DEVICE)
    assert runtime.current_device() == 0  # stage left the thread's device as it was

    done: list[float | None] = []
    worker = threading.Thread(target=lambda: done.append(staging.wait_ready()),
                              name="ckpt-persist-probe")
    worker.start()
    worker.join(20)
    assert done and done[0] is not None and staging.ready.done()
    for k, v in _plain(state).items():
        assert torch.equal(staged["model"][k], v), k
    del staged
    staging.close()
    assert not runtime.registered and runtime.devices("cudaHostUnregister")
    assert ("cudaEventSynchronize", "ckpt-persist-probe", RANK_DEVICE) in runtime.calls
    _assert_all_on_the_rank_device(runtime)


def test_an_arena_dropped_on_another_thread_unlocks_on_its_own_device(runtime):
    """The page lock of an arena nobody released goes when the arena is collected, on
    whichever thread that happens."""
    arena = HostArena([4096], pin_on=torch.device("cuda", RANK_DEVICE))
    assert arena.pinned and runtime.registered

    def drop():
        nonlocal arena
        arena = None

    worker = threading.Thread(target=drop, name="collector")
    worker.start()
    worker.join(20)
    assert not runtime.registered
    assert runtime.devices("cudaHostUnregister") == [("collector", RANK_DEVICE)]
    _assert_all_on_the_rank_device(runtime)


def test_a_state_of_cpu_tensors_is_neither_pinned_nor_tied_to_a_device(runtime):
    """Nothing to copy from a device: synchronous copies into unpinned memory, and no CUDA
    call on any device."""
    staging = StagingBuffers()
    staged, _ = staging.stage({"w": torch.arange(6.0)})
    assert not staging.pinned and staging.device is None and staging.ready is None
    assert torch.equal(staged["w"], torch.arange(6.0))
    staging.close()
    assert runtime.calls == []


def test_copy_ready_waits_on_every_device_under_it_and_reports_the_slowest(runtime):
    events = []
    for index, (a, b) in ((0, (0.0, 40.0)), (2, (10.0, 130.0))):
        start, end = runtime.Event(True), runtime.Event(True)
        start.record(runtime.Stream(index))
        end.record(runtime.Stream(index))
        start.ms, end.ms = a, b
        events.append((torch.device("cuda", index), start, end))
    runtime.set_device(1)  # a thread on neither device
    ready = CopyReady(events)
    assert ready.done()
    assert ready.wait() == pytest.approx(0.12)
    assert ready.wait() == pytest.approx(0.12)  # idempotent: waited once
    assert runtime.devices("cudaEventSynchronize") == [("MainThread", 0), ("MainThread", 2)]
    assert [d for _, d in runtime.devices("cudaEventQuery")] == [0, 2]
    assert runtime.current_device() == 1  # the thread's own device is left as it was
