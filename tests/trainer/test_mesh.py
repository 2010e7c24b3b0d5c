"""The layout type (trainer.config.ParallelConfig): its rules, where they run, and the
stage split."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer.config import Config, ConfigError, ModelConfig, ParallelConfig, load_config
from trainer.mesh import build_mesh
from trainer.parallelize import build_parallel_model
from trainer.pipeline import split_layers, stage_ids_for_rank

MODEL = ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, ffn_dim=64, max_seq_len=16)


def check(par: ParallelConfig, world_size=None, batch=8, seq_len=16, model=MODEL):
    if world_size is not None:
        par = par.resolved(world_size)
    par.check(model, global_batch_size=batch, seq_len=seq_len)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(dp=1),
        dict(pp=2, dp=2, tp=2, n_microbatches=2),
        dict(pp=2, dp=1, stages_per_rank=2, pp_schedule="interleaved1f1b", n_microbatches=4),
        dict(dp=4, dp_mode="ddp", n_microbatches=2),
        dict(dp=1, tp=4, sequence_parallel=True),
        dict(pp=4, dp=1, pp_schedule="gpipe", n_microbatches=2),
        dict(pp=2, tp=2),  # dp = -1: the rest of the world
        dict(dp_replicate=2, dp_shard=2, tp=2, sequence_parallel=True),  # HSDP x TP
        dict(pp=2, dp_replicate=2, n_microbatches=2),  # HSDP x PP, dp = the rest
    ],
)
def test_valid_layouts_pass(kwargs):
    par = ParallelConfig(**kwargs)
    check(par, world_size=None if par.dp == -1 else par.world_size)
    check(par, world_size=8 if par.dp == -1 else par.world_size)


# (layout kwargs, check kwargs, the key at fault, fragments of the message)
INVALID = [
    (dict(dp=2, tp=2), dict(world_size=8), "parallel.dp", ["pp * dp * tp = 1 * 2 * 2 != world size 8"]),
    (dict(tp=3), dict(world_size=4), "parallel.tp", ["world size 4 is not divisible by pp * tp = 1 * 3"]),
    (dict(dp=1, tp=3), {}, "parallel.tp", ["3 does not divide model.n_heads=4"]),
    (dict(dp=1, tp=8), {}, "parallel.tp", ["8 does not divide model.n_heads=4"]),
    (dict(dp=1, tp=2), dict(model=ModelConfig(dim=32, n_heads=2, ffn_dim=33)), "parallel.tp",
     ["model.ffn_dim", "33"]),
    (dict(pp=8, dp=1, n_microbatches=8), {}, "parallel.pp", ["8 pipeline stages", "model.n_layers=4"]),
    (dict(pp=2, dp=1, stages_per_rank=4, pp_schedule="interleaved1f1b", n_microbatches=2), {},
     "parallel.pp", ["8 pipeline stages (pp * stages_per_rank)", "model.n_layers=4"]),
    (dict(dp=3), {}, "training.global_batch_size", ["8 is not divisible by dp * grad_accum_steps = 3 * 1"]),
    (dict(dp=2, n_microbatches=3), {}, "parallel.n_microbatches", ["micro-batch of 4 sequences", "3 micro-batches"]),
    (dict(dp=2, tp=2, dp_mode="ddp"), {}, "parallel.dp_mode", ["'ddp' does not compose", "parallel.tp=2"]),
    (dict(dp=1, tp=4, sequence_parallel=True), dict(seq_len=14), "parallel.sequence_parallel",
     ["training.seq_len=14"]),
    (dict(dp=1, sequence_parallel=True), {}, "parallel.sequence_parallel", ["needs parallel.tp > 1"]),
    # HSDP: the batch splits over the whole dp degree, replicas and shards both.
    (dict(dp_replicate=2, dp_shard=3), {}, "training.global_batch_size",
     ["8 is not divisible by dp * grad_accum_steps = 6 * 1"]),
    (dict(dp_replicate=4, pp=2), dict(world_size=4), "parallel.dp_replicate",
     ["4 does not divide the dp degree 2"]),
]


@pytest.mark.parametrize("kwargs,check_kwargs,key,fragments", INVALID)
def test_invalid_layouts_name_the_field(kwargs, check_kwargs, key, fragments):
    with pytest.raises(ConfigError) as err:
        check(ParallelConfig(**kwargs), **check_kwargs)
    message = str(err.value)
    assert err.value.key == key and message.startswith(f"{key}: "), message
    assert "\n" not in message and "; " in message  # one line, with the fix after the problem
    for fragment in fragments:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize(
    "kwargs,key,fragment",
    [
        (dict(tp=0), "parallel.tp", "must be >= 1"),
        (dict(dp=0), "parallel.dp", "must be >= 1 or -1"),
        (dict(pp="2"), "parallel.pp", "expected an integer"),
        (dict(n_microbatches=-1), "parallel.n_microbatches", "must be >= 0"),
        (dict(pp_schedule="zb"), "parallel.pp_schedule", "must be one of"),
        (dict(dp_mode="zero3"), "parallel.dp_mode", "must be one of"),
        (dict(pp=2, stages_per_rank=2, pp_schedule="1f1b"), "parallel.stages_per_rank", "interleaved1f1b"),
        (dict(pp=4, pp_schedule="1f1b", n_microbatches=2), "parallel.n_microbatches", "1f1b needs >= parallel.pp=4"),
        (dict(pp=2, stages_per_rank=2, pp_schedule="interleaved1f1b", n_microbatches=5),
         "parallel.n_microbatches", "multiple"),
    ],
)
def test_single_field_rules_run_on_construction(kwargs, key, fragment):
    with pytest.raises(ConfigError) as err:
        ParallelConfig(**kwargs)
    assert err.value.key == key and str(err.value).startswith(f"{key}: ") and fragment in str(err.value)


def test_schedule_name_is_case_insensitive():
    assert ParallelConfig(pp_schedule="Interleaved1F1B", pp=2, stages_per_rank=2).pp_schedule == \
        "interleaved1f1b"


def test_unresolved_layout_has_no_world_size():
    with pytest.raises(ConfigError, match=r"parallel\.dp: is -1 \(unresolved\)"):
        ParallelConfig().world_size
    par = ParallelConfig(pp=2, tp=2).resolved(8)
    assert (par.dp, par.n_microbatches, par.world_size) == (2, 4, 8)


def test_config_section_and_library_share_one_rule_and_one_message():
    # The [parallel] section is the layout type: the same check, the same words.
    with pytest.raises(ConfigError) as from_config:
        load_config(None, ["--parallel.tp=3"])
    with pytest.raises(ConfigError) as from_library:
        ParallelConfig(tp=3).check(ModelConfig())
    assert type(load_config(None, []).parallel) is ParallelConfig
    assert str(from_config.value).startswith(str(from_library.value))
    assert from_config.value.key == from_library.value.key == "parallel.tp"


def test_layout_rules_run_once_on_the_trainer_path(monkeypatch):
    calls = []
    original = ParallelConfig.check

    def counting(self, *args, **kwargs):
        calls.append(self.dp)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ParallelConfig, "check", counting)
    cfg = Config(model=ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=32))
    calls.clear()
    resolved = cfg.resolved(1)
    assert calls == [1]  # once, on the concrete layout
    build_parallel_model(resolved.model, resolved.parallel, None, seed=0)
    assert calls == [1]  # building the model trusts the checked layout


def test_mesh_and_model_builders_reject_a_layout_for_another_world():
    with pytest.raises(ValueError, match=r"parallel\.dp: world size 1 != parallel\.pp \* parallel\.dp"):
        build_mesh(ParallelConfig(dp=2))
    with pytest.raises(ValueError, match=r"pp \* dp \* tp = 2 but the mesh has 1"):
        build_parallel_model(MODEL, ParallelConfig(dp=2), None, seed=0)
    with pytest.raises(ConfigError, match="unresolved"):
        build_parallel_model(MODEL, ParallelConfig(), None, seed=0)


def test_bf16_is_a_model_option_not_a_layout_field():
    pm = build_parallel_model(MODEL, ParallelConfig(dp=1), None, seed=0, param_dtype=torch.bfloat16)
    assert pm.param_dtype == torch.bfloat16
    assert "param_dtype" not in {f.name for f in dataclasses.fields(ParallelConfig)}


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(dim=30, n_heads=4), "model.dim: 30 is not a multiple of model.n_heads=4"),
        (dict(dim=12, n_heads=4), "head size dim / n_heads = 3 is odd"),
        (dict(activation="relu"), "model.activation: must be one of 'swiglu', 'gelu'"),
        (dict(n_layers=0), "model.n_layers: must be >= 1"),
    ],
)
def test_model_config_fields(kwargs, fragment):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**kwargs)
    assert fragment in str(err.value)


def test_split_layers_even_and_contiguous():
    assert split_layers(4, 4) == [[0], [1], [2], [3]]
    assert split_layers(5, 2) == [[0, 1, 2], [3, 4]]
    assert split_layers(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError, match="at least one layer"):
        split_layers(2, 3)


def test_stage_ids_loop_placement():
    # Interleaved schedules expect rank r to hold stages r, r + pp, ...
    assert stage_ids_for_rank(0, 2, 2) == [0, 2]
    assert stage_ids_for_rank(1, 2, 2) == [1, 3]
    assert stage_ids_for_rank(3, 4, 1) == [3]
