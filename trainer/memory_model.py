"""Per-GPU memory of a transformer training step under a parallel layout: the planner's model.

Pure arithmetic, no process group: weights, gradients, optimizer state, FSDP buffers,
activations and logits of a :class:`Workload` on a :class:`Candidate` (a trainer layout,
:class:`trainer.config.ParallelConfig`, plus how the dp axis shards state), and for a
mixture of experts the routed experts' share of that state per expert-parallel rank and the
bytes its all-to-alls send per step (:func:`all_to_all_bytes_per_step`). The formulas and
their sources are in docs/layout-planner.md; :mod:`trainer.layout_plan` ranks candidates
with it and prints the report.

Size: one memory model; each term is a few lines of arithmetic read against the others
(the same workload and candidate), which a split would scatter.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Sequence

from trainer.config import ModelConfig, ParallelConfig, num_transformer_params, recomputed_layers
from trainer.hardware import OPTIMIZER_STATES, PRECISIONS

__all__ = [
    "SHARDINGS", "ModelShape", "Workload", "Candidate", "MemoryEstimate", "shape_from_dims",
    "shape_from_config", "shape_from_params", "activation_bytes_per_layer", "block_input_bytes",
    "pipeline_bubble", "estimate_memory", "all_to_all_bytes_per_step",
    "optimizer_bytes_per_param",
]

SHARDINGS = ("ddp", "zero1", "zero2", "fsdp")
"""How the dp axis holds model state, least to most sharded: 'ddp' replicates everything,
ZeRO-1 shards the optimizer state, ZeRO-2 also the gradients, 'fsdp' (ZeRO-3) also the
weights. Only 'ddp' and 'fsdp' are trainer modes (``parallel.dp_mode``). 'fsdp' on a layout
with ``dp_replicate > 1`` is HSDP: everything is sharded over ``dp_shard`` ranks only."""


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer shaped like the trainer's (parameters counted by
    :func:`trainer.config.num_transformer_params`). ``num_params`` is authoritative; when the
    dims were guessed from it (``inferred``) they only shape the activation estimate.

    A mixture of experts has ``n_experts > 0``: the blocks ``moe_layer_ids`` (global
    indices, :meth:`trainer.config.ModelConfig.is_moe_layer`'s choice) route each token to
    ``experts_per_token`` of ``n_experts`` MLPs of hidden size ``moe_ffn_dim``, plus
    ``n_shared_experts`` MLPs every token goes through."""

    num_params: int
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    ffn_dim: int
    gated_mlp: bool = False
    inferred: bool = False
    n_kv_heads: int | None = None
    n_experts: int = 0
    experts_per_token: int = 0
    moe_ffn_dim: int = 0
    n_shared_experts: int = 0
    moe_layer_ids: tuple[int, ...] = ()

    @property
    def kv_dim(self) -> int:
        """Output size of the key and of the value projection: the key/value heads
        (``n_kv_heads``, fewer than ``n_heads`` under grouped-query attention; None = as
        many) times the head size."""
        return (self.n_kv_heads or self.n_heads) * (self.dim // self.n_heads)

    def num_moe_layers(self, layer_ids: Sequence[int]) -> int:
        """How many of the blocks ``layer_ids`` are MoE blocks."""
        return len(set(layer_ids) & set(self.moe_layer_ids))

    def stage_params(self, layer_ids: Sequence[int], first: bool, last: bool,
                     active: bool = False) -> int:
        """Parameters of a pipeline stage holding the blocks ``layer_ids`` (global
        indices); the ``first`` holds the embedding, the ``last`` the final norm and the
        output projection. ``active``: those one token uses (its ``experts_per_token``
        routed experts of each MoE block, not all ``n_experts``)."""
        return num_transformer_params(
            self.dim, self.ffn_dim, self.vocab_size, n_layers=len(layer_ids),
            gated_mlp=self.gated_mlp, has_embedding=first, has_output=last, kv_dim=self.kv_dim,
            n_moe_layers=self.num_moe_layers(layer_ids),
            n_experts=self.n_experts, moe_ffn_dim=self.moe_ffn_dim or None,
            n_shared_experts=self.n_shared_experts,
            active_experts=self.experts_per_token if active else None)

    def expert_params(self, layer_ids: Sequence[int]) -> int:
        """Parameters of the routed experts of the blocks ``layer_ids``: what expert
        parallelism splits over its ranks (the router and the shared experts are not)."""
        return self.num_moe_layers(layer_ids) * self.n_experts * self._per_expert

    def moe_mlp_params(self, layer_ids: Sequence[int]) -> int:
        """Parameters of the MoE MLPs of the blocks ``layer_ids`` (router, routed and shared
        experts): what tensor parallelism leaves whole (the trainer's TP splits the dense
        parts only)."""
        return self.num_moe_layers(layer_ids) * (
            self.n_experts * self.dim + (self.n_experts + self.n_shared_experts) * self._per_expert)

    @property
    def _per_expert(self) -> int:
        return (3 if self.gated_mlp else 2) * self.dim * (self.moe_ffn_dim or self.ffn_dim)

    @property
    def layer_params(self) -> int:
        """Parameters of a dense block (-1: an index no MoE block has)."""
        return self.stage_params([-1], first=False, last=False)

    @property
    def shape_params(self) -> int:
        """Parameters of the whole model of these dims."""
        return self.stage_params(range(self.n_layers), first=True, last=True)

    @property
    def active_params(self) -> int:
        """Parameters one token uses (:attr:`shape_params` for a dense model), scaled like
        ``num_params``."""
        return round(self.stage_params(range(self.n_layers), first=True, last=True,
                                       active=True) * self.num_params / self.shape_params)


def shape_from_dims(dim: int, n_layers: int, n_heads: int, vocab_size: int = 32000,
                    ffn_dim: int = 0, gated_mlp: bool = False,
                    n_kv_heads: int | None = None) -> ModelShape:
    """Exact shape; ``ffn_dim = 0`` means 4 * dim, ``n_kv_heads = None`` as many key/value
    heads as query heads."""
    s = ModelShape(0, dim, n_layers, n_heads, vocab_size, ffn_dim or 4 * dim, gated_mlp,
                   n_kv_heads=n_kv_heads)
    return replace(s, num_params=s.shape_params)


def shape_from_config(model: ModelConfig) -> ModelShape:
    """The exact shape of the trainer's ``[model]`` section, mixture of experts included:
    ``num_params`` is :meth:`ModelConfig.num_params`."""
    s = ModelShape(0, model.dim, model.n_layers, model.n_heads, model.vocab_size,
                   model.hidden_ffn_dim, model.activation == "swiglu", n_kv_heads=model.kv_heads,
                   n_experts=model.n_experts,
                   experts_per_token=model.experts_per_token if model.n_experts else 0,
                   moe_ffn_dim=model.expert_ffn_dim if model.n_experts else 0,
                   n_shared_experts=model.n_shared_experts if model.n_experts else 0,
                   moe_layer_ids=tuple(model.moe_layer_ids))
    s = replace(s, num_params=s.shape_params)
    assert s.num_params == model.num_params(), "the planner counts as the config does"
    return s


def shape_from_params(num_params: int, vocab_size: int = 32000) -> ModelShape:
    """Guess a Llama-like shape for a parameter count: head_dim 128, n_layers ~ dim/128,
    SwiGLU MLP of 8/3 * dim (so ~12 * L * d^2 non-embedding params), dim a multiple of 256."""
    dim = max(256, int(round((num_params / 0.09375) ** (1 / 3) / 256)) * 256)
    body = num_params - 2 * vocab_size * dim
    n_layers = max(1, int(round(body / (12 * dim * dim))))
    return ModelShape(num_params, dim, n_layers, max(1, dim // 128), vocab_size,
                      dim * 8 // 3, gated_mlp=True, inferred=True)


@dataclass(frozen=True)
class Candidate:
    """A layout the planner evaluates: the trainer layout and the sharding (one of
    :data:`SHARDINGS`) its memory is estimated with. ZeRO-1/2 have no trainer mode; their
    ``layout.dp_mode`` is 'fsdp', the mode that would run them. HSDP is 'fsdp' with
    ``layout.dp_replicate > 1``; expert parallelism ``layout.ep > 1`` (its ranks part of
    ``dp_shard``, as in the trainer)."""

    layout: ParallelConfig
    sharding: str

    @classmethod
    def of(cls, pp: int, dp: int, tp: int, sharding: str = "ddp",
           dp_replicate: int = 1, ep: int = 1) -> Candidate:
        if sharding not in SHARDINGS:
            raise ValueError(f"--dp-mode: {sharding!r} is not one of {', '.join(SHARDINGS)}")
        if dp_replicate > 1 and sharding != "fsdp":
            raise ValueError(f"--dp-replicate: HSDP ({dp_replicate} replicas) shards like "
                             f"FSDP; use --dp-mode fsdp instead of {sharding}")
        mode = "ddp" if sharding == "ddp" else "fsdp"
        return cls(ParallelConfig(pp=pp, dp=dp, tp=tp, dp_mode=mode,
                                  dp_replicate=dp_replicate, ep=ep), sharding)

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def dp_replicate(self) -> int:
        return self.layout.dp_replicate

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def hsdp(self) -> bool:
        return self.layout.hsdp

    @property
    def num_gpus(self) -> int:
        return self.layout.world_size

    @property
    def name(self) -> str:
        if self.hsdp:
            parts = [f"HSDP dp={self.dp_replicate}x{self.layout.dp_shard}"]
        else:
            parts = [f"{self.sharding.upper()} dp={self.dp}"] * (self.dp > 1)
        parts += [f"EP{self.ep}"] * (self.ep > 1)
        parts += [f"TP{self.tp}"] * (self.tp > 1) + [f"PP{self.pp}"] * (self.pp > 1)
        return " + ".join(parts) or "single GPU"

    def preference(self) -> tuple:
        """Sort key of the documented preference order (simplest first); HSDP (more
        replicas first) comes just before FSDP of the same pp and tp, and expert
        parallelism (smallest ep first) after the same layout without it."""
        return (self.pp > 1, self.tp > 1, self.pp, self.tp, SHARDINGS.index(self.sharding),
                -self.dp_replicate, self.ep)

    def overrides(self, sequence_parallel: bool = True) -> str:
        """The trainer flags that run this layout."""
        lay = self.layout
        out = " ".join(f"--parallel.{k}={getattr(lay, k)}" for k in ("pp", "dp", "tp", "dp_mode"))
        out += f" --parallel.dp_replicate={lay.dp_replicate}" if self.hsdp else ""
        out += f" --parallel.ep={lay.ep}" if lay.ep > 1 else ""
        return out + (" --parallel.sequence_parallel=true" if lay.tp > 1 and sequence_parallel
                      else "")

    def to_dict(self) -> dict[str, Any]:
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp, "dp_mode": self.sharding,
                "dp_replicate": self.dp_replicate, "dp_shard": self.layout.dp_shard,
                "ep": self.ep}


@dataclass(frozen=True)
class Workload:
    """What one training step does. ``micro_batch`` sequences per forward per GPU;
    ``num_microbatches`` pipeline micro-batches per step (None: from ``global_batch`` if
    given, else 2 * pp, the trainer's default). ``recompute`` and ``recompute_every`` are the
    trainer's ``training.activation_checkpointing`` and ``activation_checkpointing_every``
    (which blocks recompute: :func:`trainer.config.recomputed_layers`); ``flash_attention``
    drops the attention scores from the per-block activations (a fused attention kernel,
    as the trainer's scaled_dot_product_attention picks on GPU in 16-bit, never stores
    them)."""

    shape: ModelShape
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    seq_len: int = 2048
    micro_batch: int = 1
    num_microbatches: int | None = None
    global_batch: int | None = None
    recompute: str = "none"
    recompute_every: int = 2
    flash_attention: bool = False
    sequence_parallel: bool = True
    pp_schedule: str = "1f1b"
    stages_per_rank: int = 1

    def microbatches_for(self, layout: ParallelConfig) -> int:
        if self.num_microbatches:
            return self.num_microbatches
        if self.global_batch:
            return max(1, self.global_batch // (layout.dp * self.micro_batch))
        return 2 * layout.pp if layout.pp > 1 else 1


def activation_bytes_per_layer(seq_len: int, micro_batch: int, dim: int, n_heads: int,
                               tp: int = 1, sequence_parallel: bool = False,
                               flash_attention: bool = False, bytes_per_element: int = 2) -> float:
    """Activation memory one transformer block keeps for backward, one micro-batch, no
    recomputation (Korthikanti et al. 2022, Table 2): ``s*b*h*(34 + 5*a*s/h)`` bytes with
    16-bit activations; with TP only ``s*b*h*(10 + 24/t + 5*a*s/(h*t))``; with TP +
    sequence parallelism everything / t. ``flash_attention`` drops the ``5*a*s/h``
    attention-score term. Scaled by ``bytes_per_element / 2`` for fp32 activations."""
    s, b, h, a, t = seq_len, micro_batch, dim, n_heads, tp
    sp = sequence_parallel and t > 1
    attn = 0.0 if flash_attention else 5 * a * s / h
    per = s * b * h * (34 + attn) / t if sp or t == 1 else s * b * h * (10 + 24 / t + attn / t)
    return per * bytes_per_element / 2


def block_input_bytes(seq_len: int, micro_batch: int, dim: int, tp: int = 1,
                      sequence_parallel: bool = False, bytes_per_element: int = 2) -> float:
    """What a recomputed block keeps for backward, one micro-batch: its input,
    ``2*s*b*h`` bytes with 16-bit activations (/ t with sequence parallelism)."""
    sp = sequence_parallel and tp > 1
    return seq_len * micro_batch * dim * bytes_per_element / (tp if sp else 1)


def pipeline_bubble(pp: int, num_microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of a pipelined step: (pp-1) / (v*m + pp-1) (Narayanan et al. 2021)."""
    return 0.0 if pp <= 1 else (pp - 1) / (stages_per_rank * num_microbatches + pp - 1)


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU bytes on the busiest pipeline stage (``stage``). ``experts``: of the
    weights, gradients and optimizer state, the routed experts' share (counted in those,
    not again in ``total``)."""

    weights: float
    grads: float
    optimizer: float
    fsdp_buffers: float
    activations: float
    logits: float
    stage: int
    num_microbatches: int
    bubble: float
    experts: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.fsdp_buffers \
            + self.activations + self.logits

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


def estimate_memory(work: Workload, cand: Candidate) -> MemoryEstimate:
    """Per-GPU memory of ``cand`` running ``work``; the max over the first and last pipeline
    stage (the first holds the most in-flight micro-batches, the last the output layer).

    The MoE MLPs are not split over ``tp`` (the trainer's TP splits the dense parts; each tp
    rank runs the whole MoE). Their routed experts are split over the ``ep`` ranks (each
    holds ``n_experts / ep`` of every MoE block) and, like every parameter, over the dp
    ranks the sharding uses: under FSDP the ``dp_shard / ep`` ranks that hold the same
    experts shard them further, so a rank's expert state is the experts over ``dp_shard``,
    while its FSDP buffers gather only its own ``n_experts / ep``."""
    pc, sh, layout = PRECISIONS[work.precision], work.shape, cand.layout
    n_states = OPTIMIZER_STATES[work.optimizer]
    pp, dp, t, ep = layout.pp, layout.dp, layout.tp, layout.ep
    scale = sh.num_params / sh.shape_params
    layers = math.ceil(sh.n_layers / pp)
    m = work.microbatches_for(layout)
    v = work.stages_per_rank if work.pp_schedule == "interleaved1f1b" else 1
    act_layer = activation_bytes_per_layer(work.seq_len, work.micro_batch, sh.dim, sh.n_heads, t,
                                           work.sequence_parallel, work.flash_attention,
                                           pc.activation_bytes)
    act_input = block_input_bytes(work.seq_len, work.micro_batch, sh.dim, t,
                                  work.sequence_parallel, pc.activation_bytes)
    ds = layout.dp_shard  # = dp, except under HSDP: replicas hold the same shards
    shard = {"ddp": (1, 1, 1), "zero1": (1, 1, dp), "zero2": (1, dp, dp), "fsdp": (ds, ds, ds)}
    w_div, g_div, o_div = shard[cand.sharding]
    # An expert is held by dp / ep ranks, which shard it when the others are sharded.
    e_div = {d: d if d > 1 else ep for d in (w_div, g_div, o_div)}
    # The largest block FSDP gathers: a dense one, or an MoE one with this rank's experts.
    first_moe = list(sh.moe_layer_ids[:1])
    moe_block, moe_mlp, moe_experts = (sh.stage_params(first_moe, False, False),
                                       sh.moe_mlp_params(first_moe), sh.expert_params(first_moe))
    gathered = max(sh.layer_params / t,
                   (moe_block - moe_mlp) / t + moe_mlp - moe_experts + moe_experts / ep)
    best: MemoryEstimate | None = None
    for st in sorted({0, pp - 1}):
        ids = range(st * layers, (st + 1) * layers)
        experts = sh.expert_params(ids) * scale
        moe_mlp = sh.moe_mlp_params(ids) * scale
        params = (sh.stage_params(ids, first=st == 0, last=st == pp - 1) * scale - moe_mlp) / t \
            + moe_mlp - experts

        def state(bytes_per_param: float, div: int) -> float:
            return params * bytes_per_param / div + experts * bytes_per_param / e_div[div]
        if pp == 1 or work.pp_schedule == "gpipe":
            in_flight = 1.0 if pp == 1 else m
        else:
            in_flight = min(m, pp - st) * (1 + (pp - 1) / (pp * v) if v > 1 else 1)
        # Recomputed blocks keep their input per micro-batch in flight; backward rebuilds
        # one block's activations at a time on top.
        num_recomputed = len(recomputed_layers(work.recompute, work.recompute_every,
                                               range(st * layers, (st + 1) * layers)))
        kept = (layers - num_recomputed) * act_layer + num_recomputed * act_input
        opt_bytes = pc.master_bytes + n_states * pc.state_bytes
        est = MemoryEstimate(
            weights=state(pc.weight_bytes, w_div),
            grads=state(pc.grad_bytes, g_div),
            optimizer=state(opt_bytes, o_div),
            # FSDP all-gathers a layer (plus one prefetched) and its unsharded grads.
            fsdp_buffers=(gathered * scale * (2 * pc.weight_bytes + pc.grad_bytes)
                          if cand.sharding == "fsdp" and ds > 1 else 0.0),
            activations=kept * in_flight + (act_layer if num_recomputed else 0.0),
            # fp32 logits and their softmax gradient; the trainer replicates logits over TP.
            logits=(8.0 * work.seq_len * work.micro_batch * sh.vocab_size
                    if st == pp - 1 else 0.0),
            stage=st, num_microbatches=m, bubble=pipeline_bubble(pp, m, v),
            experts=experts * (pc.weight_bytes / e_div[w_div] + pc.grad_bytes / e_div[g_div]
                               + opt_bytes / e_div[o_div]))
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best


def all_to_all_bytes_per_step(work: Workload, cand: Candidate) -> float:
    """Bytes one GPU sends in the expert-parallel all-to-alls of one training step, on the
    pipeline stage with the most MoE blocks (0 without experts or with ``ep = 1``).

    Each MoE block's forward sends every routed (token, choice) row, ``dim`` activations
    wide, to the rank holding its expert (dispatch) and back (combine); backward sends the
    gradients of both the same way, and a recomputed block (activation checkpointing) runs
    its forward's two once more. A rank routes the ``seq_len * micro_batch`` tokens of each
    of its micro-batches (each tp rank its own copy: the experts are not tensor-parallel),
    ``experts_per_token`` rows each, and with balanced routing the fraction
    ``(ep - 1) / ep`` of the rows leaves it. The per-expert row counts exchanged before
    each dispatch (``n_experts`` integers) are left out."""
    sh, layout = work.shape, cand.layout
    if not sh.moe_layer_ids or layout.ep == 1:
        return 0.0
    pp, ep = layout.pp, layout.ep
    layers = math.ceil(sh.n_layers / pp)
    rows = work.seq_len * work.micro_batch * sh.experts_per_token \
        * work.microbatches_for(layout)
    row_bytes = sh.dim * PRECISIONS[work.precision].activation_bytes * (ep - 1) / ep
    busiest = 0
    for st in range(pp):
        ids = [i for i in range(st * layers, (st + 1) * layers) if i in sh.moe_layer_ids]
        recomputed = recomputed_layers(work.recompute, work.recompute_every, ids)
        busiest = max(busiest, 4 * len(ids) + 2 * len(recomputed))
    return busiest * rows * row_bytes


def optimizer_bytes_per_param(work: Workload) -> float:
    """Optimizer bytes per parameter: fp32 master weights (mixed precision) plus states."""
    pc = PRECISIONS[work.precision]
    return pc.master_bytes + OPTIMIZER_STATES[work.optimizer] * pc.state_bytes
