"""Staged DTensors hold the staging buffer itself, for every placement the trainer uses.

A staged DTensor must wrap the host buffer that ``stage`` copied into, never a copy of it:
on a CUDA mesh, ``DTensor.from_local`` would move that buffer back to the GPU while the
device-to-host copy into it is still running (stale values, checksummed and committed as
valid). Checked on real gloo ranks: FSDP2 (``Shard(0)``), tensor parallel (colwise
``Shard(0)``, rowwise ``Shard(1)``, ``Replicate`` biases), FSDP2 over TP (``_StridedShard``),
and, on one rank, DTensors whose mesh is a CUDA mesh while their shards are on the CPU: the
situation of a staged GPU state, reproduced without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks

pytestmark = pytest.mark.timeout(300)


def _leaves(value, path=()):
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(v, path + (k,))]
    return []


def _plan_chunks(state: dict) -> list:
    """What DCP's planner writes for ``state``: (key, chunk offsets, chunk sizes, size)."""
    from torch.distributed.checkpoint.default_planner import create_default_local_save_plan

    flat = {".".join(map(str, path)): v for path, v in _leaves(state)}
    plan = create_default_local_save_plan(flat, is_coordinator=False)
    return sorted((i.index.fqn, tuple(i.index.offset), tuple(i.tensor_data.chunk.sizes),
                   tuple(i.tensor_data.size)) for i in plan.items if i.tensor_data is not None)


def _check_staged(live: dict, staged: dict, buffers: dict) -> set[str]:
    """Every staged DTensor: the live spec around the very buffer, same values. Returns the
    placement kinds seen."""
    from torch.distributed.tensor import DTensor

    kinds = set()
    for path, value in _leaves(live):
        assert isinstance(value, DTensor), path
        out = staged
        for k in path:
            out = out[k]
        buf = buffers[path]
        assert type(out) is DTensor and out._local_tensor is buf, path
        assert out.to_local().untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert out.device_mesh is value.device_mesh and out.placements == value.placements
        assert out.shape == value.shape and out.stride() == value.stride(), path
        assert not out.requires_grad and out.to_local().device.type == "cpu"
        assert torch.equal(out.to_local(), value.to_local()), path
        kinds |= {type(p).__name__ + (f"({p.dim})" if hasattr(p, "dim") else "")
                  for p in value.placements}
    assert _plan_chunks(staged) == _plan_chunks(live)
    return kinds


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))


def _every_layout_body(rank: int, world: int, root: str) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from ckpt.dcp import ModelState, StagingBuffers
    from ckpt.dcp.api import resolve_state
    from ckpt.job import CheckpointManager
    from tests.ckpt._helpers import assert_same, snapshot

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}

    def models(seed: int) -> dict:
        fsdp_tp = _mlp(seed)  # FSDP2 over TP, as the trainer's 3D layout
        parallelize_module(fsdp_tp, mesh["tp"], plan)
        fully_shard(fsdp_tp, mesh=mesh["dp"])
        fsdp = _mlp(seed + 1)  # FSDP2 only
        fully_shard(fsdp, mesh=mesh["dp"])
        tp = _mlp(seed + 2)  # TP only
        parallelize_module(tp, mesh["tp"], plan)
        return {"fsdp_tp": fsdp_tp, "fsdp": fsdp, "tp": tp}

    mods = models(0)
    live = {name: m.state_dict() for name, m in mods.items()}
    live["rep"] = {"w": distribute_tensor(torch.arange(6.0), mesh["tp"], [Replicate()])}
    staging = StagingBuffers(pin_memory=False)
    staged, _ = staging.stage(live)
    kinds = _check_staged(live, staged, staging._buffers)

    # Through a manager: the staged copy persists and loads back into fresh models.
    optims = {n: torch.optim.AdamW(m.parameters(), lr=1e-2) for n, m in mods.items()}
    for n, m in mods.items():  # one input everywhere: the TP-only model has dp replicas
        m(torch.randn(2, 8, generator=torch.Generator().manual_seed(5))).sum().backward()
        optims[n].step()
    state = {n: ModelState(m, optims[n]) for n, m in mods.items()}
    expected = snapshot(resolve_state(state))
    with CheckpointManager(root, retention=[]) as mgr:
        assert mgr.save(1, state, block=True)
    mods2 = models(10)
    optims2 = {n: torch.optim.AdamW(m.parameters(), lr=1e-2) for n, m in mods2.items()}
    state2 = {n: ModelState(m, optims2[n]) for n, m in mods2.items()}
    with CheckpointManager(root, retention=[]) as mgr:
        assert mgr.load_latest(state2).step == 1
    assert_same(expected, snapshot(resolve_state(state2)), f"rank {rank}")
    return sorted(kinds)


def test_staged_dtensors_wrap_the_buffer_for_every_placement(tmp_path):
    kinds = run_ranks(_every_layout_body, 4, str(tmp_path / "root"), timeout=240)
    assert kinds[0] == kinds[3]
    assert {"Shard(0)", "Shard(1)", "Replicate", "_StridedShard(0)"} <= set(kinds[0]), kinds[0]


def _cuda_mesh_body(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor.placement_types import _StridedShard

    from ckpt.dcp import StagingBuffers

    assert not torch.cuda.is_available()
    # A CUDA mesh needs no CUDA until a collective runs on it.
    mesh1 = DeviceMesh("cuda", torch.arange(1), _init_backend=False)
    mesh2 = DeviceMesh("cuda", torch.arange(1).reshape(1, 1), _init_backend=False)

    def on_cpu(local, mesh, placements):
        spec = DTensorSpec(mesh, tuple(placements),
                           TensorMeta(local.shape, local.stride(), local.dtype))
        return DTensor(local, spec, requires_grad=False)

    g = torch.Generator().manual_seed(0)
    live = {"fsdp": on_cpu(torch.randn(4, 3, generator=g), mesh1, [Shard(0)]),
            "row": on_cpu(torch.randn(3, 4, generator=g).bfloat16(), mesh1, [Shard(1)]),
            "rep": on_cpu(torch.arange(5), mesh1, [Replicate()]),
            "fsdp_tp": on_cpu(torch.randn(6, 2, generator=g), mesh2,
                              [_StridedShard(0, split_factor=1), Shard(0)])}
    staging = StagingBuffers(pin_memory=False)
    staged, _ = staging.stage(live)  # "Torch not compiled with CUDA enabled" if moved
    assert all(staged[k].device_mesh.device_type == "cuda" for k in live)
    _check_staged(live, staged, staging._buffers)


def test_a_cuda_mesh_state_stages_without_any_device_move():
    run_ranks(_cuda_mesh_body, 1, timeout=120)
