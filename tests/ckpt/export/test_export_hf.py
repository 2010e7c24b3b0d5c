"""Model-only exports: ``ckpt export --select/--dtype`` and ``--format hf``.

A checkpoint saved the way the trainer saves (``app.model.*`` beside optimizer, RNG and data
state) exports to a file or a Hugging Face folder that the model loads with no renaming:
the trainer's ``Transformer`` through ``load_state_dict``, a ``LlamaForCausalLM`` through
``from_pretrained`` (config.json saved as an attachment), sharded or not, with identical
logits. Nothing is downloaded: the Llama model is built from a tiny config.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest
import torch

import ckpt
from ckpt.cli import main as ckpt_main
from ckpt.dcp import ModelState, RNGState
from ckpt.errors import CorruptCheckpointError
from ckpt.export import export, parse_dtype, select_keys
from ckpt.export._consolidate import consolidate
from ckpt.format import step_dirname
from tests.ckpt._helpers import flip_byte
from trainer.config import ModelConfig
from trainer.model import Transformer

pytestmark = pytest.mark.timeout(180)

TOKENS = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4]])


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = ckpt_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _trainer_model(seed: int) -> Transformer:
    cfg = ModelConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=16)
    model = Transformer(cfg)
    model.init_weights(seed)
    return model


@pytest.fixture(scope="module")
def trainer_ckpt(tmp_path_factory):
    """A trainer-like checkpoint: model + AdamW (one step taken), RNG, data position."""
    root = str(tmp_path_factory.mktemp("trainer") / "root")
    torch.manual_seed(0)
    model = _trainer_model(1)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(TOKENS).float().pow(2).mean().backward()
    optim.step()
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = {"app": ModelState(model, optim), "rng": RNGState(0),
             "data": {"pos": torch.tensor([12], dtype=torch.int64), "epoch": 1},
             "ema": {"model": ema}, "step": 3}
    ckpt.save(state, root, 3, attachments={"notes.txt": b"tiny trainer model"})
    with torch.no_grad():
        logits = model(TOKENS)
    return root, model, logits


def test_select_strips_and_loads_into_the_trainer_model(trainer_ckpt, tmp_path, capsys):
    root, model, logits = trainer_ckpt
    st, pt = str(tmp_path / "model.safetensors"), str(tmp_path / "model.pt")
    code, out, err = _cli(capsys, "export", root, "--step", "3", "--select", "app.model.",
                          "--out", st)
    assert code == 0, err
    assert "exported step 3" in out
    from safetensors.torch import load_file

    tensors = load_file(st)
    assert set(tensors) == set(model.state_dict())  # no optimizer, RNG or data state
    fresh = _trainer_model(seed=99)
    fresh.load_state_dict(tensors, strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(TOKENS), logits)

    # .pt: the same flat dict, loaded with weights_only; `app.model` (no dot) is the same
    # path prefix.
    export(root, 3, pt, select=["app.model"])
    sd = torch.load(pt, weights_only=True)
    fresh = _trainer_model(seed=98)
    fresh.load_state_dict(sd, strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(TOKENS), logits)


def test_dtype_casts_floating_tensors_only(trainer_ckpt, tmp_path, capsys):
    root, model, _ = trainer_ckpt
    st = str(tmp_path / "bf16.safetensors")
    code, _, err = _cli(capsys, "export", root, "--select", "app.model.", "--select", "data.",
                        "--dtype", "bf16", "--out", st)
    assert code == 0, err
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = load_file(st)
    assert tensors["pos"].dtype == torch.int64 and tensors["pos"].tolist() == [12]
    for k, v in model.state_dict().items():
        assert tensors[k].dtype == torch.bfloat16
        assert torch.equal(tensors[k], v.to(torch.bfloat16))
    with safe_open(st, "pt") as f:
        assert json.loads(f.metadata()["ckpt_objects"]) == {"epoch": 1}  # objects kept
    # .pt without a selection keeps the nested layout; floats cast, ints and objects not.
    pt = str(tmp_path / "all.pt")
    export(root, 3, pt, dtype=torch.float16)
    full = torch.load(pt, weights_only=True)
    assert full["app"]["model"]["output.weight"].dtype == torch.float16
    assert full["data"]["pos"].dtype == torch.int64 and full["step"] == 3
    exp_avg = next(iter(full["app"]["optim"]["state"].values()))["exp_avg"]
    assert exp_avg.dtype == torch.float16
    for text, dtype in [("fp16", torch.float16), ("float32", torch.float32),
                        ("torch.bfloat16", torch.bfloat16), ("BF16", torch.bfloat16),
                        ("half", torch.float16)]:
        assert parse_dtype(text) is dtype
    for bad in ("int8", "fp8", "complex64", ""):
        with pytest.raises(ValueError, match="expected a floating dtype"):
            parse_dtype(bad)
    code, _, err = _cli(capsys, "export", root, "--dtype", "int32", "--out", st)
    assert code == 2 and "--dtype 'int32'" in err and len(err.strip().splitlines()) == 1


def test_select_collisions_and_misses(trainer_ckpt, tmp_path, capsys):
    root, _, _ = trainer_ckpt
    out = str(tmp_path / "x.safetensors")
    code, _, err = _cli(capsys, "export", root, "--select", "app.model.", "--select", "ema.model.",
                        "--out", out)
    assert code == 2 and len(err.strip().splitlines()) == 1
    m = re.search(r"keys '(app|ema)\.model\.(\S+)' and '(app|ema)\.model\.\2' both become "
                  r"'\2'", err)
    assert m and {m.group(1), m.group(3)} == {"app", "ema"}, err
    assert not os.path.exists(out)
    code, _, err = _cli(capsys, "export", root, "--select", "app.modl.", "--out", out)
    assert code == 2 and "--select 'app.modl.' matches no key" in err and "app.model." in err
    # Overlapping prefixes: the longest is stripped.
    assert select_keys(["a.b.w", "a.c"], ["a.", "a.b."]) == {"w": "a.b.w", "c": "a.c"}
    with pytest.raises(ValueError, match="'a.c' and 'a.b.c' both become 'c'"):
        select_keys(["a.b.w", "a.c", "a.b.c"], ["a.", "a.b."])
    assert select_keys(["x.y.z", "x.q"], ["x.y"]) == {"z": "x.y.z"}
    flat, _ = consolidate(root, 3, select=["data."])
    assert set(flat) == {"pos", "epoch"} and flat["epoch"] == 1


def test_usage_errors_are_one_line(trainer_ckpt, tmp_path, capsys):
    root, _, _ = trainer_ckpt
    for argv, needle in [
        ([], "give --out"),
        (["--out", str(tmp_path / "m.safetensors"), "--max-shard-size", "1MB"],
         "--max-shard-size applies to --format hf only"),
        (["--format", "hf", "--out", str(tmp_path / "d"), "--max-shard-size", "lots"],
         "invalid size 'lots'"),
        (["--format", "hf", "--out", str(tmp_path / "d"), "--no-config"],
         "hf holds tensors only"),
        (["--format", "hf", "--out", str(tmp_path / "d"), "--select", "app.model."],
         "step 3 has no config.json attachment"),
        (["--out", str(tmp_path / "m.safetensors"), "--no-config"],
         "--no-config applies to --format hf only"),
        (["--out", str(tmp_path / "m.bin")], "use a .pt/.pth or .safetensors"),
    ]:
        code, _, err = _cli(capsys, "export", root, *argv)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "d")


def test_attachments_written_after_the_weights(trainer_ckpt, tmp_path, capsys):
    root, _, _ = trainer_ckpt
    out, files = str(tmp_path / "m.safetensors"), str(tmp_path / "files")
    code, text, err = _cli(capsys, "export", root, "--select", "app.model.", "--out", out,
                           "--attachments", files)
    assert code == 0, err
    assert "wrote 1 attachment(s) of step 3" in text and os.path.exists(out)
    assert open(os.path.join(files, "notes.txt"), "rb").read() == b"tiny trainer model"
    # Damaged weights: the export fails (exit 1) and writes neither the file nor the
    # attachments.
    import shutil

    copy = str(tmp_path / "copy")
    shutil.copytree(root, copy)
    d = os.path.join(copy, step_dirname(3))
    for name in os.listdir(d):
        if name.startswith("r00000_"):
            flip_byte(os.path.join(d, name), 0)
    out2, files2 = str(tmp_path / "m2.safetensors"), str(tmp_path / "files2")
    code, _, err = _cli(capsys, "export", copy, "--out", out2, "--attachments", files2)
    assert code == 1 and "checksum mismatch" in err
    assert not os.path.exists(out2) and not os.path.exists(files2)


# -- Hugging Face ------------------------------------------------------------------------------
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (the `test` extra of pyproject.toml)")


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    return cfg, model


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf") / "root")
    cfg, model = _llama()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(TOKENS).logits.float().pow(2).mean().backward()
    optim.step()
    state = {"app": ModelState(model, optim), "rng": RNGState(0), "step": 7}
    ckpt.save(state, root, 7, attachments={
        "config.json": cfg.to_json_string().encode(),
        "tokenizer_config.json": b'{"model_max_length": 32}'})
    with torch.no_grad():
        logits = model(TOKENS).logits
    return root, model, logits


def _from_pretrained(path, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kw).eval()


@needs_transformers
def test_hf_folder_loads_with_from_pretrained(hf_ckpt, tmp_path, capsys):
    root, model, logits = hf_ckpt
    out = str(tmp_path / "hf")
    code, _, err = _cli(capsys, "export", root, "--step", "7", "--format", "hf", "--select",
                        "app.model.", "--out", out)
    assert code == 0, err
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors",
                                       "tokenizer_config.json"]
    loaded = _from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, logits)
    assert json.load(open(os.path.join(out, "tokenizer_config.json"))) == {"model_max_length": 32}


@needs_transformers
def test_hf_sharded_with_index(hf_ckpt, tmp_path, capsys):
    root, model, logits = hf_ckpt
    out = str(tmp_path / "sharded")
    code, _, err = _cli(capsys, "export", root, "--format", "hf", "--select", "app.model.",
                        "--max-shard-size", "10kB", "--out", out)
    assert code == 0, err
    names = sorted(os.listdir(out))
    shards = [n for n in names if n.startswith("model-")]
    n = len(shards)
    assert n > 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert "model.safetensors" not in names and "config.json" in names
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    sd = model.state_dict()
    assert set(index["weight_map"]) == set(sd)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in sd.values())
    from safetensors.torch import load_file

    for shard in shards:
        part = load_file(os.path.join(out, shard))
        size = sum(t.numel() * t.element_size() for t in part.values())
        assert size <= 10_000 or len(part) == 1  # a larger tensor gets a shard of its own
    loaded = _from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, logits)


@needs_transformers
def test_hf_dtype_and_python_api(hf_ckpt, tmp_path):
    root, model, _ = hf_ckpt
    out = str(tmp_path / "bf16")
    export(root, 7, out, format="hf", select=["app.model."], dtype="bfloat16")
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(out, "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    loaded = _from_pretrained(out, dtype=torch.bfloat16)
    got = loaded.state_dict()
    for k, v in model.state_dict().items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16)), k
    with torch.no_grad():  # (its rotary tables stay float32: logits close, not equal)
        torch.testing.assert_close(loaded(TOKENS).logits.float(), model(TOKENS).logits,
                                   atol=0.05, rtol=0.05)


@needs_transformers
def test_hf_refuses_non_empty_folder_and_fails_cleanly(hf_ckpt, tmp_path, capsys, monkeypatch):
    root, _, logits = hf_ckpt
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = _cli(capsys, "export", root, "--format", "hf", "--select", "app.model.",
                        "--out", str(out))
    assert code == 2 and "not empty" in err and "--force" in err
    assert os.listdir(out) == ["keep.txt"]
    # An empty folder is fine.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _cli(capsys, "export", root, "--format", "hf", "--select", "app.model.",
                "--out", str(empty))[0] == 0
    assert "model.safetensors" in os.listdir(empty)

    # A failure while writing (the disk fills up at the second shard) leaves neither a
    # half-written folder nor a temporary one, and a replaced folder as it was.
    import safetensors.torch

    real = safetensors.torch.save_file
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    fresh = tmp_path / "fresh"
    code, _, err = _cli(capsys, "export", root, "--format", "hf", "--select", "app.model.",
                        "--max-shard-size", "10kB", "--out", str(fresh))
    assert code == 2 and "No space left" in err
    assert not fresh.exists()
    calls.clear()
    code, _, err = _cli(capsys, "export", root, "--format", "hf", "--select", "app.model.",
                        "--max-shard-size", "10kB", "--out", str(out), "--force")
    assert code == 2 and os.listdir(out) == ["keep.txt"]
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    monkeypatch.undo()
    # --force replaces the folder whole.
    code, _, err = _cli(capsys, "export", root, "--format", "hf", "--select", "app.model.",
                        "--out", str(out), "--force")
    assert code == 0, err
    assert "keep.txt" not in os.listdir(out)
    with torch.no_grad():
        assert torch.equal(_from_pretrained(str(out), dtype=torch.float32)(TOKENS).logits,
                           logits)
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n or n.endswith(".old")]


@needs_transformers
def test_attachments_exported_and_checked(hf_ckpt, tmp_path, capsys):
    root, _, _ = hf_ckpt
    extra = str(tmp_path / "extra")
    code, out, err = _cli(capsys, "export", root, "--attachments", extra)
    assert code == 0, err
    assert "wrote 2 attachment(s) of step 7" in out
    assert sorted(os.listdir(extra)) == ["config.json", "tokenizer_config.json"]
    assert open(os.path.join(extra, "config.json"), "rb").read() == \
        ckpt.read_attachment(root, 7, "config.json")
    code, _, err = _cli(capsys, "export", root, "--attachments", extra)
    assert code == 2 and "already exist" in err and "--force" in err
    assert _cli(capsys, "export", root, "--attachments", extra, "--force")[0] == 0

    # A damaged attachment fails the export (exit 1) before anything is written.
    copy = tmp_path / "copy"
    import shutil

    shutil.copytree(root, copy)
    m = ckpt.CheckpointStore(str(copy)).read_manifest(7)
    flip_byte(os.path.join(copy, step_dirname(7), m.attachments["config.json"].file), 2)
    out_dir = str(tmp_path / "out")
    code, _, err = _cli(capsys, "export", str(copy), "--format", "hf", "--select", "app.model.",
                        "--out", out_dir)
    assert code == 1 and "attachment 'config.json': checksum mismatch" in err
    assert not os.path.exists(out_dir)
    with pytest.raises(CorruptCheckpointError):
        export(str(copy), 7, None, attachments_dir=str(tmp_path / "att2"))
    assert not os.path.exists(tmp_path / "att2") or not os.listdir(tmp_path / "att2")


def test_hf_attachment_cannot_shadow_the_weights(tmp_path):
    root = str(tmp_path / "root")
    ckpt.save({"m": {"w": torch.ones(2)}}, root, 1,
              attachments={"model.safetensors": b"not weights"})
    with pytest.raises(ValueError, match="'model.safetensors' has the name of an exported"):
        export(root, 1, str(tmp_path / "hf"), format="hf", select=["m."])
    assert not os.path.exists(tmp_path / "hf")


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_exported_files_respect_the_umask(tmp_path, umask):
    """Every exported file (shards, index, attachments, single files) gets the permissions
    any new file gets under the process's umask, as the folder does."""
    root = str(tmp_path / "root")
    ckpt.save({"m": {"a": torch.ones(3000), "b": torch.ones(3000)}}, root, 1,
              attachments={"config.json": b"{}", "tokenizer.json": b"{}"})
    old = os.umask(umask)
    try:
        export(root, 1, str(tmp_path / "sharded"), format="hf", select=["m."],
               max_shard_size="13kB")
        export(root, 1, str(tmp_path / "single"), format="hf", select=["m."])
        export(root, 1, str(tmp_path / "m.safetensors"), select=["m."],
               attachments_dir=str(tmp_path / "files"))
        export(root, 1, str(tmp_path / "all.pt"))
    finally:
        os.umask(old)
    files = [tmp_path / "m.safetensors", tmp_path / "all.pt"]
    for folder in ("sharded", "single", "files"):
        assert (tmp_path / folder).stat().st_mode & 0o777 == 0o777 & ~umask, folder
        files += list((tmp_path / folder).iterdir())
    assert len(files) == 2 + 5 + 3 + 2
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in files}
    assert modes == {p.name: oct(0o666 & ~umask) for p in files}


def test_hf_without_config_is_refused_unless_no_config(trainer_ckpt, tmp_path, capsys):
    """from_pretrained cannot load a folder without config.json ("Unrecognized model"):
    the export says so before reading anything, and --no-config writes the weights alone."""
    root, model, _ = trainer_ckpt
    out = tmp_path / "hf"
    code, _, err = _cli(capsys, "export", root, "--format", "hf", "--select", "app.model.",
                        "--out", str(out))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "no config.json attachment" in err and "from_pretrained" in err
    assert "--no-config" in err and not out.exists()
    with pytest.raises(ValueError, match="no_config=True"):
        export(root, 3, str(out), format="hf", select=["app.model."])
    code, _, err = _cli(capsys, "export", root, "--format", "hf", "--select", "app.model.",
                        "--no-config", "--out", str(out))
    assert code == 0, err
    assert sorted(os.listdir(out)) == ["model.safetensors", "notes.txt"]
    from safetensors.torch import load_file

    assert set(load_file(out / "model.safetensors")) == set(model.state_dict())


def _named_ckpt(root, names_doc):
    ckpt.save({"m": {"w": torch.ones(2), "b": torch.zeros(3)}, "opt": {"lr": 0.1},
               "ema": {"w": torch.ones(2), "b": torch.zeros(3)}}, root, 1,
              attachments={"config.json": b'{"model_type": "x"}',
                           "hf_export.json": json.dumps(names_doc).encode()})


def test_hf_export_names_from_the_checkpoint(tmp_path):
    """A checkpoint's hf_export.json selects the weights and names them as the Hugging
    Face class does; it is not copied into the folder."""
    from safetensors.torch import load_file

    root = str(tmp_path / "root")
    _named_ckpt(root, {"select": "m.", "names": {"w": "model.w", "b": "model.b"}})
    for select, out in ((None, "a"), (["m."], "b"), (["m"], "c")):
        export(root, 1, str(tmp_path / out), format="hf", select=select)
        assert sorted(os.listdir(tmp_path / out)) == ["config.json", "model.safetensors"]
        got = load_file(tmp_path / out / "model.safetensors")
        assert set(got) == {"model.w", "model.b"} and got["model.w"].tolist() == [1.0, 1.0]
    # Another selection keeps the keys as they are; --attachments writes the file as is.
    export(root, 1, str(tmp_path / "d"), format="hf", select=["ema."],
           attachments_dir=str(tmp_path / "files"))
    assert set(load_file(tmp_path / "d" / "model.safetensors")) == {"w", "b"}
    assert "hf_export.json" in os.listdir(tmp_path / "files")


def test_hf_export_splits_a_stacked_tensor_into_named_slices(tmp_path):
    """A key named by a list of n names is n tensors stacked on its first dimension (a
    mixture of experts' experts): each name gets its slice, as a tensor of its own."""
    from safetensors.torch import load_file

    root = str(tmp_path / "root")
    stacked = torch.arange(24.0).view(3, 4, 2)
    ckpt.save({"m": {"experts": stacked, "b": torch.zeros(3)}}, root, 1,
              attachments={"config.json": b'{"model_type": "x"}', "hf_export.json": json.dumps(
                  {"select": "m.", "names": {"experts": [f"e.{i}.w" for i in range(3)],
                                             "b": "model.b"}}).encode()})
    export(root, 1, str(tmp_path / "hf"), format="hf", max_shard_size=100)
    got = {}
    for name in os.listdir(tmp_path / "hf"):
        if name.endswith(".safetensors"):
            got.update(load_file(tmp_path / "hf" / name))
    assert set(got) == {"e.0.w", "e.1.w", "e.2.w", "model.b"}
    for i in range(3):
        assert torch.equal(got[f"e.{i}.w"], stacked[i])


def test_hf_export_refused_by_the_checkpoint_names_why(tmp_path, capsys):
    """A model no Hugging Face class holds says why in its hf_export.json: the export is
    refused with that line (not the generic missing config.json), and --no-config writes
    the selected weights under their own names."""
    from safetensors.torch import load_file

    root = str(tmp_path / "root")
    why = "model.moe_every=2: dense blocks between MoE ones; set model.moe_every=1"
    ckpt.save({"m": {"w": torch.ones(2)}, "opt": {"lr": 0.1}}, root, 1, attachments={
        "hf_export.json": json.dumps({"select": "m.", "refused": why}).encode()})
    with pytest.raises(ValueError, match=re.escape(f"step 1 has no Hugging Face "
                                                   f"architecture: {why}")):
        export(root, 1, str(tmp_path / "hf"), format="hf")
    code, _, err = _cli(capsys, "export", root, "--format", "hf", "--out",
                        str(tmp_path / "hf"))
    assert code == 2 and why in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "hf")
    export(root, 1, str(tmp_path / "hf"), format="hf", no_config=True)
    assert sorted(os.listdir(tmp_path / "hf")) == ["model.safetensors"]
    assert set(load_file(tmp_path / "hf" / "model.safetensors")) == {"w"}


@pytest.mark.parametrize("doc, needle", [
    ({"select": "m.", "refused": "two\nlines"}, "'refused' must be one line"),
    ({"select": "m.", "names": {"w": "model.w"}}, "names no Hugging Face key for 'b'"),
    ({"select": "m.", "names": {"w": "x", "b": "x"}}, "two tensors one name"),
    ({"select": "m.", "names": {"w": ["x", "y", "z"], "b": "b"}},
     "splits 'w' into 3 tensors, but its shape is [2] (the first dimension must be 3)"),
    ({"select": "m.", "names": {"w": ["x", "y"], "b": ["b", "x"]}}, "two tensors one name"),
    ({"select": "m.", "names": {"w": [], "b": "b"}}, "'names' must map each key"),
    ({"select": "", "names": {}}, "'select' must be a key prefix"),
    ({"select": "m.", "names": ["w"]}, "'names' must map each key"),
    ({"select": "m.", "names": {"w": 5, "b": "y"}}, "'names' must map each key"),
    ([1, 2], "'select' must be a key prefix"),
])
def test_hf_export_names_that_do_not_fit_are_refused(tmp_path, doc, needle):
    root = str(tmp_path / "root")
    _named_ckpt(root, doc)
    with pytest.raises(ValueError, match=re.escape(needle)):
        export(root, 1, str(tmp_path / "hf"), format="hf")
    assert not os.path.exists(tmp_path / "hf")
