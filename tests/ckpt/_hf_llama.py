"""A tiny Hugging Face Llama folder, as a published model's would look: ``save_pretrained``
of a ``LlamaForCausalLM`` (random init, grouped-query attention, norm weights not all
ones) in several shards with an index, two tokenizer files beside it. Nothing is
downloaded. ``MODEL``/``MODEL_ARGS``: the trainer's ``[model]`` with the same sizes.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from trainer.config import ModelConfig

__all__ = ["LLAMA", "MODEL", "MODEL_ARGS", "TOKENIZER", "save_tiny_llama"]

LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rope_theta=500.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
MODEL = ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                    max_seq_len=64, norm_eps=1e-6, rope_theta=500.0)
MODEL_ARGS = ("--model.vocab_size=128", "--model.dim=64", "--model.n_layers=2",
              "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=96",
              "--model.max_seq_len=64", "--model.norm_eps=1e-6", "--model.rope_theta=500")
TOKENIZER = {"tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE"}}\n',
             "tokenizer_config.json": b'{"model_max_length": 64}\n'}


def save_tiny_llama(folder: Path, seed: int = 0) -> SimpleNamespace:
    """Write the folder; return its weights, fixed ``tokens`` and transformers' logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # ones would hide a norm weight loaded in the wrong place
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, max_shard_size="40KB")
    for name, data in TOKENIZER.items():
        (Path(folder) / name).write_bytes(data)
    assert (Path(folder) / "model.safetensors.index.json").exists()
    tokens = torch.randint(0, LLAMA["vocab_size"], (2, 16),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens).logits
    return SimpleNamespace(folder=str(folder), tokens=tokens, logits=logits,
                           weights={k: v.clone() for k, v in model.state_dict().items()})
