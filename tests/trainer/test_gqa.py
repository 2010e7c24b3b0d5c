"""Grouped-query attention in the reference model (``model.n_kv_heads``).

Query head ``h`` attends with key/value head ``h // (n_heads / n_kv_heads)`` (transformers'
``repeat_kv`` order): the GQA model equals a full multi-head one whose key/value heads are
those repeated. Unset, ``n_kv_heads`` is ``n_heads``: the model, its parameter count and
the config fingerprint of existing configs (so of their checkpoints) are unchanged. Tensor
parallelism needs tp to divide the key/value heads too, and the config says so in one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.config import (
    ConfigError,
    ModelConfig,
    ParallelConfig,
    config_fingerprint,
    load_config,
    num_transformer_params,
)
from trainer.model import Transformer

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")
GQA = ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=96)


def test_grouped_heads_equal_repeated_full_heads():
    gqa = Transformer(GQA).eval()
    gqa.init_weights(3)
    mha = Transformer(ModelConfig(**{**GQA.__dict__, "n_kv_heads": None})).eval()
    state = dict(gqa.state_dict())
    hd, rep = GQA.head_dim, GQA.n_heads // GQA.kv_heads
    for i in range(GQA.n_layers):
        for w in ("wk", "wv"):
            key = f"layers.{i}.attention.{w}.weight"
            state[key] = state[key].view(GQA.kv_heads, hd, GQA.dim) \
                .repeat_interleave(rep, dim=0).reshape(GQA.dim, GQA.dim)
    mha.load_state_dict(state)
    tokens = torch.randint(0, GQA.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)
    assert gqa.layers["0"].attention.wk.weight.shape == (GQA.kv_heads * hd, GQA.dim)


def test_parameter_count_with_grouped_heads():
    with torch.device("meta"):
        model = Transformer(GQA)
        stage = Transformer(GQA, layer_ids=[1], has_embedding=False)
    assert GQA.num_params() == sum(p.numel() for p in model.parameters())
    assert num_transformer_params(GQA.dim, GQA.hidden_ffn_dim, GQA.vocab_size, n_layers=1,
                                  gated_mlp=True, has_embedding=False,
                                  kv_dim=GQA.kv_heads * GQA.head_dim) == \
        sum(p.numel() for p in stage.parameters())


def test_unset_means_as_many_as_query_heads_and_keeps_the_fingerprint():
    cfg = ModelConfig()
    assert cfg.n_kv_heads is None and cfg.kv_heads == cfg.n_heads
    # The fingerprints these configs had before model.n_kv_heads existed.
    assert config_fingerprint(load_config(None, [])) == "0aa0915fc6a699d3"
    assert config_fingerprint(load_config(TINY, [])) == "1edff211cf842a65"
    assert config_fingerprint(load_config(TINY, ["--model.n_kv_heads=4"])) \
        == "1edff211cf842a65"
    assert config_fingerprint(load_config(TINY, ["--model.n_kv_heads=2"])) \
        != "1edff211cf842a65"


@pytest.mark.parametrize("value,fragment", [
    (3, "model.n_kv_heads: 3 does not divide model.n_heads=4"),
    (0, "model.n_kv_heads: must be >= 1"),
])
def test_bad_kv_heads_are_one_line(value, fragment):
    with pytest.raises(ConfigError, match=fragment) as err:
        ModelConfig(n_kv_heads=value)
    assert "\n" not in str(err.value)


def test_tensor_parallelism_must_divide_the_kv_heads():
    model = ModelConfig(n_heads=4, n_kv_heads=1)
    ParallelConfig(tp=1).check(model)
    with pytest.raises(ConfigError, match=r"parallel\.tp: 2 does not divide "
                                          r"model\.n_kv_heads \(key/value heads\)=1"):
        ParallelConfig(tp=2).check(model)
    ParallelConfig(tp=2).check(ModelConfig(n_heads=4, n_kv_heads=2))
