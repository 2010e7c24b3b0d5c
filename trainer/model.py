"""A small decoder-only transformer that splits cleanly into pipeline stages.

The model is plain PyTorch (no parallelism inside); ``trainer.parallelize`` and
``trainer.pipeline`` shard it. Its sizes are the ``[model]`` config section,
:class:`trainer.config.ModelConfig`, which also counts its parameters. Three properties matter to the rest of the project:

* **Stable parameter names.** Blocks live in an ``nn.ModuleDict`` keyed by the *global*
  layer index (``"0"``, ``"1"``, ...), so a pipeline stage holding layers 4..7 names its
  parameters ``layers.4...`` exactly like the full model. Checkpoints therefore reshard
  across pipeline layouts by name.
* **Stages.** ``Transformer(cfg, layer_ids=..., has_embedding=..., has_output=...)`` builds
  only part of the model: the token embedding lives on the first stage, the final norm and
  output projection on the last; absent parts are ``None`` and ``forward`` skips them
  (input is then hidden states instead of token ids, output is hidden states instead of
  logits).
* **Layout-independent init.** ``init_weights(seed)`` fills every parameter from its own
  generator seeded by ``(seed, parameter name)`` (rule in ``param_seed``), so a stage, a
  TP shard or the full model get bit-identical values for the parameters they share. It
  accepts plain tensors and DTensors (each rank generates the full tensor and keeps its
  local piece), so the model can be built on the meta device, parallelized, materialized
  with ``to_empty`` and only then initialized.

Positions use rotary embeddings computed on the fly (no buffers, so nothing positional
needs checkpointing or sharding).
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from trainer.config import ModelConfig

__all__ = ["Transformer", "TransformerBlock", "param_seed", "cross_entropy_loss"]


def _rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs (i, i + hd/2) of ``x`` (B, S, H, hd) by position-dependent angles."""
    seq_len, head_dim = x.shape[1], x.shape[-1]
    half = head_dim // 2
    freqs = theta ** (-torch.arange(0, half, device=x.device, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(seq_len, device=x.device, dtype=torch.float32), freqs)
    cos = angles.cos()[None, :, None, :]
    sin = angles.sin()[None, :, None, :]
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    """Causal self-attention with ``n_heads`` query heads and ``kv_heads`` key/value heads
    (grouped-query attention when fewer: query head ``h`` attends with key/value head
    ``h // (n_heads / kv_heads)``, transformers' ``repeat_kv`` order).

    Under tensor parallelism wq/wk/wv are column-sharded and wo row-sharded, so each rank
    sees ``n_heads / tp`` query heads and ``kv_heads / tp`` key/value heads (a rank's query
    heads use exactly its key/value heads; ``tp`` divides both, checked by
    ``ParallelConfig.check``); ``forward`` infers the local head counts from the
    projections' output sizes instead of trusting the config.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        kv_dim = cfg.kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        # -1: the local head counts (n_heads / tp and kv_heads / tp under TP).
        q = self.wq(x).view(bsz, seq_len, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq_len, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq_len, -1, self.head_dim)
        q, k = _rotary(q, self.rope_theta), _rotary(k, self.rope_theta)
        grouped = q.shape[2] != k.shape[2]  # without GQA the call is the one it always was
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            **({"enable_gqa": True} if grouped else {}))
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU (``w2(silu(w1 x) * w3 x)``) or GELU (``w2(gelu(w1 x))``) MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = cfg.hidden_ffn_dim
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False) if cfg.activation == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def param_seed(seed: int, name: str) -> int:
    """The init rule: parameter ``name`` is drawn from ``torch.Generator().manual_seed(param_seed(seed, name))``.

    ``name`` is the fully qualified name inside ``Transformer`` (e.g.
    ``"layers.3.attention.wq.weight"``), the same in every layout. SHA-256 rather than
    ``hash()`` because Python salts string hashes per process.
    """
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class Transformer(nn.Module):
    """The full model, or one pipeline stage of it.

    Args:
        cfg: sizes.
        layer_ids: global indices of the blocks this instance holds (default: all).
        has_embedding: hold the token embedding (first stage). Default: True.
        has_output: hold the final norm and output projection (last stage). Default: True.

    ``forward(x)`` takes token ids (B, S) when ``tok_embeddings`` is present, else hidden
    states (B, S, dim); it returns logits (B, S, vocab) when ``output`` is present, else
    hidden states.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layer_ids: Optional[Iterable[int]] = None,
        has_embedding: bool = True,
        has_output: bool = True,
    ):
        super().__init__()
        self.cfg = cfg
        ids = list(range(cfg.n_layers)) if layer_ids is None else list(layer_ids)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim) if has_embedding else None
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in ids})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps) if has_output else None
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False) if has_output else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter deterministically from ``seed`` (rule: ``param_seed``).

        Norm weights are ones; every other weight is N(0, init_std), except the residual
        output projections (``attention.wo``, ``feed_forward.w2``) which use
        ``init_std / sqrt(2 * n_layers)`` (GPT-2's scaling, keeps the residual stream's
        variance flat in depth). Works on plain tensors and on DTensors (TP/FSDP2-sharded):
        every rank calls it with the same seed; no communication happens.
        """
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                full = torch.ones(param.shape)
            else:
                std = self.cfg.init_std
                if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                    std /= math.sqrt(2 * self.cfg.n_layers)
                gen = torch.Generator().manual_seed(param_seed(seed, name))
                full = torch.randn(param.shape, generator=gen) * std
            _copy_full_into(param, full)


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the global value ``full`` into ``param``, keeping only this rank's piece of a DTensor."""
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        replicated = DTensor.from_local(
            full.to(device=param.to_local().device, dtype=param.dtype),
            mesh,
            [Replicate()] * mesh.ndim,
            run_check=False,
        )
        # Replicate -> Shard/_StridedShard is a local slice: no collective is issued.
        local = replicated.redistribute(mesh, param.placements).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full.to(device=param.device, dtype=param.dtype))


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, computed in fp32 (bf16 log-softmax loses too much)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
