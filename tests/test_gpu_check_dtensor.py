"""The dtensor section of bench/gpu_check.py (bench/_gpu_dtensor.py), checked on CPU.

Its purpose is the GPU: staged DTensors of a CUDA mesh must be host copies of the live
shards and hold no GPU memory. Here its comparison is shown to catch each way a staged copy
can be wrong (a local tensor off the host, other bytes, other placements, a missing tensor,
GPU memory held); tests/test_gpu_check_harness.py runs the section itself on CPU ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.dist import run_ranks

BENCH = Path(__file__).resolve().parents[1] / "bench"

pytestmark = pytest.mark.timeout(300)


def _module():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import _gpu_dtensor

    return _gpu_dtensor


def _wrong_copies(rank: int, world: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from ckpt.dcp import StagingBuffers

    m = _module()
    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)]),
             "opt": {"step": torch.tensor(3.0)}}
    expected = m.host_snapshot(state)
    staged, _ = StagingBuffers(pin_memory=False).stage(state)
    out = {"right": m.compare(expected, staged, on_host=True)}
    local = staged["w"].to_local()
    local.view(-1)[0] += 1
    out["bytes"] = m.compare(expected, staged, on_host=True)
    local.view(-1)[0] -= 1
    on_device = DTensor.from_local(torch.empty(local.shape, device="meta"), mesh, [Shard(0)],
                                   run_check=False, shape=(4, 3), stride=(3, 1))
    out["off_host"] = m.compare(expected, {**staged, "w": on_device}, on_host=True)
    out["off_host_loaded"] = m.compare(expected, {**staged, "w": on_device}, on_host=False)
    replicated = DTensor.from_local(local, mesh, [Replicate()], run_check=False,
                                    shape=(4, 3), stride=(3, 1))
    out["placements"] = m.compare(expected, {**staged, "w": replicated}, on_host=True)
    out["missing"] = m.compare(expected, {"w": staged["w"]}, on_host=True)
    out["plain"] = m.compare(expected, {**staged, "w": local.clone()}, on_host=True)
    return out


def test_the_comparison_catches_each_kind_of_wrong_copy():
    out = run_ranks(_wrong_copies, 1, timeout=120)[0]
    assert out["right"] == []
    assert out["bytes"] == ["w: bytes differ from the source's"]
    assert out["off_host"] == ["w: staged on meta, not on the host"]
    assert out["off_host_loaded"] == []  # a load target may live on the device
    assert len(out["placements"]) == 1 and "placements" in out["placements"][0]
    assert out["missing"] == ["opt.step: missing (NoneType)"]
    assert out["plain"] == ["w: not a DTensor"]


def test_gpu_memory_held_by_a_staged_copy_is_a_problem():
    m = _module()
    mib = 1 << 20
    assert m.held_memory_problems(None, 64 * mib) == []        # no CUDA: not measured
    assert m.held_memory_problems(0, 64 * mib) == []
    assert m.held_memory_problems(mib // 2, 64 * mib) == []    # allocator noise
    (problem,) = m.held_memory_problems(64 * mib, 64 * mib)    # the whole copy on the GPU
    assert "64.0 MiB more GPU memory" in problem
