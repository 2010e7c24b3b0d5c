"""The staging buffers live in one host arena: one allocation per layout, the sum of the
shards each aligned (no power-of-two rounding), disjoint typed views, rebuilt when the
tensors change, freed by ``close``.

On CUDA the arena is page-locked in place; here it is not pinned, but it is the same code
path (and the page locking is checked against a stand-in for the CUDA runtime).
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import logging
import os
import subprocess
import uuid

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ckpt.dcp import StagingBuffers
from ckpt.dcp._host_arena import (
    ALIGN_BYTES,
    HostArena,
    _shared_directory,
    aligned_bytes,
    remove_stale_shared_blocks,
)
from ckpt.job import CheckpointManager, ManagerOptions
from tests.ckpt._helpers import assert_same

pytestmark = pytest.mark.timeout(120)

_FLOAT8 = [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
           if d is not None]


def _mixed_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {
        "bf16": torch.randn(7, 3, generator=g).bfloat16(),
        "fp32": torch.randn(33, generator=g),
        "int64": torch.randint(-2**40, 2**40, (5,), generator=g),
        "bool": torch.rand(11, generator=g) > 0.5,
        "uint8": torch.randint(0, 256, (13,), dtype=torch.uint8, generator=g),
        "complex64": torch.randn(6, generator=g, dtype=torch.complex64),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "transposed": torch.randn(4, 6, generator=g).t(),  # a non-contiguous source
        "nested": {"list": [torch.randn(3, generator=g), torch.zeros(0, dtype=torch.int32)]},
        "step": 12,
    }
    for dtype in _FLOAT8:
        state[str(dtype).removeprefix("torch.")] = torch.randn(9, generator=g).to(dtype)
    return state


def _tensors(state: dict) -> list[torch.Tensor]:
    out = []
    for v in state.values():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            out += _tensors(v)
        elif isinstance(v, list):
            out += _tensors(dict(enumerate(v)))
    return out


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Factories(TorchDispatchMode):
    """Counts tensor factory calls (allocations of new memory)."""

    def __init__(self):
        super().__init__()
        self.num_empty = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__.startswith(("empty", "zeros", "ones", "full")):
            self.num_empty += 1
        return func(*args, **(kwargs or {}))


def test_one_allocation_for_the_whole_state_of_the_aligned_size():
    state = _mixed_state()
    staging = StagingBuffers(pin_memory=False)
    factories = _Factories()
    with factories:
        staging.prepare(state)
    assert factories.num_empty == 1, factories.num_empty  # not one per tensor
    assert staging.num_allocations == 1
    sizes = [_bytes(t) for t in _tensors(state)]
    assert staging.nbytes == sum(sizes)
    assert staging.arena_bytes == sum(aligned_bytes(n) for n in sizes)
    assert staging.arena_bytes & (staging.arena_bytes - 1)  # this sum is no power of two...
    storage_bytes = staging._arena.data.untyped_storage().nbytes()
    assert storage_bytes <= staging.arena_bytes + 2 * 4096  # ...and nothing rounds it up
    assert not staging.pinned  # no CUDA here: the same arena, not page-locked


def test_views_are_aligned_disjoint_and_inside_the_arena():
    staging = StagingBuffers(pin_memory=False)
    staging.prepare(_mixed_state())
    data = staging._arena.data
    lo, hi = data.data_ptr(), data.data_ptr() + data.numel()
    spans = []
    for path, buf in staging._buffers.items():
        assert buf.is_contiguous(), path
        if not buf.numel():
            continue  # zero bytes: torch gives it no address
        assert buf.untyped_storage().data_ptr() == data.untyped_storage().data_ptr(), path
        start = buf.data_ptr()
        assert start % ALIGN_BYTES == 0, path
        assert lo <= start and start + _bytes(buf) <= hi, path
        spans.append((start, start + _bytes(buf)))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_values_round_trip_bit_for_bit_for_mixed_dtypes():
    state = _mixed_state()
    staging = StagingBuffers(pin_memory=False)
    staged, nbytes = staging.stage(state)
    assert nbytes == sum(_bytes(t) for t in _tensors(state))
    assert_same(state, staged)
    # Staged again after the state changed: the same memory, the new values.
    state2 = _mixed_state(seed=1)
    ptrs = {p: b.data_ptr() for p, b in staging._buffers.items()}
    staged2, _ = staging.stage(state2)
    assert staging.num_allocations == 1
    assert {p: b.data_ptr() for p, b in staging._buffers.items()} == ptrs
    assert_same(state2, staged2)


def test_a_manager_persists_from_the_arena_and_loads_back(tmp_path):
    state = _mixed_state()
    with CheckpointManager(str(tmp_path / "r"), ManagerOptions(use_lease=False)) as mgr:
        assert mgr.save(1, state, block=True)
        assert mgr.staging.num_allocations == 1
    fresh = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v)
             for k, v in _mixed_state(seed=2).items()}
    fresh["nested"] = {"list": [torch.zeros(3), torch.zeros(0, dtype=torch.int32)]}
    fresh["transposed"] = torch.zeros(6, 4)
    with CheckpointManager(str(tmp_path / "r"), ManagerOptions(use_lease=False)) as mgr:
        assert mgr.load_latest(fresh).step == 1  # reads into the borrowed arena
    assert_same({k: (v.contiguous() if isinstance(v, torch.Tensor) else v)
                 for k, v in state.items()}, fresh)


def test_a_layout_change_rebuilds_and_the_same_layout_does_not():
    staging = StagingBuffers(pin_memory=False)
    state = {"a": torch.ones(64), "b": torch.ones(32, dtype=torch.float16)}
    staging.stage(state)
    arena = staging._arena
    staging.stage({"b": torch.zeros(32, dtype=torch.float16), "a": torch.zeros(64)})
    assert staging._arena is arena and staging.num_allocations == 1  # order does not matter
    for changed in ({"a": torch.ones(64), "b": torch.ones(33, dtype=torch.float16)},  # shape
                    {"a": torch.ones(64), "b": torch.ones(32, dtype=torch.bfloat16)},  # dtype
                    {"a": torch.ones(64)},  # a tensor gone
                    {"a": torch.ones(64), "b": torch.ones(32), "c": torch.ones(1)}):  # new
        staged, _ = staging.stage(changed)
        assert staging._arena is not arena, changed
        arena = staging._arena
        assert_same(changed, staged)
        assert staging.arena_bytes == sum(aligned_bytes(_bytes(t)) for t in changed.values())
    assert staging.num_allocations == 5


def test_a_handoff_describes_the_tensors_once_per_layout_and_the_objects_each_time(
        monkeypatch):
    from ckpt.dcp import _shm

    described = []
    describe = _shm._describe_tensor
    monkeypatch.setattr(_shm, "_describe_tensor",
                        lambda fqn, *a: described.append(fqn) or describe(fqn, *a))
    staging, blocks = StagingBuffers(pin_memory=False, shared=True), _shm.SharedBlocks()
    try:
        for step, shape in ((1, 8), (2, 8), (3, 9), (4, 9)):
            state = {"m": {"w": torch.full((shape, 4), float(step)), "b": torch.arange(3) + step},
                     "extra": {"step": step}}
            staged, _ = staging.stage(state)
            got = _shm.rebuild_staged(json.loads(json.dumps(staging.handoff(staged))), blocks)
            assert_same(state, got)  # the objects of this save, the tensors of this layout
            # Described at the first save of each layout (a new shape: a new arena) only.
            assert described == ["m.w", "m.b"] * (1 if step < 3 else 2), (step, described)
    finally:
        blocks.close()
        staging.close()


def test_close_frees_the_arena_and_a_later_stage_allocates_again():
    staging = StagingBuffers(pin_memory=False)
    staged, _ = staging.stage(_mixed_state())
    storage = staging._arena.data.untyped_storage()
    del staged
    staging.close()
    assert staging._buffers == {} and staging._arena is None
    assert staging.nbytes == 0 and staging.arena_bytes == 0
    assert staging.borrow([64]) == [None]
    gc.collect()
    # No tensor views the arena's memory any more: the probe is its only owner.
    assert torch._C._storage_Use_Count(storage._cdata) == 1
    staged, _ = staging.stage({"a": torch.ones(3)})
    assert staging.num_allocations == 2 and torch.equal(staged["a"], torch.ones(3))


def test_a_manager_close_frees_its_staging_buffers(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "r"), ManagerOptions(use_lease=False))
    assert mgr.save(1, _mixed_state(), block=True)
    assert mgr.staging.arena_bytes > 0 and mgr.last_staged is not None
    mgr.close()
    assert mgr.staging.arena_bytes == 0 and mgr.staging.nbytes == 0
    assert mgr.last_staged is None


def test_a_tiered_manager_close_frees_both_tiers_buffers(tmp_path):
    from ckpt.job import ManagerOptions, TieredCheckpointManager

    state = _mixed_state()
    mgr = TieredCheckpointManager(str(tmp_path / "durable"), str(tmp_path / "local"),
                                  ManagerOptions(use_lease=False))
    mgr.prepare(state)  # one arena per tier
    shard = sum(aligned_bytes(_bytes(t)) for t in _tensors(state))
    assert mgr.durable.staging.arena_bytes == mgr.local.staging.arena_bytes == shard
    assert mgr.save(1, state, block=True)  # both tiers: the local one persists the durable copy
    assert mgr.local.num_stages == 0 and mgr.durable.num_stages == 1
    mgr.close()
    assert mgr.durable.staging.arena_bytes == mgr.local.staging.arena_bytes == 0


def test_borrow_lends_disjoint_aligned_pieces_of_the_arena():
    staging = StagingBuffers(pin_memory=False)
    assert staging.borrow([8, 16]) == [None, None]  # nothing allocated yet
    staging.prepare({"a": torch.ones(1000), "b": torch.ones(10, dtype=torch.uint8)})
    total = staging._arena.data.numel()  # 4000 + 10 bytes, in two aligned slots
    lent = staging.borrow([10, 4000, 0, total + 1])
    assert lent[2] is None and lent[3] is None  # nothing to lend / larger than the arena
    assert lent[1].numel() == 4000 and lent[0].numel() == 10  # the two that fit
    assert all(t.dtype == torch.uint8 and t.data_ptr() % ALIGN_BYTES == 0 for t in lent[:2])
    assert lent[1].data_ptr() + 4000 <= lent[0].data_ptr()  # largest first, no overlap


class _FakeCudart:
    """The two CUDA runtime calls the arena makes, recorded."""

    def __init__(self, error: int = 0):
        self.error = error
        self.registered: dict[int, int] = {}
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 - CUDA's name
        self.calls.append(("register", ptr, nbytes, flags))
        if not self.error:
            self.registered[ptr] = nbytes
        return self.error

    def cudaHostUnregister(self, ptr):  # noqa: N802 - CUDA's name
        self.calls.append(("unregister", ptr))
        return 0 if self.registered.pop(ptr, None) is not None else 1


@pytest.fixture
def cudart(monkeypatch):
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    # The arena's calls run under its device (tests/ckpt/dcp/test_staging_device.py checks
    # which); here only what they do counts.
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return fake


_GPU = torch.device("cuda", 0)


def test_a_pinned_arena_locks_exactly_its_pages_in_place_and_unlocks_on_release(cudart):
    arena = HostArena([10, 5000, 0, 3], pin_on=_GPU)
    assert arena.pinned and not arena.from_pinned_cache
    ((_, ptr, nbytes, _),) = cudart.calls
    assert ptr == arena.data.data_ptr() and ptr % 4096 == 0
    assert nbytes == aligned_bytes(arena.nbytes, 4096) == 8192  # whole pages, no power of two
    arena.release()
    assert cudart.calls[-1] == ("unregister", ptr) and not cudart.registered
    assert arena.nbytes == 0 and not arena.pinned
    arena.release()  # once only
    assert len(cudart.calls) == 2


def test_a_pinned_arena_dropped_without_release_is_unlocked_first(cudart):
    arena = HostArena([100], pin_on=_GPU)
    view = arena.view(0, (25,), torch.float32)
    del arena
    gc.collect()
    assert not cudart.registered  # unlocked, while ``view`` still keeps the memory
    view.fill_(1.0)


def test_an_arena_is_pinned_for_a_cuda_device_only(cudart):
    with pytest.raises(ValueError, match="pin_on=cpu"):
        HostArena([100], pin_on=torch.device("cpu"))
    assert not HostArena([100]).pinned and not cudart.calls


def test_stale_shared_blocks_of_dead_processes_go_and_live_ones_stay(caplog):
    """A shared block is named after its owner's pid, which holds its flock while it lives;
    only a block of a dead pid that nobody holds, of this user, is removed."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    d, tag = _shared_directory(), uuid.uuid4().hex[:8]
    stale = f"{d}/ckpt-staging-{dead.pid}-s{tag}"
    of_live = f"{d}/ckpt-staging-{live.pid}-s{tag}"
    held = f"{d}/ckpt-staging-{dead.pid}-h{tag}"  # a live owner in another pid namespace
    unnamed = f"{d}/ckpt-staging-s{tag}"  # no pid in its name: never ours to judge
    paths = [stale, of_live, held, unnamed]
    for path in paths:
        with open(path, "wb") as f:
            f.write(b"x" * 100)
    holder = os.open(held, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_SH)
    arena = HostArena([4096], shared=True)
    try:
        assert os.path.basename(arena.path).startswith(f"ckpt-staging-{os.getpid()}-")
        with caplog.at_level(logging.WARNING, logger="ckpt.dcp._host_arena"):
            removed = remove_stale_shared_blocks()
        assert stale in removed and not os.path.exists(stale)
        assert all(os.path.exists(p) for p in (of_live, held, unnamed, arena.path)), removed
        assert f"{stale} (0 MiB) of process {dead.pid}, which is gone" in caplog.text
    finally:
        os.close(holder)
        live.kill()
        live.wait()
        arena.release()
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
