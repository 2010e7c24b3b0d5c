"""Config tree: TOML loading, overrides, validation messages, fingerprint, round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckpt.cadence import Interval
from trainer.config import (
    Config,
    ConfigError,
    TrainingConfig,
    config_fingerprint,
    config_from_argv,
    config_from_dict,
    config_to_dict,
    config_to_toml,
    field_docs,
    load_config,
    num_transformer_params,
)
from trainer.memory_model import shape_from_dims
from trainer.model import Transformer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("name,world", [("tiny", 2), ("3d_cpu", 8), ("gpu_1b", 8)])
def test_shipped_configs_load_and_resolve(name, world):
    cfg = load_config(str(CONFIGS / f"{name}.toml"), [])
    r = cfg.resolved(world)
    p = r.parallel
    assert p.pp * p.dp * p.tp == world
    assert r.micro_batch_size >= 1


def test_3d_cpu_layout():
    p = load_config(str(CONFIGS / "3d_cpu.toml"), []).parallel
    assert (p.pp, p.dp, p.tp) == (2, 2, 2)


def test_stable_override_keys_both_forms():
    cfg = load_config(None, [
        "--training.steps=50", "--parallel.pp", "2", "--parallel.dp=1", "--parallel.tp", "2",
        "--checkpoint.root=/tmp/ck", "--checkpoint.interval", "300s",
        "--checkpoint.load_step=40", "--model.n_layers=4",
    ])
    assert cfg.training.steps == 50
    assert (cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.tp) == (2, 1, 2)
    assert cfg.checkpoint.root == "/tmp/ck"
    assert Interval.parse(cfg.checkpoint.interval) == Interval("seconds", seconds=300.0)
    assert cfg.checkpoint.load_step == 40


def test_override_types():
    cfg = load_config(None, [
        "--training.betas=0.8,0.99", "--training.lr", "1e-3", "--checkpoint.async_save", "false",
        "--checkpoint.load_step=none", "--checkpoint.storage_options.endpoint_url=http://h:9",
        "--checkpoint.storage_options.anon=true", "--fault.handle_preemption",
    ])
    assert cfg.training.betas == (0.8, 0.99) and cfg.training.lr == 1e-3
    assert cfg.checkpoint.async_save is False and cfg.checkpoint.load_step is None
    assert cfg.checkpoint.storage_options == {"endpoint_url": "http://h:9", "anon": True}
    assert cfg.fault.handle_preemption is True


def test_override_beats_file_and_later_beats_earlier(tmp_path):
    path = _write(tmp_path, "[training]\nsteps = 5\nlr = 0.01\n")
    cfg = load_config(path, ["--training.steps=7", "--training.steps=9"])
    assert cfg.training.steps == 9 and cfg.training.lr == 0.01


def test_config_from_argv():
    cfg = config_from_argv(["--config", str(CONFIGS / "tiny.toml"), "--training.steps=3"])
    assert cfg.training.steps == 3 and cfg.model.dim == 64
    cfg = config_from_argv([f"--config={CONFIGS / 'tiny.toml'}"])
    assert cfg.model.dim == 64


@pytest.mark.parametrize("args,expected", [
    (["--training.stpes=5"], "unknown key 'training.stpes' (did you mean 'training.steps'?)"),
    (["--trainig.steps=5"], "unknown section 'trainig' (did you mean 'training'?)"),
    (["--steps=5"], "did you mean '--training.steps'?"),
    (["--training.lr=abc"], "training.lr: expected a number, got 'abc'"),
    (["--training.steps=2.5"], "training.steps: expected an integer"),
    (["--training.lr=-1"], "training.lr: must be > 0"),
    (["--parallel.tp=3"], "parallel.tp: 3 does not divide model.n_heads=4"),
    (["--checkpoint.interval=5x"], "checkpoint.interval: invalid checkpoint interval '5x'"),
    (["--checkpoint.verify=ful"], "did you mean 'full'?"),
    (["--parallel.dp_mode=ddp", "--parallel.tp=2"], "parallel.dp_mode: 'ddp' does not compose"),
    (["--training.seq_len=4096"], "training.seq_len: 4096 exceeds model.max_seq_len=2048"),
    (["--parallel.pp_schedule=1f1b", "--parallel.stages_per_rank=2"], "parallel.stages_per_rank"),
    (["--training.steps"], "--training.steps needs a value"),
    (["training.steps=5"], "unexpected argument"),
])
def test_override_errors_name_the_key(args, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    assert expected in str(e.value)


def test_value_error_says_where_it_was_set(tmp_path):
    path = _write(tmp_path, "[training]\nlr = -1.0\n")
    with pytest.raises(ConfigError, match=r"training\.lr: must be > 0.*\(set in .*job\.toml\)"):
        load_config(path, [])
    with pytest.raises(ConfigError, match=r"\(set by --training\.lr=-2\)"):
        load_config(None, ["--training.lr=-2"])


def test_file_errors_name_the_file(tmp_path):
    path = _write(tmp_path, "[training]\nstpes = 5\n")
    with pytest.raises(ConfigError, match=r"job\.toml: unknown key 'training\.stpes'"):
        load_config(path, [])
    path = _write(tmp_path, "[trainig]\nsteps = 5\n")
    with pytest.raises(ConfigError, match=r"job\.toml: unknown section 'trainig'"):
        load_config(path, [])
    path = _write(tmp_path, "steps = 5\n")
    with pytest.raises(ConfigError, match=r"under \[training\]"):
        load_config(path, [])
    path = _write(tmp_path, "[training\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(path, [])
    path = _write(tmp_path, '[training]\nsteps = "5"\n')
    with pytest.raises(ConfigError, match="training.steps: expected an integer"):
        load_config(path, [])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "missing.toml"), [])


def test_unreadable_config_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"--config .* is a folder; pass a TOML file"):
        load_config(str(tmp_path), [])
    deep = tmp_path / "deep.toml"
    deep.write_text("[training]\nbetas = " + "[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(ConfigError, match=r"deep\.toml: invalid TOML: .*nested too deeply"):
        load_config(str(deep), [])
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes("# d\u00e9j\u00e0 vu\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.toml: not UTF-8 text"):
        load_config(str(latin1), [])
    nested = "[" * 50_000 + "]" * 50_000
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(None, [f"--checkpoint.storage_options.x={nested}"])
    with pytest.raises(ConfigError, match=r"checkpoint\.storage_options: expected .*\.\.\.'"):
        load_config(None, [f"--checkpoint.storage_options={nested}"])


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


# Every spelling of the one interval grammar (ckpt.cadence.policies.Interval.parse), through the config.
@pytest.mark.parametrize("text,expected", [
    ("auto", Interval("auto")), ("AUTO", Interval("auto")), ("50", Interval("steps", steps=50)),
    ("300s", Interval("seconds", seconds=300.0)), ("30sec", Interval("seconds", seconds=30.0)),
    ("5m", Interval("seconds", seconds=300.0)), ("5min", Interval("seconds", seconds=300.0)),
    ("1h", Interval("seconds", seconds=3600.0)), ("2.5s", Interval("seconds", seconds=2.5)),
    ("1d", Interval("seconds", seconds=86400.0)), ("500ms", Interval("seconds", seconds=0.5)),
    (" 10 MIN ", Interval("seconds", seconds=600.0)),
])
def test_interval_spellings_load_from_cli_and_toml(tmp_path, text, expected):
    cfg = load_config(None, [f"--checkpoint.interval={text}"])
    assert Interval.parse(cfg.checkpoint.interval) == expected
    cfg = load_config(_write(tmp_path, f'[checkpoint]\ninterval = "{text}"\n'), [])
    assert Interval.parse(cfg.checkpoint.interval) == expected


@pytest.mark.parametrize("bad", ["0", "-5", "s", "10 steps", "0s", "", "1.5", "5x", "1w"])
def test_interval_rejects_with_key_value_and_forms(bad):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"--checkpoint.interval={bad}"])
    message = str(e.value)
    assert message.startswith("checkpoint.interval: ") and repr(bad) in message
    assert "'auto'" in message and "'30sec'" in message and "\n" not in message
    assert e.value.key == "checkpoint.interval"


def test_interval_as_toml_integer(tmp_path):
    cfg = load_config(_write(tmp_path, "[checkpoint]\ninterval = 50\n"), [])
    assert cfg.checkpoint.interval == "50"
    assert Interval.parse(cfg.checkpoint.interval) == Interval("steps", steps=50)


def test_resolved_fills_dp_and_checks_world():
    cfg = load_config(None, ["--parallel.pp=2", "--model.n_layers=4"])
    r = cfg.resolved(4)
    assert (r.parallel.dp, r.parallel.n_microbatches) == (2, 4)
    assert cfg.parallel.dp == -1  # the original is untouched
    with pytest.raises(ConfigError, match="world size 3 is not divisible"):
        cfg.resolved(3)
    with pytest.raises(ConfigError, match=r"pp \* dp \* tp = 1 \* 2 \* 1 != world size 4"):
        load_config(None, ["--parallel.dp=2"]).resolved(4)
    with pytest.raises(ConfigError, match="global_batch_size: 16 is not divisible"):
        load_config(None, ["--training.grad_accum_steps=4"]).resolved(8)
    with pytest.raises(ConfigError, match="parallel.dp: is -1"):
        _ = cfg.local_batch_size


def test_batch_sizes():
    r = load_config(None, ["--training.global_batch_size=32", "--training.grad_accum_steps=2"]
                    ).resolved(4)
    assert (r.local_batch_size, r.micro_batch_size) == (8, 4)


def test_round_trips(tmp_path):
    cfg = load_config(str(CONFIGS / "gpu_1b.toml"),
                      ["--checkpoint.storage_options.endpoint_url=http://x",
                       "--checkpoint.load_step=7"])
    d = config_to_dict(cfg)
    assert config_from_dict(json.loads(json.dumps(d))) == cfg
    path = tmp_path / "out.toml"
    path.write_text(config_to_toml(cfg))
    assert load_config(str(path), []) == cfg
    assert load_config(str(path), []) == load_config(str(path), [])


def test_config_from_dict_rejects_unknown():
    with pytest.raises(ConfigError, match="unknown key 'model.dims'"):
        config_from_dict({"model": {"dims": 3}})


def test_fingerprint_ignores_run_length_storage_and_layout():
    base = config_fingerprint(load_config(None, []))
    same = load_config(None, [
        "--training.steps=999", "--checkpoint.root=s3://b/x", "--checkpoint.interval=10",
        "--metrics.port=9100", "--training.log_every=1", "--parallel.tp=2",
        "--training.grad_accum_steps=2", "--fault.nan_policy=stop", "--training.device=cpu",
    ])
    assert config_fingerprint(same) == base
    assert len(base) == 16 and int(base, 16) >= 0


@pytest.mark.parametrize("override", [
    "--training.lr=0.1", "--training.seed=1", "--model.dim=128", "--data.seed=3",
    "--training.global_batch_size=32", "--training.mixed_precision=bf16",
    "--training.betas=0.9,0.9", "--data.synthetic_noise=0.1",
])
def test_fingerprint_changes_with_the_problem(override):
    assert config_fingerprint(load_config(None, [override])) != \
        config_fingerprint(load_config(None, []))


def test_fingerprint_uses_data_file_base_name_only():
    a = load_config(None, ["--data.kind=tokens", "--data.path=/mnt/a/tok.bin"])
    b = load_config(None, ["--data.kind=tokens", "--data.path=/data/tok.bin"])
    assert config_fingerprint(a) == config_fingerprint(b)


def test_every_field_documented():
    docs = field_docs()
    assert len(docs) > 40
    for key, _type, _default, help_text in docs:
        assert help_text and "\n" not in help_text, key
    keys = {d[0] for d in docs}
    for stable in ("training.steps", "parallel.pp", "parallel.dp", "parallel.tp",
                   "checkpoint.root", "checkpoint.interval", "checkpoint.load_step"):
        assert stable in keys


def test_lr_schedule():
    t = TrainingConfig(steps=100, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert t.lr_at(0) == pytest.approx(0.1) and t.lr_at(9) == pytest.approx(1.0)
    assert t.lr_at(10) == pytest.approx(1.0)
    assert t.lr_at(100) == pytest.approx(0.1) and t.lr_at(500) == pytest.approx(0.1)
    assert 0.1 < t.lr_at(55) < 1.0


def test_sections_validate_on_direct_construction():
    with pytest.raises(ConfigError, match="training.steps: expected an integer"):
        TrainingConfig(steps="5")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="training.global_batch_size: 10 is not divisible"):
        TrainingConfig(global_batch_size=10, grad_accum_steps=3)
    assert Config().model.hidden_ffn_dim == 256


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_one_parameter_count_for_the_model_its_stages_and_the_planner(activation):
    # The [model] section is the model's own config; its one count is the built model's,
    # stage by stage, and the layout planner's exact shape counts the same.
    cfg = load_config(str(CONFIGS / "gpu_1b.toml"), [f"--model.activation={activation}"]).model
    with torch.device("meta"):
        whole = Transformer(cfg)
        first = Transformer(cfg, layer_ids=range(3), has_output=False)
        middle = Transformer(cfg, layer_ids=range(3, 5), has_embedding=False, has_output=False)
        last = Transformer(cfg, layer_ids=range(5, 7), has_embedding=False)
    dims = (cfg.dim, cfg.hidden_ffn_dim, cfg.vocab_size)
    gated = activation == "swiglu"
    assert cfg.num_params() == sum(p.numel() for p in whole.parameters())
    for part, first_stage, last_stage in ((first, True, False), (middle, False, False),
                                          (last, False, True)):
        assert num_transformer_params(*dims, n_layers=len(part.layers), gated_mlp=gated,
                                      has_embedding=first_stage, has_output=last_stage) == \
            sum(p.numel() for p in part.parameters())
    shape = shape_from_dims(cfg.dim, cfg.n_layers, cfg.n_heads, cfg.vocab_size,
                            cfg.hidden_ffn_dim, gated)
    assert shape.num_params == cfg.num_params()
    if gated:
        assert 0.9e9 < cfg.num_params() < 1.2e9


# -- timeouts: the process group's after the hang watchdog ------------------------------------
def test_process_group_timeout_is_derived_after_the_hang_watchdog():
    cfg = Config()
    f = cfg.fault
    assert (f.hang_timeout_seconds, f.blocking_save_grace_seconds) == (300.0, 3600.0)
    assert f.process_group_timeout_seconds is None
    assert cfg.process_group_timeout_seconds() == 300.0 + 3600.0 + 60.0
    assert cfg.process_group_timeout_seconds() > cfg.hang_deadline_seconds()
    # It follows the values it is derived from, the metrics linger only with a port.
    cfg = load_config(None, ["--fault.hang_timeout_seconds=900",
                             "--fault.blocking_save_grace_seconds=100"])
    assert cfg.process_group_timeout_seconds() == 900 + 100 + 60
    cfg = load_config(None, ["--metrics.port=9100", "--metrics.linger_seconds=30"])
    assert cfg.process_group_timeout_seconds() == 300 + 3600 + 30 + 60
    cfg = load_config(None, ["--fault.hang_timeout_seconds=0"])  # watchdog off: the grace
    assert cfg.process_group_timeout_seconds() == 3600 + 60


def test_an_explicit_process_group_timeout_is_kept_when_it_comes_later():
    cfg = load_config(None, ["--fault.process_group_timeout_seconds=7200"])
    assert cfg.process_group_timeout_seconds() == 7200.0
    cfg = load_config(None, ["--fault.hang_timeout_seconds=60",
                             "--fault.blocking_save_grace_seconds=600",
                             "--fault.process_group_timeout_seconds=720"])
    assert cfg.process_group_timeout_seconds() == 720.0


@pytest.mark.parametrize("args,least", [
    (["--fault.process_group_timeout_seconds=300"], 3960),  # NCCL's old 300 s: equal to hang
    (["--fault.process_group_timeout_seconds=3900"], 3960),  # no margin
    (["--fault.hang_timeout_seconds=60", "--fault.blocking_save_grace_seconds=600",
      "--fault.process_group_timeout_seconds=719"], 720),
    (["--metrics.port=9100", "--fault.process_group_timeout_seconds=3960"], 3975),
])
def test_a_process_group_timeout_before_the_hang_watchdog_is_refused(args, least):
    with pytest.raises(ConfigError) as info:
        load_config(None, args)
    message = str(info.value)
    assert info.value.key == "fault.process_group_timeout_seconds"
    assert message.startswith("fault.process_group_timeout_seconds: ")
    for field in ("fault.hang_timeout_seconds", "fault.blocking_save_grace_seconds"):
        assert field in message, message
    assert ("metrics.linger_seconds" in message) == ("--metrics.port=9100" in args)
    assert f"set it to {least} or more" in message and "leave it unset" in message, message
    assert "set by --fault.process_group_timeout_seconds=" in message  # where it came from


def test_timeout_fields_are_validated():
    with pytest.raises(ConfigError, match="fault.blocking_save_grace_seconds: must be >= 0"):
        load_config(None, ["--fault.blocking_save_grace_seconds=-1"])
    with pytest.raises(ConfigError, match="fault.process_group_timeout_seconds: must be >= 1"):
        load_config(None, ["--fault.process_group_timeout_seconds=0"])
    assert load_config(None, ["--fault.process_group_timeout_seconds=none"]) \
        .fault.process_group_timeout_seconds is None


def test_layout_names_every_axis_in_use():
    """The start-up line's layout: pipeline, data and tensor always; HSDP's split and the
    experts' ep only when in use."""
    def layout(*args: str, world: int) -> str:
        return load_config(None, ["--model.n_layers=4", *args]).resolved(world).parallel.layout

    assert layout("--parallel.pp=2", world=4) == "pp2 dp2 tp1"
    assert layout("--parallel.dp_replicate=2", world=4) == "pp1 dp4 tp1 (HSDP 2x2)"
    assert layout("--model.n_experts=4", "--parallel.ep=2", world=4) == "pp1 dp4 tp1 ep2"
