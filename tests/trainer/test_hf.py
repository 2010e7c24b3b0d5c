"""The trainer's checkpoints export to a Hugging Face folder that transformers loads as a
``LlamaForCausalLM`` with the model's logits (one process, in-process trainers; nothing is
downloaded), grouped-query attention included, and a GELU model, which no Hugging Face
architecture matches, says so. The other way, ``checkpoint.initial_load`` refuses a
folder whose ``config.json`` is not the model's in one line naming both values (the
import itself: tests/ckpt/hf/test_hf_import.py and tests/e2e/test_hf_import.py).
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from ckpt.cli import main as cli_main
from ckpt.export._consolidate import consolidate
from ckpt.root import CheckpointStore
from tests.e2e._jobs import TINY
from trainer.config import ConfigError, ModelConfig, load_config
from trainer.distributed import EXIT_CONFIG, DistEnv
from trainer.hf import (
    HF_SELECT,
    check_hf_config,
    hf_attachments,
    hf_config,
    hf_names,
    import_hf,
)
from trainer.model import Transformer
from trainer.train import Trainer, run

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
@pytest.mark.parametrize("heads", [(), ("--model.n_kv_heads=2",)], ids=["mha", "gqa"])
def test_trainer_checkpoint_exports_a_llama_folder_with_the_same_logits(tmp_path, capsys,
                                                                        heads):
    root = tmp_path / "ckpt"
    trainer = _train(root, *heads)
    out = tmp_path / "hf"
    # The command the README shows, and the shortest one: the checkpoint says what to select.
    for argv, folder in ((["--select", HF_SELECT], out), ([], tmp_path / "hf2")):
        code = cli_main(["export", str(root), "--format", "hf", "--out", str(folder), *argv])
        assert code == 0, capsys.readouterr().err
        assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    config = AutoConfig.from_pretrained(out, local_files_only=True)
    assert config.model_type == "llama"
    assert config.num_key_value_heads == trainer.model_cfg.kv_heads
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
    assert "model.activation='gelu'" in caplog.text
    assert hf_config(ModelConfig(activation="gelu")) is None
    out = tmp_path / "hf"
    code = cli_main(["export", str(root), "--format", "hf", "--select", HF_SELECT,
                     "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "no Hugging Face architecture: model.activation='gelu'" in err, err
    assert "--no-config" in err and len(err.strip().splitlines()) == 1, err
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


# -- a mixture of experts: Mixtral ----------------------------------------------------------
MOE_ARGS = ("--model.n_experts=4", "--model.experts_per_token=2", "--model.moe_ffn_dim=48")


def test_mixtral_names_split_each_stacked_expert_weight():
    cfg = load_config(str(TINY), list(MOE_ARGS)).model
    names = hf_names(cfg)
    assert set(names) == set(Transformer(cfg).state_dict())
    assert names["layers.1.moe.router.weight"] == "model.layers.1.block_sparse_moe.gate.weight"
    assert names["layers.1.moe.experts.w2"] == [
        f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight" for e in range(4)]
    flat = [n for v in names.values() for n in ([v] if isinstance(v, str) else v)]
    assert len(set(flat)) == len(flat)
    config = hf_config(cfg)
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"],
            config["intermediate_size"]) == ("mixtral", 4, 2, 48)


@pytest.mark.parametrize("override,fragment", [
    ("--model.moe_every=2", "model.moe_every=2: Mixtral (MixtralForCausalLM) has an MoE MLP "
                            "in every block"),
    ("--model.n_shared_experts=1", "model.n_shared_experts=1: Mixtral (MixtralForCausalLM) "
                                   "has no shared experts; train with model.n_shared_experts=0"),
    ("--model.activation=gelu", "model.activation='gelu': no Hugging Face architecture"),
])
def test_experts_mixtral_cannot_hold_are_refused_in_one_line(override, fragment):
    cfg = load_config(str(TINY), [*MOE_ARGS, override]).model
    assert hf_config(cfg) is None and hf_names(cfg) is None
    doc = json.loads(hf_attachments(cfg)["hf_export.json"])
    assert doc["select"] == HF_SELECT and fragment in doc["refused"], doc
    assert "--no-config" in doc["refused"] and "\n" not in doc["refused"]
    with pytest.raises(ConfigError, match="no Hugging Face architecture to import"):
        import_hf("unused", cfg, None)


@needs_transformers
def test_moe_checkpoint_exports_a_mixtral_folder_with_the_same_logits_and_imports_back(
        tmp_path, capsys):
    root = tmp_path / "ckpt"
    trainer = _train(root, *MOE_ARGS)
    out = tmp_path / "hf"
    code = cli_main(["export", str(root), "--format", "hf", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, MixtralForCausalLM

    ours = _own_model(root, trainer.model_cfg)
    exported = load_file(out / "model.safetensors")
    for key, name in hf_names(trainer.model_cfg).items():  # Mixtral's layout, per expert
        for e, n in enumerate([name] if isinstance(name, str) else name):
            value = ours.state_dict()[key]
            assert torch.equal(exported[n], value if isinstance(name, str) else value[e]), n
    hf, info = AutoModelForCausalLM.from_pretrained(out, local_files_only=True,
                                                    dtype=torch.float32,
                                                    output_loading_info=True)
    assert isinstance(hf, MixtralForCausalLM)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens = torch.randint(0, trainer.model_cfg.vocab_size, (2, 24),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(tokens).logits, ours(tokens), rtol=1e-5,
                                   atol=1e-5)
    # The other way: the Mixtral folder imported into a fresh MoE model, weight for weight.
    cfg = load_config(str(TINY), [*ARGS, *MOE_ARGS, f"--checkpoint.root={tmp_path / 'b'}",
                                  f"--checkpoint.initial_load={out}"])
    back = Trainer(cfg, DistEnv(0, 1, 0, torch.device("cpu"), None, 0))
    try:
        assert back.resume() == 0
        for key, value in back.model.model_state_dict().items():
            assert torch.equal(value, ours.state_dict()[key]), key
    finally:
        back.manager.close()


# -- the other way: checkpoint.initial_load -------------------------------------------------
def _llama_config(**changes) -> dict:
    cfg = ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96)
    return {**hf_config(cfg), **changes}, cfg


@pytest.mark.parametrize("changes,fragment", [
    ({"num_key_value_heads": 4}, "num_key_value_heads=4 but model.n_kv_heads=2; set them to "
                                 "the folder's (--model.n_kv_heads=4)"),
    ({"hidden_size": 32, "rms_norm_eps": 1e-6},
     "hidden_size=32 but model.dim=64; rms_norm_eps=1e-06 but model.norm_eps=1e-05; set them "
     "to the folder's (--model.dim=32 --model.norm_eps=1e-06)"),
    ({"model_type": "qwen2"}, "is a 'qwen2' model"),
    ({"tie_word_embeddings": True}, "has tie_word_embeddings=true, but the reference model"),
    ({"attention_bias": True}, "has attention_bias=true"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope type \"llama3\""),
    ({"head_dim": 32}, "head_dim=32, but the reference model's head size"),
])
def test_a_config_json_that_is_not_the_model_is_one_line(changes, fragment):
    config, cfg = _llama_config(**changes)
    with pytest.raises(ConfigError) as err:
        check_hf_config(cfg, config, "hf/config.json")
    message = str(err.value)
    assert message.startswith("checkpoint.initial_load: hf/config.json") and fragment in message, \
        message
    assert "\n" not in message


def test_config_json_of_either_transformers_generation_matches():
    config, cfg = _llama_config()
    check_hf_config(cfg, config, "hf/config.json")  # rope_theta at the top (transformers 4)
    del config["rope_theta"], config["num_key_value_heads"]
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    with pytest.raises(ConfigError, match="num_key_value_heads=4 but model.n_kv_heads=2"):
        check_hf_config(cfg, config, "hf/config.json")  # absent: as many as query heads
    config["num_key_value_heads"] = 2
    check_hf_config(cfg, config, "hf/config.json")


def test_initial_load_needs_a_root_and_a_llama_model(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.initial_load: is set but root is empty"):
        load_config(str(TINY), ["--checkpoint.initial_load=hf"])
    with pytest.raises(ConfigError, match=r"no Hugging Face architecture to import "
                                          r"\(model.activation='gelu'\)"):
        import_hf(str(tmp_path), ModelConfig(activation="gelu"), None)


@needs_transformers
def test_a_folder_that_disagrees_with_the_model_stops_the_run_in_one_line(tmp_path, caplog):
    from tests.ckpt._hf_llama import MODEL_ARGS, save_tiny_llama

    folder = save_tiny_llama(tmp_path / "hf").folder
    cfg = load_config(str(TINY), [*ARGS, *MODEL_ARGS, "--model.n_kv_heads=4",
                                  f"--checkpoint.root={tmp_path / 'ckpt'}",
                                  f"--checkpoint.initial_load={folder}"])
    with caplog.at_level("ERROR", logger="trainer"):
        code = run(cfg, DistEnv(0, 1, 0, torch.device("cpu"), None, 0))
    assert code == EXIT_CONFIG
    [record] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert (f"checkpoint.initial_load: {folder}/config.json does not match [model]: "
            f"num_key_value_heads=2 but model.n_kv_heads=4" in record.getMessage()), \
        record.getMessage()
    root = tmp_path / "ckpt"
    assert not root.exists() or not CheckpointStore(str(root)).list()  # nothing committed
