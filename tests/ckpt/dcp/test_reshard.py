"""Resharding: a checkpoint saved by 4 ranks as dp2 x tp2 loads under other layouts, bit-equal.

Saved: a 2-layer MLP, tensor-parallel (Colwise/Rowwise) on the "tp" axis and FSDP2 on the
"dp" axis of a (2, 2) mesh, with AdamW state after one step. Loaded: by the same 4 processes
as tp4, by 2 processes as FSDP2 dp2, and by this test process with no process group at all.
Every parameter and every optimizer state tensor must equal, as a full tensor, the value
gathered at save time.
"""

from __future__ import annotations

import pytest
import torch

from tests.ckpt._helpers import assert_same, pack, unpack
from tests.dist import run_ranks

STEP = 1


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))


def _tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"0": ColwiseParallel(), "2": RowwiseParallel()}


def _optim(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _full_values(model, optim) -> dict:
    """Model and optimizer state with every DTensor gathered to its full value.

    Collective when the state holds DTensors: every rank calls it in the same order.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    def full(v):
        if isinstance(v, dict):
            return {k: full(x) for k, x in v.items()}
        if isinstance(v, list):
            return [full(x) for x in v]
        if isinstance(v, torch.Tensor):
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            return v.detach().clone()
        return v

    model_sd, optim_sd = get_state_dict(model, optim)
    return full({"model": model_sd, "optim": optim_sd})


def _train_step(model, optim, seed: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()


def _save_dp2_tp2_then_load_tp4(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import ckpt
    from ckpt.dcp import ModelState

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _model(0)
    parallelize_module(model, mesh["tp"], _tp_plan())
    fully_shard(model, mesh=mesh["dp"])
    optim = _optim(model)
    # TP needs the same input within a tp group; dp ranks see different data.
    _train_step(model, optim, seed=mesh.get_local_rank("dp"))
    _train_step(model, optim, seed=10 + mesh.get_local_rank("dp"))
    original = _full_values(model, optim)
    ckpt.save({"train": ModelState(model, optim)}, root, STEP,
              layout={"dp": 2, "tp": 2})

    # Same processes, another layout: tp4, fresh weights and a fresh optimizer.
    mesh4 = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    model4 = _model(1)
    parallelize_module(model4, mesh4, _tp_plan())
    optim4 = _optim(model4)
    ckpt.load({"train": ModelState(model4, optim4)}, root, STEP)
    assert_same(original, _full_values(model4, optim4), "tp4")
    return pack(original)


def _load_dp2(rank: int, world: int, root: str, original: bytes) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ckpt
    from ckpt.dcp import ModelState

    model = _model(2)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optim = _optim(model)
    ckpt.load({"train": ModelState(model, optim)}, root, STEP)
    assert_same(unpack(original), _full_values(model, optim), f"dp{world}")
    # The loaded state trains on: one more step runs and changes the weights.
    _train_step(model, optim, seed=rank)


def test_reshard_dp2xtp2_to_tp4_dp2_and_single_process(tmp_path):
    import ckpt
    from ckpt.dcp import ModelState
    from ckpt.root import CheckpointStore

    root = str(tmp_path / "root")
    original = unpack(run_ranks(_save_dp2_tp2_then_load_tp4, 4, root, timeout=240)[0])
    manifest = CheckpointStore(root).read_manifest(STEP, complete=True)
    assert manifest.world_size == 4 and manifest.layout == {"dp": 2, "tp": 2}
    # Really sharded both ways: the first layer's weight is stored as 4 chunks.
    assert len(manifest.tensors["train.model.0.weight"]["chunks"]) == 4
    assert {r.rank for r in manifest.files.values()} == {0, 1, 2, 3}
    # Sanity: the optimizer state is part of the check.
    assert set(original["optim"]["state"]["0.weight"]) == {"step", "exp_avg", "exp_avg_sq"}

    run_ranks(_load_dp2, 2, root, pack(original), timeout=240)

    # One process, no process group: plain module and optimizer.
    model = _model(3)
    optim = _optim(model)
    with pytest.raises(AssertionError):  # fresh weights really differ before the load
        assert_same(original["model"], _full_values(model, optim)["model"])
    ckpt.load({"train": ModelState(model, optim)}, root, STEP)
    assert_same(original, _full_values(model, optim), "single process")
