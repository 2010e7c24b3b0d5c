"""Expert parallelism (``parallel.ep``): its config rules, and MoE checkpoints through the
real trainer.

* Config: ``ep`` divides ``dp_shard`` and ``model.n_experts``, needs experts and FSDP2;
  each violation is one line naming ``parallel.ep`` and the fix.
* Checkpoints reshard across ep degrees: a job on ep2 (2 ranks) saves step 2; one process
  (ep1), ep4 and ep2 x dp2 (4 ranks) each load it with every weight and optimizer value
  equal, full tensor by full tensor, to the saved ones, and ep2 x dp2 trains on. The
  manifest's layout says ``ep`` (``ckpt show`` prints it), and the experts are stored
  under their global shape, one chunk per ep rank.
* A dense checkpoint resumed by an MoE model, and the reverse, is refused in one line
  naming the first key that differs.
* A 2-rank ep2 job SIGKILLed after its first commit resumes and ends bit for bit where an
  uninterrupted ep2 job ends (every step's loss, replayed ones too, and the last
  checkpoint); its ``train_step`` events carry the router statistics.

(Equivalence of the MoE layouts with one process: test_parallel_equivalence.py.)
"""

from __future__ import annotations

import contextlib
import io
import shutil

import pytest
import torch

from tests.dist import run_ranks
from tests.e2e._jobs import Job, all_losses, assert_same_checkpoint, loss_history, \
    straight_run, trainer_argv
from tests.trainer import _parallel_worker as w
from tests.trainer._trainer_jobs import assert_same_state, full_state, trainer_for
from trainer.config import ConfigError, ModelConfig, ParallelConfig

MOE = ("--model.n_experts=4", "--model.experts_per_token=2", "--model.moe_ffn_dim=64")
EP2 = ("--parallel.ep=2",)


@pytest.mark.parametrize("make,words", [
    (lambda: ParallelConfig(dp=4, ep=3), "3 does not divide parallel.dp_shard=4"),
    (lambda: ParallelConfig(ep=3).resolved(4), "3 does not divide the dp_shard degree 4"),
    (lambda: ParallelConfig(dp_replicate=2, ep=4).resolved(4),
     "4 does not divide the dp_shard degree 2"),
    (lambda: ParallelConfig(dp=2, ep=2, dp_mode="ddp"), "composes with FSDP2 only"),
    (lambda: ParallelConfig(ep=0), "must be >= 1"),
    (lambda: ParallelConfig(dp=2, ep=2).check(ModelConfig()), "the model has no experts"),
    (lambda: ParallelConfig(dp=4, ep=4).check(ModelConfig(n_experts=6)),
     "4 does not divide model.n_experts=6"),
])
def test_config_errors_name_parallel_ep(make, words):
    with pytest.raises(ConfigError) as e:
        make()
    msg = str(e.value)
    assert msg.startswith("parallel.ep: ") and words in msg and "\n" not in msg, msg


def test_ep_layouts_resolve():
    par = ParallelConfig(dp_replicate=2, ep=2).resolved(8)
    assert (par.dp, par.dp_shard, par.ep, par.dp_shard_mod_ep) == (8, 4, 2, 2)
    par.check(ModelConfig(n_experts=4))
    assert ParallelConfig(ep=4).resolved(4).dp_shard_mod_ep == 1


# --- checkpoints through the trainer ---------------------------------------------------


def _ep2_job(rank: int, world: int, root: str) -> dict:
    """ep2 on 2 ranks: train 2 steps, checkpoint step 2 (the final save)."""
    w._flush_result_queue_at_exit()
    t = trainer_for(rank, world, root, 2, MOE + EP2)
    assert (t.par.dp, t.par.ep) == (2, 2)
    experts = t.model.model_parts[0].layers["0"].moe.experts
    assert experts.w1.to_local().shape[0] == 2  # 4 experts, 2 on this rank
    assert t.fit() == 0
    return full_state(t)


def _reshard_job(rank: int, world: int, root: str, saved: dict) -> dict:
    """4 ranks: ep4, then ep2 x dp2, each load step 2 bit-exact; ep2 x dp2 trains on."""
    w._flush_result_queue_at_exit()
    for layout in (("--parallel.ep=4",), EP2):
        t = trainer_for(rank, world, root, 4, MOE + layout)
        assert t.resume() == 2
        assert_same_state(saved, full_state(t), f"rank {rank} {layout} after loading ep2")
        t.manager.close(flush=False)  # releases the root's write lease for the next one
    assert (t.par.dp, t.par.ep, t.par.dp_shard_mod_ep) == (4, 2, 2)
    t = trainer_for(rank, world, root, 4, MOE + EP2)
    assert t.fit() == 0 and t.step == 4
    return {"losses": [loss for _, loss in t.losses]}


@pytest.fixture(scope="module")
def ep2_checkpoint(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe") / "ckpt")
    return root, run_ranks(_ep2_job, 2, root, timeout=240)[0]


def test_checkpoint_reshards_across_ep_degrees(ep2_checkpoint, tmp_path):
    from ckpt.cli import main as ckpt_main
    from ckpt.root import CheckpointStore

    root, saved = ep2_checkpoint
    manifest = CheckpointStore(root).read_manifest(2, complete=True)
    assert {k: manifest.layout[k] for k in ("dp", "ep", "dp_shard")} == dict(dp=2, ep=2,
                                                                            dp_shard=2)
    w1 = manifest.tensors["app.model.layers.0.moe.experts.w1"]
    assert list(w1["shape"]) == [4, 64, 64] and len(w1["chunks"]) == 2
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert ckpt_main(["show", root, "--step", "2"]) == 0
    assert "ep=2" in out.getvalue(), out.getvalue()

    # One process (ep1) loads it bit-exact, and trains on (in a copy of the root).
    copy = str(tmp_path / "copy")
    shutil.copytree(root, copy)
    single = trainer_for(0, 1, copy, 3, MOE)
    assert single.resume() == 2
    assert_same_state(saved, full_state(single), "one process after loading ep2 step 2")
    single.manager.close(flush=False)
    single = trainer_for(0, 1, copy, 3, MOE)
    assert single.fit() == 0 and single.step == 3

    # 4 ranks: ep4 and ep2 x dp2 load it bit-exact; ep2 x dp2 trains on to step 4.
    results = run_ranks(_reshard_job, 4, root, saved, timeout=300)
    assert len(results[0]["losses"]) == 2
    assert CheckpointStore(root).read_manifest(4).layout["ep"] == 2


def test_dense_and_moe_checkpoints_refuse_each_other_in_one_line(ep2_checkpoint, tmp_path):
    root, _ = ep2_checkpoint
    copy = str(tmp_path / "moe")
    shutil.copytree(root, copy)
    dense = trainer_for(0, 1, copy, 3, ())
    with pytest.raises(ValueError) as e:
        dense.resume()
    msg = str(e.value)
    assert "\n" not in msg and "app.model.layers.0.feed_forward.w1.weight: this model has it, " \
        "the checkpoint does not" in msg, msg
    dense.manager.close(flush=False)

    dense_root = str(tmp_path / "dense")
    assert trainer_for(0, 1, dense_root, 1, ()).fit() == 0
    moe = trainer_for(0, 1, dense_root, 2, MOE)
    with pytest.raises(ValueError) as e:
        moe.resume()
    msg = str(e.value)
    assert "\n" not in msg and "app.model.layers.0.moe.experts.w1: this model has it" in msg, msg
    assert "saved from another model" in msg and "checkpoint.root" in msg
    moe.manager.close(flush=False)


# --- SIGKILL and resume on ep2 ----------------------------------------------------------

STEPS, INTERVAL = 8, 3
KILL_ARGS = (f"--training.steps={STEPS}", f"--checkpoint.interval={INTERVAL}",
             "--checkpoint.keep_last=0", *MOE, *EP2)


def test_ep2_killed_and_resumed_is_bit_identical(tmp_path):
    ref_root, ref_events = straight_run(KILL_ARGS, nproc=2)
    root, jsonl = tmp_path / "ckpt", tmp_path / "events.jsonl"
    argv = trainer_argv(*KILL_ARGS, f"--checkpoint.root={root}", f"--metrics.jsonl_path={jsonl}",
                        nproc=2)
    first = Job(argv, tmp_path, "killed", jsonl)
    first.wait_event(lambda e: e["kind"] == "save_committed", what="the first commit")
    first.wait_step(INTERVAL + 2)
    first.kill_all()
    assert first.proc.returncode == -9, first.tails()
    resumed = Job(argv, tmp_path, "resumed", jsonl).wait_ok()
    assert "resumed from" in resumed.stdout + resumed.stderr, resumed.tails()
    ref, got = loss_history(ref_events), loss_history(resumed.events())
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == ref, {s: (got[s], ref[s]) for s in ref if got.get(s) != ref[s]}
    for step, values in all_losses(resumed.events()).items():
        assert all(v == ref[step] for v in values), (step, values, ref[step])
    assert_same_checkpoint(ref_root, root, STEPS)
    # The router's statistics ride on every step: both MoE blocks, on rank 0's tokens.
    router = [e["router"] for e in resumed.events() if e["kind"] == "train_step"]
    assert router and all(set(r) == {"0", "1"} for r in router)
    assert all(1.0 <= r[k]["imbalance"] <= 2.0 and r[k]["aux_loss"] > 0.9
               for r in router for k in r)
