"""Layout validation (pure: no process group) and the stage split."""

from __future__ import annotations

import pytest

from trainer.mesh import ParallelConfig, validate_layout
from trainer.model import ModelConfig
from trainer.pipeline import split_layers, stage_ids_for_rank

MODEL = ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, ffn_dim=64, max_seq_len=16)


def check(par: ParallelConfig, world_size=None, batch=8, seq_len=16, model=MODEL):
    validate_layout(model, par, par.world_size if world_size is None else world_size, batch, seq_len)


@pytest.mark.parametrize(
    "par",
    [
        ParallelConfig(),
        ParallelConfig(pp=2, dp=2, tp=2, n_microbatches=2),
        ParallelConfig(pp=2, stages_per_rank=2, schedule="interleaved1f1b", n_microbatches=4),
        ParallelConfig(dp=4, dp_mode="ddp", n_microbatches=2),
        ParallelConfig(tp=4, sequence_parallel=True),
        ParallelConfig(pp=4, schedule="gpipe", n_microbatches=2),
    ],
)
def test_valid_layouts_pass(par):
    check(par)


@pytest.mark.parametrize(
    "par,kwargs,fragments",
    [
        (ParallelConfig(dp=2, tp=2), dict(world_size=8), ["world size 8", "parallel.pp * parallel.dp * parallel.tp", "= 4"]),
        (ParallelConfig(tp=3), dict(world_size=3), ["parallel.tp = 3", "model.n_heads = 4"]),
        (ParallelConfig(tp=8), {}, ["parallel.tp = 8", "model.n_heads"]),
        (ParallelConfig(tp=2), dict(model=ModelConfig(dim=32, n_heads=2, ffn_dim=33)), ["parallel.tp = 2", "ffn_dim", "33"]),
        (ParallelConfig(pp=8, n_microbatches=8), dict(batch=8), ["8 pipeline stages", "model.n_layers = 4", "lower parallel.pp"]),
        (ParallelConfig(pp=2, stages_per_rank=4, schedule="interleaved1f1b", n_microbatches=2), {}, ["parallel.pp * parallel.stages_per_rank = 8", "model.n_layers = 4"]),
        (ParallelConfig(pp=2, stages_per_rank=2, schedule="1f1b", n_microbatches=2), {}, ["parallel.stages_per_rank = 2", "interleaved1f1b"]),
        (ParallelConfig(dp=3), dict(world_size=3), ["global batch size 8", "parallel.dp = 3"]),
        (ParallelConfig(dp=2, n_microbatches=3), {}, ["parallel.n_microbatches = 3", "8 / 2 = 4"]),
        (ParallelConfig(pp=4, schedule="1f1b", n_microbatches=2), {}, ["parallel.n_microbatches = 2", "4 pipeline stages", "raise n_microbatches"]),
        (ParallelConfig(pp=2, schedule="interleaved1f1b", n_microbatches=5), dict(batch=10), ["parallel.n_microbatches = 5", "multiple"]),
        (ParallelConfig(dp=2, tp=2, dp_mode="ddp"), {}, ["parallel.dp_mode = 'ddp'", "parallel.tp = 2", "fsdp"]),
        (ParallelConfig(), dict(seq_len=32), ["sequence length 32", "model.max_seq_len = 16"]),
        (ParallelConfig(tp=4, sequence_parallel=True), dict(seq_len=14), ["parallel.sequence_parallel", "14"]),
    ],
)
def test_invalid_layouts_name_the_field(par, kwargs, fragments):
    with pytest.raises(ValueError) as err:
        check(par, **kwargs)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(tp=0), "parallel.tp must be an integer >= 1"),
        (dict(n_microbatches=0), "parallel.n_microbatches"),
        (dict(schedule="zb"), "parallel.schedule must be one of"),
        (dict(dp_mode="zero3"), "parallel.dp_mode must be one of"),
        (dict(param_dtype="fp8"), "parallel.param_dtype"),
    ],
)
def test_parallel_config_fields(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        ParallelConfig(**kwargs)


def test_schedule_name_is_case_insensitive():
    assert ParallelConfig(schedule="Interleaved1F1B").schedule == "interleaved1f1b"


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(dim=30, n_heads=4), "model.dim (30) must be divisible by model.n_heads (4)"),
        (dict(dim=12, n_heads=4), "must be even"),
        (dict(activation="relu"), "model.activation"),
        (dict(n_layers=0), "model.n_layers must be >= 1"),
    ],
)
def test_model_config_fields(kwargs, fragment):
    with pytest.raises(ValueError) as err:
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
