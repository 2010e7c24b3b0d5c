"""Activation checkpointing (``training.activation_checkpointing``): recomputing blocks in
backward changes nothing but memory.

The recomputed blocks really run their forward twice (counted by a forward hook on the
attention) and keep less for backward (the saved tensors are counted); losses and gradient
norms are bit-identical to a run without recomputation in one process, on dp2 (FSDP2 and
DDP), tp2 with sequence parallelism and pp2; parameter names and state-dict keys are
unchanged, so a state saved without recomputation loads with it and the reverse, bit for
bit. A SIGKILLed job without it, resumed with it, ends bit for bit where an uninterrupted
job without it ends. The key is a layout choice: the config fingerprint ignores it.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.e2e._jobs import (
    COMMON,
    STEPS as E2E_STEPS,
    Job,
    all_losses,
    assert_same_checkpoint,
    loss_history,
    straight_run,
    trainer_argv,
)
from tests.trainer import _parallel_worker as w
from trainer.config import (
    ConfigError,
    config_fingerprint,
    load_config,
    recomputed_layers,
)
from trainer.mesh import build_mesh, dp_mesh
from trainer.parallelize import build_parallel_model

ALL = frozenset(range(w.MODEL.n_layers))
STEPS = 4


def _attention_calls(pm) -> dict[str, int]:
    """Count each block's attention forward calls (a hook on the real module)."""
    calls: dict[str, int] = {}
    for part in pm.model_parts:
        for name, block in part.layers.items():
            calls[name] = 0

            def hook(_m, _i, _o, name=name):
                calls[name] += 1

            block.attention.register_forward_hook(hook)
    return calls


def test_keys_choose_the_blocks_and_leave_the_fingerprint():
    cfg = load_config(None, [])
    assert cfg.training.activation_checkpointing == "none"
    assert cfg.training.recomputed_layers(8) == frozenset()
    full = load_config(None, ["--training.activation_checkpointing=full"])
    assert full.training.recomputed_layers(8) == frozenset(range(8))
    sel = load_config(None, ["--training.activation_checkpointing=selective",
                             "--training.activation_checkpointing_every=3"])
    assert sel.training.recomputed_layers(8) == {2, 5}
    assert recomputed_layers("selective", 2, range(4, 8)) == {5, 7}  # global indices
    # A layout choice: the trajectory (and so the checkpoints' fingerprint) is the same.
    assert config_fingerprint(cfg) == config_fingerprint(full) == config_fingerprint(sel) \
        == "0aa0915fc6a699d3"
    with pytest.raises(ConfigError, match=r"^training.activation_checkpointing: .*'full'"):
        load_config(None, ["--training.activation_checkpointing=ful"])
    with pytest.raises(ConfigError, match=r"^training.activation_checkpointing_every: "):
        load_config(None, ["--training.activation_checkpointing_every=0"])


@pytest.mark.parametrize("layers", [ALL, frozenset({1, 3})], ids=["full", "selective"])
def test_one_process_recomputes_and_is_bit_identical(layers):
    plain = build_parallel_model(w.MODEL, w.layout(), None, w.SEED)
    ac = build_parallel_model(w.MODEL, w.layout(), None, w.SEED, recomputed_layers=layers)
    calls = _attention_calls(ac)
    want, got = w.train(plain, 0, 1, steps=STEPS), w.train(ac, 0, 1, steps=STEPS)
    assert got == want
    # One forward per step, plus one recomputation in backward for the chosen blocks.
    assert calls == {str(i): STEPS * (2 if i in layers else 1)
                     for i in range(w.MODEL.n_layers)}
    for (name, a), (name_b, b) in zip(plain.model_parts[0].named_parameters(),
                                      ac.model_parts[0].named_parameters()):
        assert name == name_b and torch.equal(a, b), name


def _saved_bytes(pm) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    x, y = w.make_batches(1)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pm.train_step(x, y)
    return total


def test_recomputed_blocks_keep_less_for_backward():
    plain = _saved_bytes(build_parallel_model(w.MODEL, w.layout(), None, w.SEED))
    half = _saved_bytes(build_parallel_model(w.MODEL, w.layout(), None, w.SEED,
                                             recomputed_layers={1, 3}))
    full = _saved_bytes(build_parallel_model(w.MODEL, w.layout(), None, w.SEED,
                                             recomputed_layers=ALL))
    assert full < half < plain


def test_states_load_across_with_and_without_bit_for_bit():
    plain = build_parallel_model(w.MODEL, w.layout(), None, w.SEED)
    ac = build_parallel_model(w.MODEL, w.layout(), None, w.SEED + 1, recomputed_layers=ALL)
    assert list(plain.model_state_dict()) == list(ac.model_state_dict())
    assert [n for n, _ in plain.model_parts[0].named_parameters()] == \
        [n for n, _ in ac.model_parts[0].named_parameters()]
    w.train(plain, 0, 1, steps=2)
    ac.load_model_state_dict(plain.model_state_dict())
    back = build_parallel_model(w.MODEL, w.layout(), None, w.SEED + 2)
    back.load_model_state_dict(ac.model_state_dict())
    for key, value in plain.model_state_dict().items():
        assert torch.equal(ac.model_state_dict()[key], value), key
        assert torch.equal(back.model_state_dict()[key], value), key


def _rank_compare(rank: int, world_size: int, layouts: list[dict]) -> list:
    """On every rank: for each layout, train without and with recomputation (all blocks,
    then blocks 1 and 3); return the three results per layout."""
    w._flush_result_queue_at_exit()
    out = []
    for kwargs in layouts:
        par = w.layout(**kwargs)
        mesh = build_mesh(par, "cpu")
        runs = []
        for layers in ((), ALL, frozenset({1, 3})):
            pm = build_parallel_model(w.MODEL, par, mesh, w.SEED, recomputed_layers=layers)
            runs.append(w.train(pm, dp_mesh(mesh).get_local_rank(), par.dp, steps=STEPS))
        out.append(runs)
    return out


LAYOUTS = [dict(dp=2), dict(dp=2, dp_mode="ddp"), dict(tp=2, sequence_parallel=True),
           dict(pp=2)]


def test_every_layout_is_bit_identical_with_recomputation():
    results = run_ranks(_rank_compare, 2, LAYOUTS, timeout=120)
    for rank_result in results:
        for kwargs, (plain, full, selective) in zip(LAYOUTS, rank_result):
            assert full == plain, (kwargs, plain, full)
            assert selective == plain, (kwargs, plain, selective)


def test_killed_without_resumed_with_is_bit_identical(tmp_path):
    """dp2 (FSDP2): SIGKILL a job without recomputation after its first commit, resume it
    with every block recomputed; it ends bit for bit where the uninterrupted job without
    recomputation ends (losses of every step, replayed ones too, and the final checkpoint)."""
    ref_root, ref_events = straight_run(COMMON, nproc=2)
    root, jsonl = tmp_path / "ckpt", tmp_path / "events.jsonl"
    argv = trainer_argv(*COMMON, f"--checkpoint.root={root}", f"--metrics.jsonl_path={jsonl}",
                        nproc=2)
    first = Job(argv, tmp_path, "killed", jsonl)
    first.wait_event(lambda e: e["kind"] == "save_committed", what="the first commit")
    first.wait_step(10)
    first.kill_all()
    assert first.proc.returncode == -9, first.tails()
    resumed = Job(argv[:] + ["--training.activation_checkpointing=full"], tmp_path, "resumed",
                  jsonl).wait_ok()
    assert "resumed from" in resumed.stdout + resumed.stderr, resumed.tails()
    ref, got = loss_history(ref_events), loss_history(resumed.events())
    assert sorted(got) == list(range(1, E2E_STEPS + 1))
    assert got == ref, {s: (got[s], ref[s]) for s in ref if got.get(s) != ref[s]}
    for step, values in all_losses(resumed.events()).items():
        assert all(v == ref[step] for v in values), (step, values, ref[step])
    assert_same_checkpoint(ref_root, root, E2E_STEPS)
