"""The reference model as a Hugging Face model: what every checkpoint carries so that
``ckpt export ROOT --format hf --out DIR`` writes a folder ``from_pretrained`` loads.

With ``model.activation = "swiglu"`` (the default) :class:`trainer.model.Transformer` is
Llama's architecture, the same math as transformers' ``LlamaForCausalLM``: pre-norm
blocks with RMSNorm (``x * rsqrt(mean(x^2) + eps) * w``), rotary embeddings rotating the
halves ``(i, i + head_dim / 2)`` of each head with frequencies ``theta^(-2i / head_dim)``
(transformers' ``rotate_half`` layout, so ``wq``/``wk`` need no permutation), causal
attention scaled by ``1 / sqrt(head_dim)`` with as many key/value heads as query heads,
a SwiGLU MLP ``w2(silu(w1 x) * w3 x)``, no biases and an output projection not tied to the
embedding. Only the weights' names differ (:func:`hf_names`). ``tests/trainer/test_hf.py``
loads the export with ``from_pretrained`` and compares logits with the model's.

With ``activation = "gelu"`` no Hugging Face architecture matches (Llama's MLP is gated,
and the GELU models use LayerNorm, learned positions or biases): its checkpoints carry
neither file, and ``ckpt export --format hf`` then needs ``--no-config`` (the weights
alone, under the model's own names).

Every save attaches (:func:`hf_attachments`) ``config.json``, a ``LlamaConfig``, and
``hf_export.json``: the selection holding the weights (``app.model.``, where
:meth:`trainer.train.Trainer.checkpoint_state` puts them) and each weight's Llama name
(``ckpt.export`` applies them; docs/store.md, "Export").
"""

from __future__ import annotations

import json
import re

import torch

from ckpt.export import HF_CONFIG_NAME, HF_EXPORT_NAME
from trainer.config import ModelConfig
from trainer.model import Transformer

__all__ = ["HF_SELECT", "hf_config", "hf_names", "hf_attachments"]

HF_SELECT = "app.model."  # the checkpoint keys of the model's weights (checkpoint_state)

# The model's parameter names -> LlamaForCausalLM's, applied in order (first match).
_LLAMA_NAMES = [
    (r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    (r"layers\.(\d+)\.attention\.w([qkvo])\.weight", r"model.layers.\1.self_attn.\2_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w1\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", r"model.layers.\1.mlp.down_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w3\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
]


def _maps_to_llama(cfg: ModelConfig) -> bool:
    return cfg.activation == "swiglu"


def hf_config(cfg: ModelConfig) -> dict | None:
    """The ``config.json`` of a ``LlamaForCausalLM`` with the model's sizes; None when the
    model has no Hugging Face architecture (GELU MLP)."""
    if not _maps_to_llama(cfg):
        return None
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": cfg.init_std,
    }


def hf_names(cfg: ModelConfig) -> dict[str, str] | None:
    """``{the model's parameter name: LlamaForCausalLM's}`` for every parameter; None when
    the model has no Hugging Face architecture."""
    if not _maps_to_llama(cfg):
        return None
    with torch.device("meta"):
        names = list(Transformer(cfg).state_dict())
    out = {}
    for name in names:
        for pattern, repl in _LLAMA_NAMES:
            new, n = re.subn(rf"^{pattern}$", repl, name)
            if n:
                out[name] = new
                break
        else:
            raise AssertionError(f"no Llama name for the parameter {name!r}")
    return out


def hf_attachments(cfg: ModelConfig) -> dict[str, bytes]:
    """What every checkpoint carries for ``ckpt export --format hf``: ``config.json`` and
    ``hf_export.json``; nothing when the model has no Hugging Face architecture."""
    config, names = hf_config(cfg), hf_names(cfg)
    if config is None or names is None:
        return {}
    return {HF_CONFIG_NAME: json.dumps(config, indent=2).encode() + b"\n",
            HF_EXPORT_NAME: json.dumps({"select": HF_SELECT, "names": names},
                                       indent=1).encode() + b"\n"}
