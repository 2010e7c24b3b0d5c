"""HSDP (dp = dp_replicate x dp_shard): the layout's rules, its training math, its checkpoints.

* Config: which (dp, dp_replicate, dp_shard) combinations resolve to what, and one-line
  errors naming the key and the fix for the ones that cannot work.
* Training: HSDP 2x2 on 4 gloo ranks trains to the same losses and gradient norms as DDP on
  the same 4 ranks (tolerance and its reasoning: test_parallel_equivalence.py), with
  gradient accumulation; the shards really are split 2 ways and the 2 replicas of each shard
  stay bit-identical after 20 steps (a missing cross-replica reduction would let them drift).
* Checkpoints, through the real trainer (``Trainer.fit``): an HSDP 2x2 job's checkpoint
  records its dims and loads bit-exact into FSDP on 2 ranks and into one process; the FSDP
  job's own checkpoint then loads bit-exact back into HSDP 2x2.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist import run_ranks
from tests.trainer import _parallel_worker as w
from tests.trainer._trainer_jobs import assert_same_state, full_state, trainer_for
from trainer.config import (
    ConfigError,
    ParallelConfig,
    config_from_dict,
    config_to_dict,
    load_config,
)

RTOL = 1e-4  # as test_parallel_equivalence.py


# --- config rules (pure) -------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,world,want", [
    (dict(dp=4), 4, (4, 1, 4)),                                  # dp alone: plain FSDP
    (dict(dp_replicate=2), 8, (8, 2, 4)),                        # dp = rest of the world
    (dict(dp_replicate=2, dp_shard=2), 4, (4, 2, 2)),            # dp from the factors
    (dict(dp=8, dp_replicate=4), 8, (8, 4, 2)),
    (dict(dp=4, dp_replicate=2, dp_shard=2, tp=2), 8, (4, 2, 2)),
    (dict(dp_replicate=2, pp=2, tp=2), 8, (2, 2, 1)),
    (dict(dp_mode="ddp"), 4, (4, 1, 4)),
])
def test_dp_split_resolves(kwargs, world, want):
    par = ParallelConfig(**kwargs).resolved(world)
    assert (par.dp, par.dp_replicate, par.dp_shard) == want
    assert par.world_size == world
    assert par.hsdp == (want[1] > 1)


@pytest.mark.parametrize("kwargs,world,key,words", [
    (dict(dp=4, dp_replicate=2, dp_shard=4), None, "parallel.dp",
     ["is 4 but parallel.dp_replicate * parallel.dp_shard = 2 * 4 = 8", "set parallel.dp=8"]),
    (dict(dp=6, dp_replicate=4), None, "parallel.dp_replicate",
     ["4 does not divide parallel.dp=6"]),
    (dict(dp_replicate=3), 8, "parallel.dp_replicate",
     ["3 does not divide the dp degree 8", "pick a dp_replicate that divides it"]),
    (dict(dp_replicate=2, dp_shard=2), 8, "parallel.dp",
     ["pp * dp * tp = 1 * 4 * 1 != world size 8", "dp_replicate * dp_shard = 2 * 2",
      "parallel.dp_shard=-1"]),
    (dict(dp_replicate=2, dp_mode="ddp"), None, "parallel.dp_replicate",
     ["HSDP needs parallel.dp_mode='fsdp'", "parallel.dp_replicate=1"]),
    (dict(dp_replicate=0), None, "parallel.dp_replicate", ["must be >= 1, got 0"]),
    (dict(dp_shard=0), None, "parallel.dp_shard", ["must be >= 1 or -1, got 0"]),
])
def test_dp_split_errors_name_the_key_and_fix(kwargs, world, key, words):
    with pytest.raises(ConfigError) as e:
        par = ParallelConfig(**kwargs)
        if world is not None:
            par.resolved(world)
    assert e.value.key == key and str(e.value).startswith(f"{key}: ")
    for word in words:
        assert word in str(e.value)
    assert "\n" not in str(e.value)


def test_hsdp_from_overrides_and_back_through_the_config_record():
    cfg = load_config(None, ["--parallel.dp_replicate=2", "--training.global_batch_size=16"])
    resolved = cfg.resolved(8)
    assert (resolved.parallel.dp, resolved.parallel.dp_shard) == (8, 4)
    assert cfg.parallel.dp == -1 and cfg.parallel.dp_shard == -1  # the original is untouched
    # A checkpoint's config record (config_to_dict) reads back to the same layout.
    again = config_from_dict(config_to_dict(resolved))
    assert again.parallel == resolved.parallel
    with pytest.raises(ConfigError, match=r"^parallel\.dp: is 2 but .* \(set by --parallel\.dp=2\)"):
        load_config(None, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2",
                           "--parallel.dp=2"])
    # Batch rules use the whole dp degree: 8 dp ranks do not split a batch of 12.
    with pytest.raises(ConfigError, match="training.global_batch_size: 12 is not divisible"):
        load_config(None, ["--parallel.dp_replicate=2", "--parallel.dp_shard=4",
                           "--training.global_batch_size=12"]).resolved(8)


# --- training: HSDP 2x2 equals DDP on the same 4 ranks ------------------------------------


def _replica_check(pm, mesh) -> dict:
    """Every local parameter shard, compared across the dp_replicate ranks (must be equal)
    and the dp_shard ranks (must differ: they hold different pieces)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    out = {"same_across_replicas": True, "differ_across_shards": True, "placements": set()}
    rep, shard = mesh["dp_replicate"].get_group(), mesh["dp_shard"].get_group()
    for name, p in pm.model_parts[0].named_parameters():
        assert isinstance(p, DTensor), name
        out["placements"].add(tuple(type(pl).__name__ for pl in p.placements))
        assert p.placements == (Replicate(), Shard(0)), (name, p.placements)
        local = p.to_local().detach().contiguous()
        assert local.shape[0] == p.shape[0] // 2, (name, local.shape, p.shape)
        for group, key, want_equal in ((rep, "same_across_replicas", True),
                                       (shard, "differ_across_shards", False)):
            got = [torch.empty_like(local) for _ in range(2)]
            dist.all_gather(got, local, group=group)
            if torch.equal(got[0], got[1]) != want_equal and not name.endswith("norm.weight"):
                out[key] = False
    out["placements"] = sorted(out["placements"])
    return out


def _ddp_then_hsdp(rank: int, world: int) -> dict:
    from trainer.mesh import build_mesh, dp_mesh
    from trainer.parallelize import build_parallel_model

    w._flush_result_queue_at_exit()
    results = {}
    for name, kwargs, accum in (("ddp", dict(dp=4, dp_mode="ddp"), 1),
                                ("hsdp", dict(dp_replicate=2, dp_shard=2), 2)):
        par = w.layout(**kwargs)
        mesh = build_mesh(par, "cpu")
        pm = build_parallel_model(w.MODEL, par, mesh, w.SEED)
        # The data slice follows the whole dp rank: rank r = (replicate r // 2, shard r % 2).
        assert dp_mesh(mesh).get_local_rank() == rank
        results[name] = w.train(pm, dp_mesh(mesh).get_local_rank(), par.dp, accum)
        if name == "hsdp":
            assert mesh.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "tp")
            assert mesh["dp_replicate"].get_local_rank() == rank // 2
            assert mesh["dp_shard"].get_local_rank() == rank % 2
            results["replicas"] = _replica_check(pm, mesh)
    return results


def test_hsdp_2x2_matches_ddp_on_4_ranks():
    results = run_ranks(_ddp_then_hsdp, 4, timeout=240)
    for rank, res in enumerate(results):
        for name in ("ddp", "hsdp"):
            assert res[name] == results[0][name], f"rank {rank}: {name} differs between ranks"
        assert res["replicas"]["same_across_replicas"], f"rank {rank}: replicas diverged"
        assert res["replicas"]["differ_across_shards"], f"rank {rank}: shards not split"
    ddp, hsdp = results[0]["ddp"], results[0]["hsdp"]
    assert ddp["losses"][-1] < 0.5 * ddp["losses"][0]  # it trains: the comparison means something
    for what in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(hsdp[what]), torch.tensor(ddp[what]),
                                   rtol=RTOL, atol=0)


# --- checkpoints through the trainer: HSDP -> FSDP (2 ranks) / one process -> HSDP --------

def _hsdp_job(rank: int, world: int, root: str) -> dict:
    """HSDP 2x2: train 2 steps, checkpoint step 2 (the final save)."""
    w._flush_result_queue_at_exit()
    t = trainer_for(rank, world, root, 2, ("--parallel.dp_replicate=2",))
    assert (t.par.dp_replicate, t.par.dp_shard, t.loader.dp_rank) == (2, 2, rank)
    assert t.fit() == 0
    return full_state(t)


def _fsdp_job(rank: int, world: int, root: str, saved: dict) -> dict:
    """FSDP on 2 ranks: resume the HSDP step 2 (checked bit-exact), train to step 4."""
    w._flush_result_queue_at_exit()
    t = trainer_for(rank, world, root, 4, ())
    assert not t.par.hsdp and t.par.dp == 2
    assert t.resume() == 2
    assert_same_state(saved, full_state(t), f"FSDP rank {rank} after loading HSDP step 2")
    t.manager.close(flush=False)  # releases the root's write lease for the next job
    t = trainer_for(rank, world, root, 4, ())  # a fresh job resumes and trains on
    assert t.fit() == 0
    return full_state(t)


def _back_to_hsdp_job(rank: int, world: int, root: str, saved: dict) -> dict:
    """HSDP 2x2 again: resume the FSDP job's step 4 (checked bit-exact)."""
    w._flush_result_queue_at_exit()
    t = trainer_for(rank, world, root, 4, ("--parallel.dp_replicate=2",))
    assert t.resume() == 4
    assert_same_state(saved, full_state(t), f"HSDP rank {rank} after loading FSDP step 4")
    t.manager.close(flush=False)
    return _replica_check(t.model, t.mesh)


def test_checkpoint_hsdp_to_fsdp_and_one_process_and_back(tmp_path):
    from ckpt.root import CheckpointStore

    root = str(tmp_path / "ckpt")
    hsdp_state = run_ranks(_hsdp_job, 4, root, timeout=240)[0]
    manifest = CheckpointStore(root).read_manifest(2, complete=True)
    assert manifest.world_size == 4
    assert {k: manifest.layout[k] for k in ("pp", "dp", "dp_replicate", "dp_shard", "tp",
                                             "dp_mode")} == dict(
        pp=1, dp=4, dp_replicate=2, dp_shard=2, tp=1, dp_mode="fsdp")
    # Sharded 2 ways (dp_shard), each shard written once although 2 replicas hold it.
    chunks = manifest.tensors["app.model.layers.0.attention.wq.weight"]["chunks"]
    assert len(chunks) == 2

    # One plain process (no process group) loads the HSDP checkpoint bit-exact.
    single = trainer_for(0, 1, root, 2, ())
    assert single.resume() == 2
    assert_same_state(hsdp_state, full_state(single), "one process after loading HSDP step 2")
    single.manager.close(flush=False)

    fsdp_state = run_ranks(_fsdp_job, 2, root, hsdp_state, timeout=240)[0]
    assert fsdp_state != hsdp_state  # it trained on: step 4 is another state
    assert CheckpointStore(root).read_manifest(4).layout["dp_replicate"] == 1

    replicas = run_ranks(_back_to_hsdp_job, 4, root, fsdp_state, timeout=240)
    assert all(r["same_across_replicas"] and r["differ_across_shards"] for r in replicas)
