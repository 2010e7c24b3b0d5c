"""Every parallel layout trains the same model to the same losses as one process.

One ``run_ranks`` launch per layout (20 AdamW steps inside), compared against a
single-process reference computed once in the test process. Between them the layouts
cover FSDP2, DDP (with and without a pipeline), TP with and without sequence parallel,
the three schedules (GPipe, 1F1B, interleaved 1F1B with 2 virtual stages per rank),
gradient accumulation, the 3D mesh (2, 2, 2) on 8 processes, and HSDP (dp_replicate x
dp_shard) with TP + sequence parallel on 8 processes and under a pipeline. (HSDP against
DDP on the same ranks, and HSDP checkpoints: test_hsdp.py.) The mixture of experts
(``w.MOE``) trains the same in one process as with FSDP2 alone, with expert parallelism
(ep2), ep2 x dp2 (experts FSDP-sharded over the other 2 dp ranks), ep2 x tp2 with sequence
parallelism, pp2 x ep2 and HSDP 2x2 with ep2: 10 steps each, every layout of a world size
in one launch.

Tolerance: losses and gradient norms must agree with the reference to rtol 1e-4. Layouts
do not compute bit-identical sums (TP splits matmul reductions, FSDP/DDP sum gradients
in a different order, micro-batches split the mean), so each step differs by float32
rounding (~1e-7 relative). AdamW then divides by sqrt(v) + eps, which lifts tiny
differences in near-zero gradient components to parameter differences of ~1e-5
(PLATFORM.md), and 20 steps compound them; we measured at most ~5e-7 relative on the
losses. 1e-4 leaves two orders of magnitude of headroom for other machines, while the
bugs this test is for are far larger on the grad norms, which we compare too (AdamW is
nearly invariant to a constant gradient scale, so a wrong micro-batch or accumulation
scale shows in the norms, not the losses): at step 1 a missing dp reduction moves the
norm by ~18 %, a wrong 1/n scale by a factor n, counting the output-projection gradients
twice (a tp replica) by ~38 %, leaving out either pipeline stage's share by ~29 %.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.dist import run_ranks
from tests.trainer import _parallel_worker as w
from trainer.model import Transformer
from trainer.parallelize import build_parallel_model
from trainer.pipeline import build_stage_modules

RTOL = 1e-4

# (id, ParallelConfig kwargs, accumulation calls per step, check state-dict keys)
LAYOUTS = [
    ("dp2-fsdp-accum2", dict(dp=2, n_microbatches=2), 2, False),
    ("dp2-ddp", dict(dp=2, dp_mode="ddp", n_microbatches=2), 1, False),
    ("tp2-seqpar", dict(tp=2, sequence_parallel=True), 1, False),
    ("pp2-interleaved", dict(pp=2, stages_per_rank=2, pp_schedule="interleaved1f1b", n_microbatches=4), 1, True),
    ("dp2xtp2", dict(dp=2, tp=2), 1, False),
    ("pp2xtp2-gpipe", dict(pp=2, tp=2, pp_schedule="gpipe", n_microbatches=2), 1, False),
    ("pp2xdp2-ddp-gpipe-accum2", dict(pp=2, dp=2, dp_mode="ddp", pp_schedule="gpipe", n_microbatches=2), 2, False),
    ("pp2xdp2xtp2-1f1b", dict(pp=2, dp=2, tp=2, pp_schedule="1f1b", n_microbatches=2), 1, True),
    ("hsdp2x2xtp2-seqpar", dict(dp_replicate=2, dp_shard=2, tp=2, sequence_parallel=True), 1, False),
    ("pp2xhsdp2x1-1f1b", dict(pp=2, dp_replicate=2, dp_shard=1, n_microbatches=2), 1, False),
]


@pytest.fixture(scope="module")
def reference() -> dict:
    """Single process, no process group, whole batch in one micro-batch."""
    pm = build_parallel_model(w.MODEL, w.layout(), None, w.SEED)
    return w.train(pm, dp_rank=0, dp=1, check_state_keys=True)


def test_reference_learns(reference):
    # Guards the comparison itself: a model that does not train would match trivially.
    assert reference["losses"][-1] < 0.5 * reference["losses"][0]
    assert all(math.isfinite(x) for x in reference["losses"] + reference["norms"])


@pytest.mark.parametrize("name,par_kwargs,accum,check_keys", LAYOUTS, ids=[l[0] for l in LAYOUTS])
def test_layout_matches_single_process(reference, name, par_kwargs, accum, check_keys):
    par = w.layout(**par_kwargs)
    results = run_ranks(
        w.rank_train, par.world_size, par_kwargs, accum, check_keys, timeout=240
    )
    for rank, res in enumerate(results):
        # Every rank reports the same global loss and the same global grad norm, bit for bit.
        assert res["losses"] == results[0]["losses"], f"rank {rank} loss differs"
        assert res["norms"] == results[0]["norms"], f"rank {rank} grad norm differs"
    got = results[0]
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(reference["losses"]), rtol=RTOL, atol=0
    )
    torch.testing.assert_close(
        torch.tensor(got["norms"]), torch.tensor(reference["norms"]), rtol=RTOL, atol=0
    )
    if check_keys:
        # Parameter and optimizer-state names are the full model's on every layout, so a
        # checkpoint reshards across layouts by name.
        model_keys = set().union(*(r["model_keys"] for r in results))
        optim_keys = set().union(*(r["optim_keys"] for r in results))
        assert model_keys == set(reference["model_keys"])
        assert optim_keys == set(reference["optim_keys"])


# (id, ParallelConfig kwargs, check state-dict keys and a load round trip)
MOE_STEPS = 10
MOE_LAYOUTS = {
    2: [("moe-dp2-fsdp", dict(dp=2), False),
        ("moe-ep2-microbatches2", dict(dp=2, ep=2, n_microbatches=2), True)],
    4: [("moe-ep2xdp2", dict(dp=4, ep=2), True),
        ("moe-ep2xtp2-seqpar", dict(dp=2, ep=2, tp=2, sequence_parallel=True), False),
        ("moe-pp2xep2-1f1b", dict(pp=2, dp=2, ep=2, n_microbatches=2), True),
        ("moe-hsdp2x2-ep2", dict(dp_replicate=2, dp_shard=2, ep=2), False)],
}
MOE_IDS = [name for layouts in MOE_LAYOUTS.values() for name, _, _ in layouts]


@pytest.fixture(scope="module")
def moe_reference() -> dict:
    pm = build_parallel_model(w.MOE, w.layout(w.MOE), None, w.SEED)
    return w.train(pm, dp_rank=0, dp=1, check_state_keys=True, steps=MOE_STEPS)


@pytest.fixture(scope="module")
def moe_runs() -> dict:
    """``{layout id: [result of each rank]}``, one launch per world size."""
    out = {}
    for world, layouts in MOE_LAYOUTS.items():
        runs = [("moe", kwargs, keys, MOE_STEPS) for _, kwargs, keys in layouts]
        per_rank = run_ranks(w.rank_train_layouts, world, runs, timeout=240)
        for i, (name, _, _) in enumerate(layouts):
            out[name] = [results[i] for results in per_rank]
    return out


@pytest.mark.parametrize("name", MOE_IDS)
def test_moe_layout_matches_single_process(moe_reference, moe_runs, name):
    results = moe_runs[name]
    for rank, res in enumerate(results):
        assert res["losses"] == results[0]["losses"], f"rank {rank} loss differs"
        assert res["norms"] == results[0]["norms"], f"rank {rank} grad norm differs"
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(results[0][key]),
                                   torch.tensor(moe_reference[key]), rtol=RTOL, atol=0)
    if "model_keys" in results[0]:
        # Expert weights keep their global names and shapes under ep: checkpoints reshard.
        assert set().union(*(r["model_keys"] for r in results)) == set(moe_reference["model_keys"])
        assert set().union(*(r["optim_keys"] for r in results)) == set(moe_reference["optim_keys"])


def test_bf16_autocast_tracks_fp32(reference):
    # CPU smoke test of the mixed-precision path (autocast on one process; FSDP2's
    # MixedPrecisionPolicy is used when dp > 1). bf16 has an 8-bit mantissa: ~1 % agreement.
    pm = build_parallel_model(w.MODEL, w.layout(), None, w.SEED, param_dtype=torch.bfloat16)
    got = w.train(pm, dp_rank=0, dp=1, steps=5)
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(reference["losses"][:5]), rtol=2e-2, atol=0
    )


# --- pure model properties the layouts rely on (no processes) --------------------------


def test_stage_parameters_equal_full_model():
    full = Transformer(w.MODEL)
    full.init_weights(w.SEED)
    full_params = dict(full.named_parameters())
    seen = set()
    for pp_rank in range(2):
        for stage_id, module in build_stage_modules(w.MODEL, pp_rank, 2, 2, device="cpu"):
            module.init_weights(w.SEED)
            for name, param in module.named_parameters():
                assert torch.equal(param, full_params[name]), name
                seen.add(name)
            assert (module.tok_embeddings is not None) == (stage_id == 0)
            assert (module.output is not None) == (stage_id == 3)
    assert seen == set(full_params)


def test_stages_chained_equal_full_forward():
    full = Transformer(w.MODEL)
    full.init_weights(w.SEED)
    x, _ = w.make_batches(1)[0]
    stages = sorted(
        (sid, m) for r in range(2) for sid, m in build_stage_modules(w.MODEL, r, 2, 2, "cpu")
    )
    h = x
    for _, module in stages:
        module.init_weights(w.SEED)
        h = module(h)
    torch.testing.assert_close(h, full(x), rtol=0, atol=0)


def test_init_depends_on_seed_and_name_only():
    a, b, c = Transformer(w.MODEL), Transformer(w.MODEL), Transformer(w.MODEL)
    torch.manual_seed(0)
    a.init_weights(7)
    torch.manual_seed(1)  # the global RNG must not matter
    b.init_weights(7)
    c.init_weights(8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    assert w.MODEL.num_params() == sum(p.numel() for p in a.parameters())
