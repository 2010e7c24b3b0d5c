"""Layout planner: memory arithmetic, recommendations, warnings, CLI text and JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from trainer.config import ModelConfig, ParallelConfig, load_config
from trainer.hardware import GIB, GPU_PRESETS, PRECISIONS, get_gpu
from trainer.layout_plan import (
    add_layout_plan_arguments,
    candidate_layouts,
    parse_count,
    plan_layout,
    run_layout_plan,
)
from trainer.memory_model import (
    Candidate,
    Workload,
    activation_bytes_per_layer,
    all_to_all_bytes_per_step,
    block_input_bytes,
    estimate_memory,
    pipeline_bubble,
    shape_from_config,
    shape_from_dims,
    shape_from_params,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
H100 = GPU_PRESETS["h100"].memory_bytes * 0.9


def _codes(plan) -> set[str]:
    return {code for code, _ in plan.warnings}


def _run(capsys, *argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    add_layout_plan_arguments(parser)
    rc = run_layout_plan(parser.parse_args(list(argv)))
    return rc, capsys.readouterr().out


@pytest.mark.parametrize("text,n", [("7B", 7_000_000_000), ("350M", 350_000_000),
                                    ("1.3e9", 1_300_000_000), ("12k", 12_000), ("2T", 2e12)])
def test_parse_count(text, n):
    assert parse_count(text) == n


def test_parse_count_rejects_garbage():
    with pytest.raises(ValueError, match="--params"):
        parse_count("seven")


def test_7b_adamw_mixed_is_16_bytes_per_param():
    pc = PRECISIONS["bf16-mixed"]
    assert pc.weight_bytes + pc.grad_bytes + pc.master_bytes + 2 * pc.state_bytes == 16
    work = Workload(shape_from_params(7_000_000_000), recompute="full")
    ddp = estimate_memory(work, Candidate.of(1, 1, 1, "ddp"))
    assert ddp.weights + ddp.grads + ddp.optimizer == pytest.approx(112e9, rel=1e-9)
    assert ddp.optimizer == pytest.approx(84e9, rel=1e-9)
    fsdp = estimate_memory(work, Candidate.of(1, 8, 1, "fsdp"))
    assert fsdp.weights + fsdp.grads + fsdp.optimizer == pytest.approx(14e9, rel=1e-9)


def test_7b_on_8_h100_needs_fsdp():
    plan = plan_layout(Workload(shape_from_params(7_000_000_000)), 8, 8, H100)
    (ddp,) = [est for lay, est in plan.rows if lay == Candidate.of(1, 8, 1, "ddp")]
    assert not plan.fits(ddp)
    assert plan.recommended[0] == Candidate.of(1, 8, 1, "fsdp")
    assert "optimizer-state" in _codes(plan)
    assert "activations-dominate" in _codes(plan)


def test_zero_stages_shard_progressively():
    work = Workload(shape_from_params(7_000_000_000))
    e = {m: estimate_memory(work, Candidate.of(1, 8, 1, m)) for m in ("ddp", "zero1", "zero2", "fsdp")}
    assert e["zero1"].optimizer == pytest.approx(e["ddp"].optimizer / 8)
    assert e["zero2"].grads == pytest.approx(e["ddp"].grads / 8)
    assert e["fsdp"].weights == pytest.approx(e["ddp"].weights / 8)
    fsdp_state = e["fsdp"].total - e["fsdp"].fsdp_buffers
    assert e["ddp"].total > e["zero1"].total > e["zero2"].total > fsdp_state


def test_small_model_gets_plain_ddp():
    plan = plan_layout(Workload(shape_from_dims(768, 12, 12, 50257)), 8, 8, H100)
    assert plan.recommended[0] == Candidate.of(1, 8, 1, "ddp")
    assert plan.warnings == [] or "needless-parallelism" not in _codes(plan)


def test_activation_formula_korthikanti():
    s, b, h, a = 2048, 1, 4096, 32
    base = s * b * h * (34 + 5 * a * s / h)
    assert activation_bytes_per_layer(s, b, h, a) == pytest.approx(base)
    assert activation_bytes_per_layer(s, b, h, a, tp=8, sequence_parallel=True) == \
        pytest.approx(base / 8)
    assert activation_bytes_per_layer(s, b, h, a, tp=8) == \
        pytest.approx(s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    assert activation_bytes_per_layer(s, b, h, a, flash_attention=True) == \
        pytest.approx(34 * s * b * h)
    assert block_input_bytes(s, b, h) == pytest.approx(2 * s * b * h)
    assert block_input_bytes(s, b, h, tp=8, sequence_parallel=True) == \
        pytest.approx(2 * s * b * h / 8)
    assert activation_bytes_per_layer(s, b, h, a, bytes_per_element=4) == pytest.approx(2 * base)


def test_pipeline_bubble():
    assert pipeline_bubble(1, 4) == 0
    assert pipeline_bubble(4, 8) == pytest.approx(3 / 11)
    assert pipeline_bubble(4, 8, stages_per_rank=2) == pytest.approx(3 / 19)


def test_1f1b_first_stage_holds_pp_microbatches_gpipe_holds_all():
    shape = shape_from_dims(1024, 8, 16, 32000)
    one = estimate_memory(Workload(shape, num_microbatches=16), Candidate.of(4, 1, 1))
    gp = estimate_memory(Workload(shape, num_microbatches=16, pp_schedule="gpipe"), Candidate.of(4, 1, 1))
    per_layer = activation_bytes_per_layer(2048, 1, 1024, 16)
    assert one.stage == 0 and one.activations == pytest.approx(2 * per_layer * 4)
    assert gp.activations == pytest.approx(2 * per_layer * 16)


def test_candidates_keep_tp_in_node_and_cover_the_cluster():
    shape = shape_from_params(70_000_000_000)
    layouts = candidate_layouts(32, 8, shape)
    assert layouts[0] == Candidate.of(1, 32, 1, "ddp")
    for lay in layouts:
        assert lay.num_gpus == 32 and lay.tp <= 8 and shape.n_heads % lay.tp == 0
        assert lay.sharding == "fsdp" or lay.tp == 1
        assert lay.layout.dp_mode == ("ddp" if lay.sharding == "ddp" else "fsdp")
    keys = [lay.preference() for lay in layouts]
    assert keys == sorted(keys)


def test_big_model_needs_tp_or_pp_and_warns_on_bubble():
    work = Workload(shape_from_params(70_000_000_000), recompute="full")
    plan = plan_layout(work, 32, 8, H100)
    assert plan.recommended is not None
    lay = plan.recommended[0]
    assert lay.sharding == "fsdp"
    nothing = plan_layout(Workload(shape_from_params(70_000_000_000)), 8, 8,
                          GPU_PRESETS["a100-40gb"].memory_bytes * 0.9)
    assert nothing.recommended is None and "nothing-fits" in _codes(nothing)
    piped = plan_layout(Workload(shape_from_params(1_000_000_000)), 8, 8, H100,
                        requested=Candidate.of(4, 2, 1, "fsdp"))
    assert "pipeline-bubble" in _codes(piped)


def test_requested_layout_warnings():
    work = Workload(shape_from_params(1_000_000_000))
    plan = plan_layout(work, 8, 8, H100, requested=Candidate.of(2, 2, 2, "fsdp"))
    assert "needless-parallelism" in _codes(plan)
    assert any("3D parallelism is not needed" in m for _, m in plan.warnings)
    across = plan_layout(Workload(shape_from_params(7_000_000_000)), 16, 8, H100,
                         requested=Candidate.of(1, 1, 16, "fsdp"))
    assert "tp-across-nodes" in _codes(across)
    mixed = plan_layout(work, 8, 8, H100, requested=Candidate.of(1, 4, 2, "ddp"))
    assert "tp-needs-fsdp" in _codes(mixed)
    with pytest.raises(ValueError, match="make them multiply to 8"):
        plan_layout(work, 8, 8, H100, requested=Candidate.of(1, 2, 2))


def test_hardware_presets():
    h100 = get_gpu("H100-80GB")
    assert h100.bf16_dense_tflops == 989.0 and h100.nvlink_bytes_per_s == 900e9
    assert 79 * GIB < h100.memory_bytes <= 80 * GIB
    assert get_gpu("h200").hbm_bandwidth_bytes_per_s == 4.8e12
    assert get_gpu("a100-40gb").bf16_dense_tflops == 312.0
    with pytest.raises(ValueError, match="did you mean 'h200'"):
        get_gpu("h20O")


def test_cli_text_report(capsys):
    rc, out = _run(capsys, "--params", "7B", "--gpu", "h100")
    assert rc == 0
    assert "Recommended: FSDP dp=8" in out and "--parallel.dp_mode=fsdp" in out
    assert "[optimizer-state]" in out and "optimizer state 78.2 GiB" in out


def test_cli_json_is_parseable(capsys):
    rc, out = _run(capsys, "--params", "7B", "--json")
    data = json.loads(out)
    assert rc == 0 and data["recommended"]["name"] == "FSDP dp=8"
    assert data["recommended"]["fits"] is True
    assert {"code", "message"} <= set(data["warnings"][0])
    assert data["candidates"][0]["memory_bytes"]["total"] > 0


def test_cli_from_config(capsys):
    rc, out = _run(capsys, "--config", str(CONFIGS / "3d_cpu.toml"), "--gpu-memory", "1")
    assert rc == 0 and "Requested:   FSDP dp=2 + TP2 + PP2" in out
    assert "[needless-parallelism]" in out
    rc, out = _run(capsys, "--config", str(CONFIGS / "gpu_1b.toml"), "--json")
    data = json.loads(out)
    assert data["requested"]["fits"] and data["workload"]["precision"] == "bf16-mixed"


def test_cli_bad_input_exits_2(capsys):
    parser = argparse.ArgumentParser()
    add_layout_plan_arguments(parser)
    assert run_layout_plan(parser.parse_args([])) == 2
    assert run_layout_plan(parser.parse_args(["--dim", "64"])) == 2
    assert run_layout_plan(parser.parse_args(["--params", "7B", "--gpu", "tpu"])) == 2
    assert "did you mean" not in capsys.readouterr().out


def test_cli_nothing_fits_exits_1(capsys):
    rc, out = _run(capsys, "--params", "70B", "--gpu", "a100-40gb")
    assert rc == 1 and "[nothing-fits]" in out


def test_candidates_are_trainer_layouts():
    # The planner evaluates the trainer's own layout type; its flags load back to that layout.
    sh = shape_from_dims(1024, 8, 16, 32000)
    plan = plan_layout(Workload(sh), 8, 8, H100, requested=Candidate.of(2, 2, 2, "fsdp"))
    model = [f"--model.dim={sh.dim}", f"--model.n_layers={sh.n_layers}",
             f"--model.n_heads={sh.n_heads}", f"--model.ffn_dim={sh.ffn_dim}",
             "--training.global_batch_size=256"]
    assert len(plan.rows) > 10
    for cand, _ in plan.rows + [plan.requested]:
        assert isinstance(cand.layout, ParallelConfig)
        flags = cand.overrides(sequence_parallel=False).split()
        assert load_config(None, model + flags).parallel == cand.layout


def test_cli_bad_layout_names_the_field(capsys):
    parser = argparse.ArgumentParser()
    add_layout_plan_arguments(parser)
    assert run_layout_plan(parser.parse_args(["--params", "7B", "--dp", "-3"])) == 2
    assert "plan: error: parallel.dp: must be >= 1 or -1, got -3" in capsys.readouterr().err


# --- HSDP: shard within a node, replicate across nodes -------------------------------------


def test_hsdp_shards_state_over_dp_shard_only():
    work = Workload(shape_from_params(7_000_000_000))
    ddp = estimate_memory(work, Candidate.of(1, 16, 1, "ddp"))
    fsdp = estimate_memory(work, Candidate.of(1, 16, 1, "fsdp"))
    hsdp = estimate_memory(work, Candidate.of(1, 16, 1, "fsdp", dp_replicate=2))
    for part in ("weights", "grads", "optimizer"):
        assert getattr(hsdp, part) == pytest.approx(getattr(ddp, part) / 8)   # dp_shard = 8
        assert getattr(fsdp, part) == pytest.approx(getattr(ddp, part) / 16)
    assert hsdp.fsdp_buffers == fsdp.fsdp_buffers > 0
    lay = Candidate.of(1, 16, 1, "fsdp", dp_replicate=2)
    assert lay.name == "HSDP dp=2x8" and lay.to_dict()["dp_shard"] == 8
    with pytest.raises(ValueError, match="--dp-replicate: HSDP"):
        Candidate.of(1, 16, 1, "zero1", dp_replicate=2)


def test_hsdp_candidates_on_several_nodes_only_with_a_node_per_shard_group():
    shape = shape_from_params(7_000_000_000)
    assert not any(c.hsdp for c in candidate_layouts(8, 8, shape))  # one node: no HSDP
    layouts = candidate_layouts(32, 8, shape)
    hsdp = [c for c in layouts if c.hsdp]
    assert {(c.pp, c.tp, c.dp_replicate, c.layout.dp_shard) for c in hsdp} >= {
        (1, 1, 4, 8), (1, 2, 4, 4), (2, 1, 2, 8)}
    for c in hsdp:
        assert c.layout.dp_shard * c.tp == 8  # a shard group is exactly one node
        # Just before FSDP of the same pp and tp: the first sharded layout worth trying.
        fsdp = layouts.index(Candidate.of(c.pp, c.dp, c.tp, "fsdp"))
        assert layouts.index(c) == fsdp - 1


def test_hsdp_recommended_across_nodes_and_fsdp_there_warned():
    work = Workload(shape_from_params(7_000_000_000))
    plan = plan_layout(work, 16, 8, H100)
    assert plan.recommended[0] == Candidate.of(1, 16, 1, "fsdp", dp_replicate=2)
    asked = plan_layout(work, 16, 8, H100, requested=Candidate.of(1, 16, 1, "fsdp"))
    assert "fsdp-across-nodes" in _codes(asked)
    assert "needless-parallelism" not in _codes(asked)  # one piece of advice, not two
    assert any("--parallel.dp_replicate=2" in m for _, m in asked.warnings)
    # FSDP inside one node is not warned about.
    assert "fsdp-across-nodes" not in _codes(plan_layout(work, 8, 8, H100,
                                                         requested=Candidate.of(1, 8, 1, "fsdp")))


def test_cli_hsdp_layout_and_its_flags(capsys):
    rc, out = _run(capsys, "--params", "7B", "--nodes", "2", "--dp", "16", "--dp-replicate", "2")
    assert rc == 0 and "Requested:   HSDP dp=2x8  (fits)" in out
    flags = next(line.split() for line in out.splitlines() if "--parallel.dp_replicate=2" in line)
    par = load_config(None, flags).parallel
    assert (par.dp, par.dp_replicate, par.dp_shard, par.dp_mode) == (16, 2, 8, "fsdp")
    parser = argparse.ArgumentParser()
    add_layout_plan_arguments(parser)
    assert run_layout_plan(parser.parse_args(["--params", "7B", "--nodes", "2", "--dp", "16",
                                       "--dp-replicate", "3"])) == 2
    assert "plan: error: --dp-replicate: 3 does not divide dp=16" in capsys.readouterr().err


def test_recompute_keeps_block_inputs_plus_one_block():
    shape = shape_from_dims(1024, 8, 16, 32000)
    act = activation_bytes_per_layer(2048, 1, 1024, 16)
    inp = block_input_bytes(2048, 1, 1024)
    est = {mode: estimate_memory(Workload(shape, recompute=mode, recompute_every=4),
                                 Candidate.of(1, 1, 1)).activations
           for mode in ("none", "selective", "full")}
    assert est["none"] == pytest.approx(8 * act)
    assert est["full"] == pytest.approx(8 * inp + act)
    assert est["selective"] == pytest.approx(6 * act + 2 * inp + act)  # blocks 3 and 7
    # pp2, 1f1b: a stage holds 4 blocks' inputs per micro-batch in flight (2 - stage).
    pp = estimate_memory(Workload(shape, recompute="full", num_microbatches=4),
                         Candidate.of(2, 1, 1))
    assert pp.activations == pytest.approx(4 * inp * (2 - pp.stage) + act)


@pytest.mark.parametrize("params,seq,gpus", [(7_000_000_000, 8192, 8),
                                             (70_000_000_000, 4096, 64)])
def test_long_sequences_are_advised_full_recompute(params, seq, gpus):
    work = Workload(shape_from_params(params), seq_len=seq)
    plan = plan_layout(work, gpus, 8, H100)
    assert plan.recommended is not None and plan.work.recompute == "full"
    assert plan.warnings[0][0] == "recompute-needed"
    assert "--training.activation_checkpointing=full" in \
        plan.to_dict()["recommended"]["overrides"]
    assert not plan.fits(estimate_memory(work, plan.recommended[0]))


# --- grouped-query attention: k and v are d x kv_dim, not d x d ------------------------------


def test_grouped_query_attention_counts_kv_dim(capsys, tmp_path):
    gqa = ModelConfig(vocab_size=32000, dim=1024, n_layers=8, n_heads=16, n_kv_heads=4,
                      ffn_dim=2816)
    shape = shape_from_dims(gqa.dim, gqa.n_layers, gqa.n_heads, gqa.vocab_size,
                            gqa.hidden_ffn_dim, True, n_kv_heads=gqa.n_kv_heads)
    assert shape.num_params == gqa.num_params()
    assert shape.kv_dim == 256 and shape.layer_params == \
        2 * 1024 * 1024 + 2 * 1024 * 256 + 3 * 1024 * 2816 + 2 * 1024
    # A config with n_kv_heads is planned with its own count.
    toml = tmp_path / "gqa.toml"
    toml.write_text("[model]\nvocab_size = 32000\ndim = 1024\nn_layers = 8\nn_heads = 16\n"
                    "n_kv_heads = 4\nffn_dim = 2816\n")
    rc, out = _run(capsys, "--config", str(toml), "--json")
    data = json.loads(out)
    assert rc == 0 and data["workload"]["shape"]["num_params"] == gqa.num_params()
    # TP must divide the key/value heads too (as ParallelConfig.check says).
    assert {c.tp for c in candidate_layouts(8, 8, shape)} == {1, 2, 4}
    parser = argparse.ArgumentParser()
    add_layout_plan_arguments(parser)
    assert run_layout_plan(parser.parse_args(["--dim", "1024", "--layers", "8", "--heads", "16",
                                       "--kv-heads", "3"])) == 2
    assert "plan: error: --kv-heads: 3 does not divide the 16" in capsys.readouterr().err


# --- mixture of experts: total vs active, experts per ep rank, all-to-all, ep in a node ------

MIXTRAL = ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      ffn_dim=14336, n_experts=8, experts_per_token=2)


def test_moe_counts_total_and_active_parameters_as_the_config():
    shape = shape_from_config(MIXTRAL)
    # Mixtral 8x7B's published sizes: 46.7B parameters, 12.9B active per token.
    assert shape.num_params == MIXTRAL.num_params() and round(shape.num_params / 1e8) == 467
    assert shape.active_params == MIXTRAL.num_params(active=True)
    assert round(shape.active_params / 1e8) == 129
    assert shape.expert_params(range(32)) == 32 * 8 * 3 * 4096 * 14336
    # Every other block, a shared expert and a smaller expert MLP.
    odd = ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, ffn_dim=64, n_experts=4,
                      experts_per_token=2, moe_every=2, n_shared_experts=1, moe_ffn_dim=16)
    s = shape_from_config(odd)
    assert s.moe_layer_ids == (1, 3) and s.num_params == odd.num_params()
    assert s.active_params == odd.num_params(active=True)
    assert s.stage_params(range(2), True, False) + s.stage_params(range(2, 4), False, True) \
        == odd.num_params()


def test_expert_state_per_ep_rank_and_fsdp_gathers_only_local_experts():
    work = Workload(shape_from_config(MIXTRAL), recompute="full")
    sh, pc = work.shape, PRECISIONS["bf16-mixed"]
    experts = sh.expert_params(range(32))
    fsdp = estimate_memory(work, Candidate.of(1, 16, 1, "fsdp"))
    ep8 = estimate_memory(work, Candidate.of(1, 16, 1, "fsdp", ep=8))
    # Under FSDP the dp_shard / ep ranks holding an expert shard it: experts / dp_shard
    # per rank whatever ep; ep shrinks what each MoE block gathers to its own experts.
    assert fsdp.experts == ep8.experts == pytest.approx(experts * 16 / 16)
    assert fsdp.weights == ep8.weights == pytest.approx(sh.num_params * 2 / 16)
    dense_block = sh.stage_params([0], False, False) - sh.expert_params([0])
    per_block = 2 * pc.weight_bytes + pc.grad_bytes
    assert fsdp.fsdp_buffers == pytest.approx((dense_block + experts / 32) * per_block)
    assert ep8.fsdp_buffers == pytest.approx((dense_block + experts / 32 / 8) * per_block)
    # TP splits the dense parts only: the MoE MLPs (router, experts) are whole on every
    # tp rank.
    tp2 = estimate_memory(work, Candidate.of(1, 8, 2, "fsdp", ep=4))
    moe = sh.moe_mlp_params(range(32))
    assert moe == experts + 32 * 8 * 4096
    assert tp2.experts == pytest.approx(experts * 16 / 8)
    assert tp2.weights == pytest.approx(((sh.num_params - moe) / 2 + moe) * 2 / 8)


def test_all_to_all_bytes_per_step():
    sh = shape_from_config(MIXTRAL)
    rows = 4096 * 2 * 2  # seq x micro-batch x top-2
    one_block = rows * 4096 * 2  # dim wide, 2-byte activations
    work = Workload(sh, seq_len=4096, micro_batch=2)
    assert all_to_all_bytes_per_step(work, Candidate.of(1, 8, 1, "fsdp")) == 0
    # Dispatch + combine, forward + backward, of every MoE block; (ep - 1) / ep leaves.
    assert all_to_all_bytes_per_step(work, Candidate.of(1, 8, 1, "fsdp", ep=4)) == \
        pytest.approx(4 * 32 * one_block * 3 / 4)
    # A recomputed block repeats its forward's two.
    full = Workload(sh, seq_len=4096, micro_batch=2, recompute="full")
    assert all_to_all_bytes_per_step(full, Candidate.of(1, 8, 1, "fsdp", ep=2)) == \
        pytest.approx(6 * 32 * one_block / 2)
    # A pipeline stage holds half the blocks and runs every micro-batch.
    piped = Workload(sh, seq_len=4096, micro_batch=2, num_microbatches=4)
    assert all_to_all_bytes_per_step(piped, Candidate.of(2, 4, 1, "fsdp", ep=2)) == \
        pytest.approx(4 * 16 * 4 * one_block / 2)
    assert all_to_all_bytes_per_step(Workload(shape_from_params(7e9)),
                                     Candidate.of(1, 8, 1, "fsdp")) == 0


def test_expert_parallel_groups_stay_inside_a_node():
    sh = shape_from_config(MIXTRAL)
    layouts = candidate_layouts(16, 8, sh)
    with_ep = [c for c in layouts if c.ep > 1]
    assert {(c.tp, c.ep) for c in with_ep if c.pp == 1} == {
        (1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2)}
    for c in with_ep:
        assert c.sharding == "fsdp" and 8 % (c.ep * c.tp) == 0 and c.layout.dp_shard % c.ep == 0
        # After the same layout without experts split: the simpler one first.
        assert layouts.index(c) > layouts.index(Candidate.of(c.pp, c.dp, c.tp, "fsdp",
                                                             c.dp_replicate))
    assert not any(c.ep > 1 for c in candidate_layouts(16, 8, shape_from_params(7e9)))
    work = Workload(sh, recompute="full")
    across = plan_layout(work, 16, 8, H100, requested=Candidate.of(1, 4, 4, "fsdp", ep=4))
    (msg,) = [m for c, m in across.warnings if c == "ep-across-nodes"]
    assert "EP4 x TP4" in msg and "--parallel.ep=2" in msg
    inside = plan_layout(work, 16, 8, H100, requested=Candidate.of(1, 8, 2, "fsdp", ep=4))
    assert "ep-across-nodes" not in _codes(inside)
    dense = plan_layout(Workload(shape_from_params(7e9)), 8, 8, H100,
                        requested=Candidate.of(1, 8, 1, "fsdp", ep=2))
    assert "ep-dense" in _codes(dense)


def test_cli_moe_report_and_json(capsys, tmp_path):
    argv = ["--dim", "4096", "--layers", "32", "--heads", "32", "--kv-heads", "8",
            "--ffn-dim", "14336", "--experts", "8", "--seq-len", "4096", "--nodes", "2",
            "--dp", "8", "--tp", "2", "--ep", "4", "--recompute", "full"]
    rc, out = _run(capsys, *argv)
    assert "Experts   12.88B of them active per token: 8 experts, top-2, in 32 of 32 " \
        "blocks" in out
    assert "Requested:   FSDP dp=8 + EP4 + TP2" in out and "--parallel.ep=4" in out
    assert "a2a/step" in out and "all-to-all 9.0 GiB sent per step" in out
    flags = next(line.split() for line in out.splitlines() if "--parallel.ep=4" in line)
    assert load_config(None, [*flags, "--model.n_experts=8"]).parallel.ep == 4
    rc, out = _run(capsys, *argv, "--json")
    data = json.loads(out)
    assert data["active_params"] == MIXTRAL.num_params(active=True)
    assert data["requested"]["layout"]["ep"] == 4
    assert data["requested"]["all_to_all_bytes_per_step"] == pytest.approx(
        4 * 32 * 4096 * 2 * 4096 * 2 * 3 / 4 + 2 * 32 * 4096 * 2 * 4096 * 2 * 3 / 4)
    # A config's MoE keys and ep are its own; flags override them.
    toml = tmp_path / "moe.toml"
    toml.write_text("[model]\nvocab_size = 64\ndim = 32\nn_layers = 4\nn_heads = 4\n"
                    "n_experts = 4\nmoe_every = 2\n[parallel]\ndp = 4\nep = 2\n")
    rc, out = _run(capsys, "--config", str(toml), "--gpus-per-node", "4", "--json")
    data = json.loads(out)
    assert data["workload"]["shape"]["moe_layer_ids"] == [1, 3]
    assert data["requested"]["layout"]["ep"] == 2
    rc, out = _run(capsys, "--config", str(toml), "--gpus-per-node", "4", "--experts", "8",
                   "--json")
    assert json.loads(out)["workload"]["shape"]["n_experts"] == 8


@pytest.mark.parametrize("argv,fragment", [
    (["--params", "47B", "--experts", "8"], "--experts and the other mixture-of-experts flags"),
    (["--dim", "64", "--layers", "2", "--heads", "4", "--experts", "1"],
     "model.n_experts: must be 0 (dense) or >= 2"),
    (["--dim", "64", "--layers", "2", "--heads", "4", "--experts", "4", "--dp", "8",
      "--ep", "3"], "parallel.ep: 3 does not divide parallel.dp_shard=8"),
    (["--dim", "64", "--layers", "2", "--heads", "4", "--experts", "4", "--dp", "8",
      "--ep", "2", "--dp-mode", "ddp"], "parallel.ep: is 2 but expert parallelism composes "
                                        "with FSDP2 only"),
])
def test_cli_bad_moe_input_exits_2(capsys, argv, fragment):
    parser = argparse.ArgumentParser()
    add_layout_plan_arguments(parser)
    assert run_layout_plan(parser.parse_args(argv)) == 2
    assert fragment in capsys.readouterr().err
