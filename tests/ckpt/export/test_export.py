"""Consolidation of a checkpoint into full tensors in one process: ``ckpt.export.consolidate``
and ``export`` (the code behind ``ckpt export``), including a 2-rank FSDP2 save (sharded ->
full) checked against the full tensors gathered by the saving job itself, and an exported
optimizer state turned into torch's own form (``to_torch_optimizer_state``), which a plain
optimizer loads and steps on bit for bit.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch

import ckpt
from ckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckpt.export import export
from ckpt.export._consolidate import consolidate
from tests.ckpt import _mgr_workers as workers
from tests.ckpt._helpers import assert_same, flip_byte, snapshot
from tests.dist import run_ranks

pytestmark = pytest.mark.timeout(240)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory):
    """A 2-rank FSDP2 (model + AdamW) checkpoint at step 11, and its full state."""
    root = str(tmp_path_factory.mktemp("fsdp") / "root")
    results = run_ranks(workers.fsdp_save_body, 2, root, timeout=180)
    full = torch.load(io.BytesIO(results[0]["state"]), weights_only=True)
    return root, full, results[0]["local_numel"]


def _flat(obj, prefix=""):
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    if isinstance(obj, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in obj):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flat(v, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: obj}


def test_consolidate_fsdp2_sharded_to_full(fsdp_checkpoint):
    root, full, local_numel = fsdp_checkpoint
    manifest = ckpt.CheckpointStore(root).read_manifest(11, complete=True)
    assert manifest.world_size == 2
    w = manifest.tensors["app.model.0.weight"]
    assert w["shape"] == [8, 6] and len(w["chunks"]) == 2  # really sharded over 2 ranks
    assert local_numel == 24
    assert {r.rank for r in manifest.files.values()} == {0, 1}

    state, m = consolidate(root, 11)
    assert m.step == 11
    assert_same(snapshot(full["app"]["model"]), state["app"]["model"], "model")
    assert_same(snapshot(full["app"]["optim"]["state"]), state["app"]["optim"]["state"],
                "optim")
    assert state["step"] == 11
    # ModelState saves the param groups once each, keyed by their first parameter, with
    # their index in the optimizer.
    group, index = state["app"]["optim"]["groups"]["0.weight"]["hyper"]
    assert group["lr"] == 1e-2 and group["betas"] == (0.9, 0.999) and index == 0
    # The newest step by default.
    assert consolidate(root)[1].step == 11


def test_cli_export_fsdp2_to_pt_and_safetensors(fsdp_checkpoint, tmp_path):
    root, full, _ = fsdp_checkpoint
    st, pt = str(tmp_path / "full.safetensors"), str(tmp_path / "full.pt")
    r = subprocess.run([sys.executable, "-m", "ckpt", "export", root, "--step", "11", "--out",
                        st], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "exported step 11" in r.stdout
    from safetensors.torch import load_file

    tensors = load_file(st)
    expected = {k: v for k, v in _flat(snapshot(full)).items() if isinstance(v, torch.Tensor)}
    assert_same(expected, tensors)
    assert tensors["app.model.0.weight"].shape == (8, 6)

    export(root, 11, pt)
    loaded = torch.load(pt, weights_only=True)
    assert_same(snapshot(full["app"]["model"]), loaded["app"]["model"])
    assert_same(snapshot(full["app"]["optim"]["state"]), loaded["app"]["optim"]["state"])
    # The exported model loads straight into a plain (unsharded) module.
    model = workers._mlp()
    model.load_state_dict(loaded["app"]["model"])
    assert torch.equal(model[0].weight.detach(), full["app"]["model"]["0.weight"])


def test_consolidate_flat_missing_and_corrupt(tmp_path):
    root = str(tmp_path / "root")
    state = {"net": {"w": torch.randn(3, 2), "b": torch.arange(4, dtype=torch.int32)},
             "seq": [torch.ones(2), torch.zeros(1)], "step": 5,
             "cfg": {"name": "x", "pair": (1, 2.5), "raw": b"\xff", "none": None}}
    ckpt.save(state, root, 5)
    ckpt.save({**state, "step": 6}, root, 6)
    nested, m = consolidate(root, 5)
    assert m.step == 5
    assert_same(snapshot(state), nested)
    flat, _ = consolidate(root, 5, nested=False)
    assert set(flat) == {"net.w", "net.b", "seq.0", "seq.1", "step", "cfg.name", "cfg.pair",
                         "cfg.raw", "cfg.none"}
    assert flat["cfg.pair"] == (1, 2.5) and flat["cfg.none"] is None
    assert consolidate(root)[0]["step"] == 6

    with pytest.raises(CheckpointNotFoundError, match="step_000000007"):
        consolidate(root, 7)
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        consolidate(str(tmp_path / "empty"))

    d = os.path.join(root, "step_000000006")
    flip_byte(os.path.join(d, sorted(n for n in os.listdir(d) if n.endswith(".bin"))[0]))
    out = str(tmp_path / "bad.pt")
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        export(root, 6, out)
    assert not os.path.exists(out)
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    with pytest.raises(ValueError, match=".safetensors"):
        export(root, 5, str(tmp_path / "x.bin"))

    # Safetensors: non-tensor values keep their exact types through ckpt.format.codec's JSON.
    st = str(tmp_path / "ok.safetensors")
    export(root, 5, st)
    from safetensors import safe_open

    from ckpt.format import decode_object

    with safe_open(st, "pt") as f:
        objects = json.loads(f.metadata()["ckpt_objects"])
        assert set(f.keys()) == {"net.w", "net.b", "seq.0", "seq.1"}
    assert decode_object(json.dumps(objects["cfg.raw"]).encode()) == b"\xff"
    assert decode_object(json.dumps(objects["cfg.pair"]).encode()) == (1, 2.5)


def _two_groups(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    # Group order unlike the model's, lrs diverging: indices follow the optimizer's groups.
    optim = torch.optim.AdamW([{"params": model[1].parameters()},
                               {"params": model[0].parameters(), "weight_decay": 0.0}],
                              lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, [lambda k: 1.0, lambda k: 0.5 ** k])
    return model, optim, sched


class _Flattened:
    """Model and optimizer state flattened as the trainer saves it (keys by parameter)."""

    def __init__(self, model, optim):
        self.model, self.optim = model, optim

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        from ckpt.dcp import init_optimizer_state, pack_optimizer_state, param_group_names

        init_optimizer_state(self.optim)
        osd = get_optimizer_state_dict(self.model, self.optim,
                                       options=StateDictOptions(flatten_optimizer_state_dict=True))
        return {"model": self.model.state_dict(), "optim": pack_optimizer_state(
            osd, groups=[param_group_names(self.model, self.optim)])}

    def load_state_dict(self, sd):
        raise AssertionError("saved only")


def _step_all(pairs, seed: int) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    for model, optim in pairs:
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad()


@pytest.mark.parametrize("flat", [False, True], ids=["unflattened", "flattened"])
def test_an_exported_optimizer_state_loads_into_a_plain_torch_optimizer(flat, tmp_path):
    from ckpt.dcp import ModelState
    from ckpt.export import to_torch_optimizer_state

    root, out = str(tmp_path / "root"), str(tmp_path / "full.pt")
    model, optim, sched = _two_groups(0)
    for i in range(3):
        _step_all([(model, optim)], i)
        sched.step()
    ckpt.save({"app": (_Flattened if flat else ModelState)(model, optim)}, root, 3)
    export(root, 3, out)
    exported = torch.load(out, weights_only=True)["app"]
    names = {p: n for n, p in model.named_parameters()}
    groups = [[names[p] for p in g["params"]] for g in optim.param_groups]
    # The groups' indices give their order, flattened too; or they are given.
    torch_sd = to_torch_optimizer_state(exported["optim"])
    assert to_torch_optimizer_state(exported["optim"], groups) == torch_sd
    expected = optim.state_dict()
    assert torch_sd["param_groups"] == expected["param_groups"]
    assert_same(expected["state"], torch_sd["state"])
    fresh, fresh_optim, _ = _two_groups(1)
    fresh.load_state_dict(exported["model"])
    fresh_optim.load_state_dict(torch_sd)
    assert [g["lr"] for g in fresh_optim.param_groups] == [1e-2, 1e-2 / 8]
    for i in range(2):  # the next steps, bit for bit
        _step_all([(model, optim), (fresh, fresh_optim)], 10 + i)
        for a, b in zip(model.parameters(), fresh.parameters()):
            assert torch.equal(a, b)
    # Groups that the checkpoint gives different values are refused, naming the key.
    from ckpt.errors import StateMismatchError

    with pytest.raises(StateMismatchError, match="'lr' is 0.01 in .* and 0.00125 in"):
        to_torch_optimizer_state(exported["optim"], [groups[0] + groups[1]])
    with pytest.raises(ValueError, match=r"param_groups\[0\]: the checkpoint's optimizer state "
                                         r"has no parameter 2.weight"):
        to_torch_optimizer_state(exported["optim"], [["2.weight"]])


def test_a_sharded_optimizer_state_in_torchs_form(fsdp_checkpoint):
    from ckpt.export import to_torch_optimizer_state

    root, full, _ = fsdp_checkpoint
    state, _ = consolidate(root, 11)
    torch_sd = to_torch_optimizer_state(state["app"]["optim"])
    model = workers._mlp()
    model.load_state_dict(state["app"]["model"])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optim.load_state_dict(torch_sd)  # the sizes and the group fit a plain optimizer
    names = [n for n, _ in model.named_parameters()]
    for i, name in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optim.state_dict()["state"][i][key],
                               full["app"]["optim"]["state"][name][key]), (name, key)
        assert float(optim.state_dict()["state"][i]["step"]) == 1.0
