"""The trainer's checkpoints export to a Hugging Face folder that transformers loads as a
``LlamaForCausalLM`` with the model's logits (one process, in-process trainers; nothing is
downloaded), and a GELU model, which no Hugging Face architecture matches, says so.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from ckpt.cli import main as cli_main
from ckpt.export import consolidate
from tests.e2e._jobs import TINY
from trainer.config import ModelConfig, load_config
from trainer.distributed import DistEnv
from trainer.hf import HF_SELECT, hf_config, hf_names
from trainer.model import Transformer
from trainer.train import Trainer

pytestmark = pytest.mark.timeout(180)

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (the `test` extra of pyproject.toml)")

ARGS = ("--training.steps=3", "--checkpoint.interval=100", "--checkpoint.async_save=false",
        "--checkpoint.keep_last=0", "--model.rope_theta=500", "--model.norm_eps=1e-6")


def _train(root, *extra: str) -> Trainer:
    cfg = load_config(str(TINY), [*ARGS, f"--checkpoint.root={root}", *extra])
    trainer = Trainer(cfg, DistEnv(0, 1, 0, torch.device("cpu"), None, 0))
    assert trainer.fit() == 0
    return trainer


def _own_model(root, cfg: ModelConfig) -> Transformer:
    """The trained model, rebuilt from the checkpoint under the model's own names."""
    weights, _ = consolidate(str(root), select=[HF_SELECT])
    model = Transformer(cfg)
    model.load_state_dict(weights, strict=True)
    return model.eval()


@pytest.mark.parametrize("shape", [{}, {"n_layers": 3, "ffn_dim": 40, "n_heads": 2}])
def test_llama_names_cover_every_weight_once(shape):
    cfg = ModelConfig(**shape)
    names = hf_names(cfg)
    assert set(names) == set(Transformer(cfg).state_dict())
    assert len(set(names.values())) == len(names)
    config = hf_config(cfg)
    assert config["num_hidden_layers"] == cfg.n_layers
    assert config["intermediate_size"] == cfg.hidden_ffn_dim


@needs_transformers
def test_trainer_checkpoint_exports_a_llama_folder_with_the_same_logits(tmp_path, capsys):
    root = tmp_path / "ckpt"
    trainer = _train(root)
    out = tmp_path / "hf"
    # The command the README shows, and the shortest one: the checkpoint says what to select.
    for argv, folder in ((["--select", HF_SELECT], out), ([], tmp_path / "hf2")):
        code = cli_main(["export", str(root), "--format", "hf", "--out", str(folder), *argv])
        assert code == 0, capsys.readouterr().err
        assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    assert AutoConfig.from_pretrained(out, local_files_only=True).model_type == "llama"
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True,
                                              dtype=torch.float32).eval()
    assert isinstance(hf, LlamaForCausalLM)
    # Every weight loaded (none left at its random init): the same tensors, renamed.
    ours = _own_model(root, trainer.model_cfg)
    names = hf_names(trainer.model_cfg)
    got = hf.state_dict()
    for key, value in ours.state_dict().items():
        assert torch.equal(got[names[key]], value), key
    tokens = torch.randint(0, trainer.model_cfg.vocab_size, (2, 24),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)


@needs_transformers
def test_gelu_model_has_no_hf_config_and_says_so(tmp_path, capsys, caplog):
    root = tmp_path / "ckpt"
    with caplog.at_level("INFO", logger="trainer"):
        _train(root, "--model.activation=gelu")
    assert "has no Hugging Face architecture" in caplog.text
    assert hf_config(ModelConfig(activation="gelu")) is None
    out = tmp_path / "hf"
    code = cli_main(["export", str(root), "--format", "hf", "--select", HF_SELECT,
                     "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "no config.json attachment" in err and "--no-config" in err, err
    assert not out.exists()
    # The weights alone, under the model's own names.
    code = cli_main(["export", str(root), "--format", "hf", "--select", HF_SELECT,
                     "--no-config", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    from safetensors.torch import load_file

    weights = load_file(out / "model.safetensors")
    assert set(weights) == set(Transformer(ModelConfig(activation="gelu", vocab_size=256,
                                                       dim=64, ffn_dim=256)).state_dict())
    assert sorted(os.listdir(out)) == ["model.safetensors"]
