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

Mixture of experts (``model.n_experts > 0``): the blocks ``ModelConfig.is_moe_layer`` picks
hold ``moe`` (:class:`MoE`: a router, stacked routed experts, optional shared experts)
instead of ``feed_forward``; routing is Mixtral's, dropless. The load-balancing loss is
added to the training objective through the gradient (:class:`MoE` says how), so a pipeline
stage's backward carries it without the loss function seeing it; the loss the trainer
reports stays the cross-entropy, and each MoE block keeps its router statistics (tokens per
expert, the balancing loss) for the metrics. Expert parallelism is
:mod:`trainer.expert_parallel`.

Size: one model, its blocks and its init rule; the mixture-of-experts block is a block of
it (its parameter names and init are the model's), its parallel dispatch lives elsewhere.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from trainer.comms import CommMeter
from trainer.config import ModelConfig
from trainer.expert_parallel import combine, dispatch, local_expert_weight

__all__ = ["Transformer", "TransformerBlock", "MoE", "GroupedExperts", "RouterStats",
           "param_seed", "cross_entropy_loss"]


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
    """SwiGLU (``w2(silu(w1 x) * w3 x)``) or GELU (``w2(gelu(w1 x))``) MLP of hidden size
    ``hidden`` (default the config's MLP size)."""

    def __init__(self, cfg: ModelConfig, hidden: int | None = None):
        super().__init__()
        hidden = cfg.hidden_ffn_dim if hidden is None else hidden
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False) if cfg.activation == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class GroupedExperts(nn.Module):
    """``n_experts`` MLPs (SwiGLU, or GELU without ``w3``) of hidden size
    ``ModelConfig.expert_ffn_dim`` as stacked weights: ``w1``, ``w3`` ``[n_experts, ffn,
    dim]``, ``w2`` ``[n_experts, dim, ffn]`` (a ``w[e]`` is the ``weight`` of an
    ``nn.Linear``). Under expert parallelism they are DTensors sharded on dim 0 and
    ``ep_group`` is set (:func:`trainer.expert_parallel.shard_experts`); this rank then runs
    its own experts only, and ``comm`` (the rank's :class:`trainer.comms.CommMeter`, once
    the parallel model attaches it) times the block's all-to-alls."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n, hidden, dim = cfg.n_experts, cfg.expert_ffn_dim, cfg.dim
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim)) if cfg.activation == "swiglu" else None
        self.ep_group = None
        self.comm: CommMeter | None = None

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``rows`` grouped by this rank's experts, ``counts[e]`` of them for its ``e``-th."""
        w1, w2 = (local_expert_weight(w, self.ep_group) for w in (self.w1, self.w2))
        w3 = None if self.w3 is None else local_expert_weight(self.w3, self.ep_group)
        outs = []
        for e, x in enumerate(rows.split(counts)):
            h = x @ w1[e].t()
            h = F.silu(h) * (x @ w3[e].t()) if w3 is not None else F.gelu(h)
            outs.append(h @ w2[e].t())
        return torch.cat(outs)


@dataclass
class RouterStats:
    """One MoE block's router over the forwards since the last
    :meth:`Transformer.take_router_stats`: routed (token, choice) rows per expert (this
    rank's tokens), and the mean load-balancing loss."""

    tokens_per_expert: list[float]
    aux_loss: float

    @property
    def imbalance(self) -> float:
        """Busiest expert's rows over the mean: 1 is perfect balance, ``n_experts /
        experts_per_token`` is every token on the same experts (router collapse)."""
        mean = sum(self.tokens_per_expert) / len(self.tokens_per_expert)
        return max(self.tokens_per_expert) / mean if mean else 1.0


class _AddAuxLossGrad(torch.autograd.Function):
    """Identity on ``out``; its backward also gives ``aux`` the gradient ``scale``, as if
    ``scale * aux`` had been added to the loss (Megatron's ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dtype, device = ctx.aux_meta
        return grad, torch.full((), ctx.scale, dtype=dtype, device=device), None


class MoE(nn.Module):
    """A mixture-of-experts MLP: ``router`` (``nn.Linear(dim, n_experts)``), ``experts``
    (:class:`GroupedExperts`) and, with ``n_shared_experts``, ``shared`` (a
    :class:`FeedForward` of hidden size ``n_shared_experts * expert_ffn_dim`` every token
    goes through, added without a gate).

    Routing (Mixtral's): router logits in fp32, softmax, the top ``experts_per_token``
    probabilities renormalised to sum to 1 weight their experts' outputs. Dropless token
    choice: every token reaches all its chosen experts, however many pick the same one.

    Load balancing (Switch/Mixtral): ``n_experts * sum_e f_e * P_e``, with ``f_e`` the
    fraction of (token, choice) rows routed to ``e`` and ``P_e`` the mean router
    probability of ``e``, taken per sequence and averaged over the sequences (DeepSeek-V3's
    sequence-wise form): a mean over sequences does not depend on how the batch is split
    over dp ranks and micro-batches, so every layout trains the same objective. The model's
    objective is cross-entropy + ``router_aux_loss_coef`` * the mean of this over the MoE
    blocks; its gradient enters through :class:`_AddAuxLossGrad` on the block's output,
    scaled by ``loss_scale`` (the trainer sets ``1 / (micro-batches * accumulation
    steps)``, as it divides the cross-entropy).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.n_experts, cfg.experts_per_token
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg)
        self.shared = (FeedForward(cfg, cfg.n_shared_experts * cfg.expert_ffn_dim)
                       if cfg.n_shared_experts else None)
        self.aux_loss_weight = cfg.router_aux_loss_coef / len(cfg.moe_layer_ids)
        self.loss_scale = 1.0
        # Statistics stay on the host (the split sizes are read there anyway) except the
        # loss, summed where it is computed and read once per take_stats.
        self._tokens = torch.zeros(cfg.n_experts, dtype=torch.float64, device="cpu")
        self._aux_sum: torch.Tensor | float = 0.0
        self._calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, dim = x.shape
        tokens = x.reshape(-1, dim)
        probs = F.linear(tokens.float(), self.router.weight.float()).softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = chosen.flatten()
        counts = torch.bincount(flat, minlength=self.num_experts)
        order = flat.argsort(stable=True)  # (token, choice) rows sorted by expert
        rows = tokens[order // self.top_k]
        group = self.experts.ep_group
        if group is None:
            out_rows = self.experts(rows, counts.tolist())
        else:
            received, local_counts, route = dispatch(rows, counts, group, self.experts.comm)
            out_rows = combine(self.experts(received, local_counts), route)
        per_choice = torch.empty_like(out_rows).index_copy(0, order, out_rows)
        out = (per_choice.view(-1, self.top_k, dim)
               * weights.unsqueeze(-1).to(per_choice.dtype)).sum(dim=1).view(bsz, seq_len, dim)
        if self.shared is not None:
            out = out + self.shared(x)
        aux = self._balancing_loss(probs.view(bsz, seq_len, -1), chosen.view(bsz, seq_len, -1))
        with torch.no_grad():
            self._tokens += counts.to("cpu", torch.float64)
            self._aux_sum = self._aux_sum + aux.detach()
            self._calls += 1
        if self.aux_loss_weight and torch.is_grad_enabled():
            out = _AddAuxLossGrad.apply(out, aux, self.aux_loss_weight * self.loss_scale)
        return out

    def _balancing_loss(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Per sequence ``n_experts * sum_e f_e * P_e``, averaged over the sequences."""
        bsz, seq_len, _ = probs.shape
        f = torch.zeros(bsz, self.num_experts, device=probs.device).scatter_add_(
            1, chosen.reshape(bsz, -1), torch.ones(chosen.reshape(bsz, -1).shape,
                                                   device=probs.device))
        f = f / (seq_len * self.top_k)
        return self.num_experts * (f * probs.mean(dim=1)).sum(dim=-1).mean()

    def take_stats(self) -> RouterStats | None:
        """The router statistics since the last call (None if no forward ran), and reset
        them. Local: no communication. A forward recomputed by activation checkpointing
        may count twice (torch usually stops a recomputation as soon as backward has what
        it needs, before the statistics), which changes neither the imbalance nor the mean
        loss."""
        if not self._calls:
            return None
        stats = RouterStats(self._tokens.tolist(), float(self._aux_sum) / self._calls)
        self._tokens.zero_()
        self._aux_sum, self._calls = 0.0, 0
        return stats


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``; the MLP is
    ``feed_forward``, or ``moe`` (:class:`MoE`) when ``cfg.is_moe_layer(layer_id)`` (the
    other attribute is then None)."""

    def __init__(self, cfg: ModelConfig, layer_id: int = 0):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        moe = cfg.is_moe_layer(layer_id)
        self.feed_forward = None if moe else FeedForward(cfg)
        self.moe = MoE(cfg) if moe else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        mlp = self.moe if self.moe is not None else self.feed_forward
        return h + mlp(self.ffn_norm(h))


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
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in ids})
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

    def moe_blocks(self) -> dict[int, MoE]:
        """This module's MoE blocks by global layer index."""
        return {int(i): b.moe for i, b in self.layers.items() if b.moe is not None}

    def set_aux_loss_scale(self, scale: float) -> None:
        """Scale the load-balancing loss's gradient as the cross-entropy's (``MoE.loss_scale``)."""
        for moe in self.moe_blocks().values():
            moe.loss_scale = scale

    def take_router_stats(self) -> dict[int, RouterStats]:
        """Each MoE block's :class:`RouterStats` since the last call, by global layer index."""
        out = {}
        for layer_id, moe in self.moe_blocks().items():
            stats = moe.take_stats()
            if stats is not None:
                out[layer_id] = stats
        return out

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter deterministically from ``seed`` (rule: ``param_seed``).

        Norm weights are ones; every other weight is N(0, init_std), except the residual
        output projections (``attention.wo``, the MLPs' ``w2``: ``feed_forward.w2``,
        ``moe.experts.w2``, ``moe.shared.w2``) which use ``init_std / sqrt(2 * n_layers)``
        (GPT-2's scaling, keeps the residual stream's variance flat in depth). Stacked
        expert weights are drawn whole, ``[n_experts, ...]``, under their one name. Works on
        plain tensors and on DTensors (TP/EP/FSDP2-sharded): every rank calls it with the
        same seed; no communication happens.
        """
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                full = torch.ones(param.shape)
            else:
                std = self.cfg.init_std
                if name.endswith(("attention.wo.weight", "feed_forward.w2.weight",
                                  "moe.experts.w2", "moe.shared.w2.weight")):
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
