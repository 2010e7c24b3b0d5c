"""Layout planner: which (pp, dp, tp, ep) layout fits a model on given GPUs, and its report/CLI.

:func:`plan_layout` estimates every layout of the cluster with the memory model
(:mod:`trainer.memory_model`), ranks them by a fixed preference order and recommends the
simplest that fits:

    DDP  <  HSDP  <  FSDP  <  FSDP+TP (TP within a node, smallest TP first)  <  +PP

HSDP (shard within a node, replicate across nodes) is a candidate only on several nodes; it
comes before FSDP of the same pp and tp because its all-gathers stay inside a node. A
mixture of experts also gets expert-parallel layouts (``ep`` dividing the experts and
``dp_shard``, after the same layout without), and only those whose ``ep x tp`` ranks stay
inside a node: every MoE block's all-to-all then runs on the node's fast links. When no
layout fits with the workload's activation checkpointing and it is not 'full', the advice
is the simplest layout that fits with every block recomputed (warning ``recompute-needed``;
its flags carry ``--training.activation_checkpointing=full``).

``python -m trainer plan`` wires :func:`add_layout_plan_arguments` and :func:`run_layout_plan`.
The formulas and their sources are in docs/layout-planner.md; memory is reported in GiB
(2**30 bytes).

Size: the planner's ranking and its report/CLI, one concept (the memory model itself is
:mod:`trainer.memory_model`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any

from trainer.config import ACTIVATION_CHECKPOINTING, ModelConfig, load_config
from trainer.hardware import GIB, GPU_PRESETS, OPTIMIZER_STATES, PRECISIONS, get_gpu
from trainer.memory_model import (
    SHARDINGS,
    Candidate,
    MemoryEstimate,
    ModelShape,
    Workload,
    all_to_all_bytes_per_step,
    estimate_memory,
    optimizer_bytes_per_param,
    shape_from_config,
    shape_from_params,
)

__all__ = ["LayoutAdvice", "parse_count", "candidate_layouts", "plan_layout",
           "add_layout_plan_arguments", "run_layout_plan"]

BUBBLE_WARN_FRACTION = 0.10
"""Warn when the pipeline bubble exceeds this fraction of step time."""


def parse_count(text: str | int | float) -> int:
    """``"7B"`` -> 7_000_000_000; accepts K, M, B (or G), T suffixes and plain numbers."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbgt]?)\s*", text.lower())
    if not m:
        raise ValueError(f"--params: cannot parse {text!r}; use a count like 7B, 350M or 1.3e9")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}[m.group(2)]
    return int(round(float(m.group(1)) * scale))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(num_gpus: int, gpus_per_node: int, shape: ModelShape,
                      modes: tuple[str, ...] = ("ddp", "fsdp")) -> list[Candidate]:
    """Every layout of ``num_gpus`` with TP inside a node and dividing the (query and
    key/value) heads, pp at most n_layers, in preference order. Sharded modes need dp > 1;
    TP composes only with FSDP (as in the trainer), so DDP/ZeRO-1/2 rows have tp = 1. With
    'fsdp' and several nodes, also HSDP with a node's worth of shard ranks (``dp_shard =
    gpus_per_node / tp``, at least 2) and the other dp ranks as replicas: ranks are laid out
    (pp, dp_replicate, dp_shard, tp), so each shard group is one node.
    A mixture of experts adds, for each FSDP and HSDP layout, the expert-parallel
    degrees ``ep > 1`` that divide ``n_experts`` and ``dp_shard`` and keep an ep group's
    ``ep * tp`` adjacent ranks inside a node (``gpus_per_node`` a multiple of ``ep * tp``)."""
    out = []
    for tp in _divisors(num_gpus):
        if tp > gpus_per_node or gpus_per_node % tp or shape.n_heads % tp or \
                (shape.n_kv_heads or shape.n_heads) % tp:
            continue
        for pp in _divisors(num_gpus // tp):
            if pp > shape.n_layers:
                continue
            dp = num_gpus // (tp * pp)
            base = [Candidate.of(pp, dp, tp, mode) for mode in modes
                    if (mode == "ddp" or dp > 1) and (mode == "fsdp" or tp == 1)]
            shard = gpus_per_node // tp
            if "fsdp" in modes and num_gpus > gpus_per_node and 1 < shard < dp \
                    and dp % shard == 0:
                base.append(Candidate.of(pp, dp, tp, "fsdp", dp_replicate=dp // shard))
            out += base
            out += [Candidate.of(c.pp, c.dp, c.tp, c.sharding, c.dp_replicate, ep)
                    for c in base if c.sharding == "fsdp" and shape.n_experts
                    for ep in _divisors(c.layout.dp_shard)
                    if ep > 1 and shape.n_experts % ep == 0 and gpus_per_node % (ep * tp) == 0]
    return sorted(out, key=Candidate.preference)


@dataclass
class LayoutAdvice:
    """What :func:`plan_layout` advises: every candidate layout with its memory estimate
    (``rows``), the recommended one, the requested one evaluated, and ``warnings`` as
    ``(code, message)`` pairs. (A layout recommendation, not a checkpoint cadence plan like
    :class:`ckpt.cadence.CadencePlan`.)"""

    work: Workload
    num_gpus: int
    gpus_per_node: int
    usable_bytes: float
    rows: list[tuple[Candidate, MemoryEstimate]]
    recommended: tuple[Candidate, MemoryEstimate] | None
    requested: tuple[Candidate, MemoryEstimate] | None
    warnings: list[tuple[str, str]]

    def fits(self, est: MemoryEstimate) -> bool:
        return est.total <= self.usable_bytes

    def overrides(self, lay: Candidate) -> str:
        """The trainer flags that run ``lay`` under this advice's workload."""
        flags = lay.overrides(self.work.sequence_parallel)
        if self.work.recompute != "none":
            flags += f" --training.activation_checkpointing={self.work.recompute}"
            if self.work.recompute == "selective":
                flags += f" --training.activation_checkpointing_every={self.work.recompute_every}"
        return flags

    def to_dict(self) -> dict[str, Any]:
        def row(pair):
            if pair is None:
                return None
            lay, est = pair
            return {"layout": lay.to_dict(), "name": lay.name, "fits": self.fits(est),
                    "overrides": self.overrides(lay),
                    "memory_bytes": est.to_dict(),
                    "all_to_all_bytes_per_step": all_to_all_bytes_per_step(self.work, lay)}
        return {"workload": asdict(self.work), "num_gpus": self.num_gpus,
                "active_params": self.work.shape.active_params,
                "gpus_per_node": self.gpus_per_node, "usable_bytes_per_gpu": self.usable_bytes,
                "recommended": row(self.recommended), "requested": row(self.requested),
                "candidates": [row(r) for r in self.rows],
                "warnings": [{"code": c, "message": m} for c, m in self.warnings]}


def _gib(x: float) -> str:
    return f"{x / GIB:.1f} GiB" if x >= 0.1 * GIB else f"{x / (1 << 20):.1f} MiB"


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def _ep_warnings(lay: Candidate, sh: ModelShape, gpus_per_node: int) -> list[tuple[str, str]]:
    """What is wrong with ``lay``'s expert parallelism for ``sh`` on nodes of
    ``gpus_per_node``: no experts to split, experts it does not divide, or an ep group
    (``ep * tp`` adjacent ranks) that spans nodes."""
    if not sh.n_experts:
        return [("ep-dense", f"EP{lay.ep} needs a mixture of experts and the model is dense; "
                 "use --parallel.ep=1 or give --experts")]
    if sh.n_experts % lay.ep:
        return [("ep-experts", f"EP{lay.ep} does not divide the {sh.n_experts} experts of a "
                 "block; pick a divisor")]
    span = lay.ep * lay.tp
    if gpus_per_node % span == 0:
        return []
    fits = [e for e in _divisors(lay.layout.dp_shard) if sh.n_experts % e == 0
            and gpus_per_node % (e * lay.tp) == 0]
    return [("ep-across-nodes", f"EP{lay.ep}{f' x TP{lay.tp}' if lay.tp > 1 else ''}: an "
             f"expert-parallel group is {span} adjacent ranks and spans nodes of "
             f"{gpus_per_node} GPUs, so every MoE block's all-to-alls would cross the "
             f"inter-node network (~50 GB/s per GPU instead of 600-900 GB/s NVLink); keep "
             f"ep * tp dividing {gpus_per_node}: --parallel.ep={max(fits)}")]


def plan_layout(work: Workload, num_gpus: int, gpus_per_node: int, usable_bytes: float,
                requested: Candidate | None = None) -> LayoutAdvice:
    """Estimate every candidate layout, recommend the first (by preference) that fits in
    ``usable_bytes`` per GPU with a trainer dp_mode (ddp/fsdp), evaluate ``requested`` and
    collect warnings. Raises ValueError if ``requested`` does not use ``num_gpus`` GPUs."""
    if requested is not None and requested.num_gpus != num_gpus:
        raise ValueError(f"the requested layout has pp * dp * tp = {requested.num_gpus} GPUs "
                         f"but the cluster (--nodes x --gpus-per-node) has {num_gpus}; make "
                         f"them multiply to {num_gpus}")
    sh = work.shape
    rows = [(lay, estimate_memory(work, lay)) for lay in
            candidate_layouts(num_gpus, gpus_per_node, sh, ("ddp", "zero1", "zero2", "fsdp"))
            if lay.sharding in ("ddp", "fsdp") or (lay.pp == 1 and lay.tp == 1)]
    fits = lambda e: e.total <= usable_bytes  # noqa: E731
    rec = next(((lay, e) for lay, e in rows if lay.sharding in ("ddp", "fsdp") and fits(e)), None)
    req = (requested, estimate_memory(work, requested)) if requested else None
    warns: list[tuple[str, str]] = []
    if requested is not None:
        if requested.tp > gpus_per_node or gpus_per_node % requested.tp:
            warns.append(("tp-across-nodes", f"TP{requested.tp} spans nodes of {gpus_per_node} "
                          "GPUs: its per-layer all-reduces would run over the inter-node network "
                          "(~50 GB/s per GPU) instead of NVLink (600-900 GB/s); keep tp <= "
                          f"{gpus_per_node} and dividing it"))
        for what, n in (("n_heads", sh.n_heads), ("n_kv_heads", sh.n_kv_heads or sh.n_heads)):
            if n % requested.tp:
                warns.append(("tp-heads", f"TP{requested.tp} does not divide {what}={n}"))
                break
        if requested.ep > 1:
            warns += _ep_warnings(requested, sh, gpus_per_node)
        if requested.tp > 1 and requested.sharding != "fsdp":
            warns.append(("tp-needs-fsdp", f"the trainer composes TP only with FSDP; use "
                          f"--parallel.dp_mode=fsdp instead of {requested.sharding}"))
        # HSDP instead of the same FSDP is the fsdp-across-nodes warning's advice, not this one.
        only_replicas = rec is not None and rec[0].hsdp and requested.sharding == "fsdp" and \
            (rec[0].pp, rec[0].tp) == (requested.pp, requested.tp)
        if rec and rec[0].preference() < requested.preference() and fits(req[1]) and \
                not only_replicas:
            what = "3D parallelism" if requested.pp > 1 and requested.tp > 1 and \
                requested.dp > 1 else requested.name
            costs = [c for c, on in (("per-layer FSDP all-gathers", requested.sharding == "fsdp"
                                      and rec[0].sharding == "ddp"),
                                     ("per-layer TP all-reduces", requested.tp > rec[0].tp),
                                     ("MoE all-to-alls", requested.ep > rec[0].ep),
                                     ("pipeline bubbles", requested.pp > rec[0].pp)) if on]
            warns.append(("needless-parallelism", f"{what} is not needed: the simpler "
                          f"{rec[0].name} fits ({_gib(rec[1].total)} per GPU) and avoids "
                          f"{' and '.join(costs) or 'extra communication'}"))
    ddp = estimate_memory(work, Candidate.of(1, num_gpus, 1, "ddp"))
    if not fits(ddp) and fits(replace(ddp, optimizer=0.0)):
        warns.append(("optimizer-state", f"plain DDP would fit without the optimizer: "
                      f"{work.optimizer} state adds {_gib(ddp.optimizer)} per GPU "
                      f"({optimizer_bytes_per_param(work):g} bytes/param); shard it (ZeRO-1/FSDP)"))
    chosen = req or rec or min(rows, key=lambda r: r[1].total)
    lay, est = chosen
    if est.activations + est.logits > 0.5 * est.total and work.recompute != "full":
        full = estimate_memory(replace(work, recompute="full"), lay)
        warns.append(("activations-dominate", f"activations are {_gib(est.activations)} of "
                      f"{_gib(est.total)} per GPU on {lay.name}; activation checkpointing "
                      f"(--training.activation_checkpointing=full) would cut the total to "
                      f"{_gib(full.total)}, or lower the micro-batch"))
    if est.bubble > BUBBLE_WARN_FRACTION:
        warns.append(("pipeline-bubble", f"pipeline bubble is {est.bubble:.0%} of each step "
                      f"(pp={lay.pp}, {est.num_microbatches} micro-batches, (pp-1)/(m+pp-1)); "
                      f"use >= {4 * lay.pp} micro-batches or the interleaved1f1b schedule"))
    if requested is not None and requested.sharding == "fsdp" and not requested.hsdp and \
            requested.dp * requested.tp > gpus_per_node:
        hsdp = next(((lay, e) for lay, e in rows if lay.hsdp and lay.pp == requested.pp
                     and lay.tp == requested.tp and lay.dp == requested.dp), None)
        if hsdp and fits(hsdp[1]):
            warns.append(("fsdp-across-nodes", f"FSDP dp={requested.dp} all-gathers cross "
                          f"nodes every layer; {hsdp[0].name} (shard within a node, replicate "
                          f"across nodes) also fits ({_gib(hsdp[1].total)} per GPU) and keeps "
                          f"them on NVLink: add --parallel.dp_replicate={hsdp[0].dp_replicate}"))
    if rec is None and work.recompute != "full":
        alt = plan_layout(replace(work, recompute="full"), num_gpus, gpus_per_node,
                          usable_bytes, requested)
        if alt.recommended:
            alt.warnings.insert(0, ("recompute-needed", f"no layout of {num_gpus} GPUs fits "
                                    f"with activation checkpointing '{work.recompute}' "
                                    f"(smallest: {chosen[0].name} needs "
                                    f"{_gib(chosen[1].total)} per GPU); with every block "
                                    f"recomputed {alt.recommended[0].name} fits "
                                    f"({_gib(alt.recommended[1].total)}): "
                                    "--training.activation_checkpointing=full"))
            return alt
    if rec is None:
        warns.append(("nothing-fits", f"no layout of {num_gpus} GPUs fits in "
                      f"{_gib(usable_bytes)} per GPU (smallest: {chosen[0].name} needs "
                      f"{_gib(chosen[1].total)}); add GPUs, lower the micro-batch or "
                      f"sequence length"))
    return LayoutAdvice(work, num_gpus, gpus_per_node, usable_bytes, rows, rec, req, warns)


# ------------------------------------------------------------------------------------ CLI


def add_layout_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the planner's flags to ``parser`` (used by ``python -m trainer plan``)."""
    g = parser.add_argument_group("model (one of --params, --dim/--layers/--heads, --config; "
                                  "the flags override --config's keys)")
    g.add_argument("--config", help="trainer TOML config: model dims, seq_len, batch, layout")
    g.add_argument("--params", help="parameter count, e.g. 7B, 350M (shape is then guessed)")
    g.add_argument("--dim", type=int)
    g.add_argument("--layers", type=int)
    g.add_argument("--heads", type=int)
    g.add_argument("--kv-heads", type=int,
                   help="key/value heads (grouped-query attention; default --heads)")
    g.add_argument("--vocab", type=int, help="vocabulary size (default 32000)")
    g.add_argument("--ffn-dim", type=int, help="MLP hidden size (default 4 * dim)")
    g.add_argument("--activation", choices=("swiglu", "gelu"),
                   help="MLP kind: swiglu has 3 matrices, gelu 2 (default swiglu)")
    e = parser.add_argument_group("mixture of experts (model.n_experts ...; needs an exact "
                                  "shape: --dim/--layers/--heads or --config)")
    e.add_argument("--experts", type=int, help="routed experts per MoE block (model.n_experts)")
    e.add_argument("--experts-per-token", type=int, help="top-k (model.experts_per_token)")
    e.add_argument("--moe-every", type=int, help="every k-th block is MoE (model.moe_every)")
    e.add_argument("--moe-ffn-dim", type=int, help="one expert's hidden size (model.moe_ffn_dim)")
    e.add_argument("--shared-experts", type=int, help="model.n_shared_experts")
    t = parser.add_argument_group("training")
    t.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adamw")
    t.add_argument("--precision", choices=sorted(PRECISIONS),
                   help="default bf16-mixed (fp32 master weights)")
    t.add_argument("--seq-len", type=int)
    t.add_argument("--micro-batch", type=int, help="sequences per forward per GPU (default 1)")
    t.add_argument("--global-batch", type=int, help="sequences per step (sets micro-batches)")
    t.add_argument("--microbatches", type=int, help="pipeline micro-batches per step")
    t.add_argument("--recompute", choices=ACTIVATION_CHECKPOINTING,
                   help="activation checkpointing (training.activation_checkpointing; default "
                   "--config's, else none; full is advised when nothing fits without)")
    t.add_argument("--recompute-every", type=int,
                   help="with --recompute selective: every k-th block (default --config's, else 2)")
    t.add_argument("--flash-attention", action="store_true",
                   help="attention scores are not stored (a fused kernel)")
    t.add_argument("--no-sequence-parallel", action="store_true")
    t.add_argument("--pp-schedule", choices=("gpipe", "1f1b", "interleaved1f1b"))
    t.add_argument("--stages-per-rank", type=int)
    h = parser.add_argument_group("hardware")
    h.add_argument("--gpu", default="h100", help=f"preset: {', '.join(GPU_PRESETS)}")
    h.add_argument("--gpu-memory", type=float, help="GiB per GPU (overrides the preset)")
    h.add_argument("--gpus-per-node", type=int, default=8)
    h.add_argument("--nodes", type=int, default=1)
    h.add_argument("--headroom", type=float, default=0.10,
                   help="fraction kept free for CUDA context, NCCL, fragmentation")
    r = parser.add_argument_group("a layout to check (else taken from --config)")
    r.add_argument("--pp", type=int)
    r.add_argument("--dp", type=int)
    r.add_argument("--tp", type=int)
    r.add_argument("--dp-mode", choices=SHARDINGS)
    r.add_argument("--dp-replicate", type=int,
                   help="HSDP replicas of the dp axis (with --dp-mode fsdp; default 1)")
    r.add_argument("--ep", type=int, help="expert-parallel degree, part of dp_shard (default 1)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--all", action="store_true", help="list every candidate layout")


def _check_kv_heads(kv_heads: int | None, n_heads: int) -> None:
    if kv_heads is not None and (kv_heads < 1 or n_heads % kv_heads):
        raise ValueError(f"--kv-heads: {kv_heads} does not divide the {n_heads} query heads; "
                         "pick a divisor (or leave it out for as many)")


def _from_args(args: argparse.Namespace) -> tuple[Workload, int, int, float, Candidate | None,
                                                  str]:
    num_gpus = args.nodes * args.gpus_per_node
    cfg = load_config(args.config, []) if args.config else None
    vocab = args.vocab or (cfg.model.vocab_size if cfg else 32000)
    moe = {key: value for key, value in (
        ("n_experts", args.experts), ("experts_per_token", args.experts_per_token),
        ("moe_every", args.moe_every), ("moe_ffn_dim", args.moe_ffn_dim),
        ("n_shared_experts", args.shared_experts)) if value is not None}
    if args.params:
        if moe:
            raise ValueError("--experts and the other mixture-of-experts flags need the exact "
                             "shape: give --dim/--layers/--heads or --config instead of --params")
        shape = shape_from_params(parse_count(args.params), vocab)
        _check_kv_heads(args.kv_heads, shape.n_heads)
        shape = replace(shape, n_kv_heads=args.kv_heads)
    elif args.dim or args.layers or args.heads or cfg:
        if not cfg and not (args.dim and args.layers and args.heads):
            raise ValueError("--dim, --layers and --heads go together; give all three")
        _check_kv_heads(args.kv_heads, args.heads or cfg.model.n_heads)
        given = {key: value for key, value in (
            ("dim", args.dim), ("n_layers", args.layers), ("n_heads", args.heads),
            ("vocab_size", vocab), ("ffn_dim", args.ffn_dim), ("activation", args.activation),
            ("n_kv_heads", args.kv_heads)) if value is not None}
        # The [model] section checks the sizes and picks the MoE blocks (one definition).
        shape = shape_from_config(replace(cfg.model, **given, **moe) if cfg
                                  else ModelConfig(**given, **moe))
    else:
        raise ValueError("give the model as --params 7B, as --dim/--layers/--heads, "
                         "or as --config FILE")
    requested = None
    p = cfg.parallel if cfg else None
    pp, tp = args.pp or (p.pp if p else None), args.tp or (p.tp if p else None)
    if any(x is not None for x in (args.pp, args.tp, args.dp, args.dp_mode,
                                   args.dp_replicate, args.ep)) or cfg:
        pp, tp = pp or 1, tp or 1
        dp = args.dp or (p.dp if p and p.dp != -1 else num_gpus // (pp * tp))
        replicate = args.dp_replicate or (p.dp_replicate if p else 1)
        ep = args.ep or (p.ep if p else 1)
        mode = args.dp_mode or (p.dp_mode if p else ("fsdp" if tp > 1 or replicate > 1
                                                     or ep > 1 else "ddp"))
        if replicate < 1 or dp % replicate:
            raise ValueError(f"--dp-replicate: {replicate} does not divide dp={dp}; pick a "
                             "divisor of dp (dp = dp_replicate * dp_shard)")
        requested = Candidate.of(pp, dp, tp, mode, dp_replicate=replicate, ep=ep)
    micro, m_count, gbatch = args.micro_batch, args.microbatches, args.global_batch
    if cfg and requested and requested.num_gpus == num_gpus and micro is None:
        m_count = m_count or (p.num_microbatches if requested.pp > 1 else None)
        per_rank = cfg.training.global_batch_size // (requested.dp * cfg.training.grad_accum_steps)
        micro = max(1, per_rank // (m_count or 1))
    work = Workload(
        shape=shape, optimizer=args.optimizer,
        precision=args.precision or ("bf16-mixed" if not cfg or
                                     cfg.training.mixed_precision == "bf16" else "fp32"),
        seq_len=args.seq_len or (cfg.training.seq_len if cfg else 2048),
        micro_batch=micro or 1, num_microbatches=m_count, global_batch=gbatch,
        recompute=args.recompute or (cfg.training.activation_checkpointing if cfg else "none"),
        recompute_every=args.recompute_every or (cfg.training.activation_checkpointing_every
                                                 if cfg else 2),
        flash_attention=args.flash_attention,
        sequence_parallel=not args.no_sequence_parallel and (p.sequence_parallel if p else True),
        pp_schedule=args.pp_schedule or (p.pp_schedule if p else "1f1b"),
        stages_per_rank=args.stages_per_rank or (p.stages_per_rank if p else 2))
    if args.gpu_memory:
        capacity, gpu_name = args.gpu_memory * GIB, f"{args.gpu_memory:g} GiB GPU"
    else:
        spec = get_gpu(args.gpu)
        capacity, gpu_name = spec.memory_bytes, spec.name
    return work, num_gpus, args.gpus_per_node, capacity * (1 - args.headroom), requested, gpu_name


def _report(advice: LayoutAdvice, gpu_name: str, nodes: int, show_all: bool) -> str:
    w, sh = advice.work, advice.work.shape
    pc = PRECISIONS[w.precision]
    kv = f" ({sh.n_kv_heads} key/value)" if sh.n_kv_heads not in (None, sh.n_heads) else ""
    shape = f"dim {sh.dim}, {sh.n_layers} layers, {sh.n_heads} heads{kv}, vocab {sh.vocab_size}"
    lines = [
        f"Model     {_count(sh.num_params)} params ({'assumed shape: ' if sh.inferred else ''}"
        f"{shape}{'; pass --dim/--layers/--heads for exact activations' if sh.inferred else ''})",
        *([f"Experts   {_count(sh.active_params)} of them active per token: "
           f"{sh.n_experts} experts, top-{sh.experts_per_token}"
           f"{f', {sh.n_shared_experts} shared' if sh.n_shared_experts else ''}, in "
           f"{len(sh.moe_layer_ids)} of {sh.n_layers} blocks; the routed experts hold "
           f"{_count(sh.expert_params(sh.moe_layer_ids))} (split over the ep ranks)"]
          if sh.n_experts else []),
        f"Hardware  {nodes} node(s) x {advice.gpus_per_node} x {gpu_name}; "
        f"{_gib(advice.usable_bytes)} usable per GPU",
        f"Training  {w.precision} ({pc.description}), {w.optimizer}, seq {w.seq_len}, "
        f"micro-batch {w.micro_batch}, recompute {w.recompute}"
        f"{f' (every {w.recompute_every})' if w.recompute == 'selective' else ''}"
        f"{', flash attention' if w.flash_attention else ''}",
        f"Per param {pc.weight_bytes} weights + {pc.grad_bytes} grads + {optimizer_bytes_per_param(w):g} "
        f"optimizer = {pc.weight_bytes + pc.grad_bytes + optimizer_bytes_per_param(w):g} bytes; unsharded "
        f"model state {_gib((pc.weight_bytes + pc.grad_bytes + optimizer_bytes_per_param(w)) * sh.num_params)}"
        f", of which optimizer state {_gib(optimizer_bytes_per_param(w) * sh.num_params)}",
        "",
    ]
    for label, pair in (("Requested", advice.requested), ("Recommended", advice.recommended)):
        if pair:
            lay, e = pair
            lines += [f"{label + ':':13}{lay.name}  ({'fits' if advice.fits(e) else 'DOES NOT FIT'})",
                      f"             {advice.overrides(lay)}",
                      f"             {_gib(e.total)} of {_gib(advice.usable_bytes)} per GPU"]
            if sh.n_experts:
                sent = all_to_all_bytes_per_step(w, lay)
                lines.append(f"             experts {_gib(e.experts)} of it (weights, grads, "
                             f"optimizer; {sh.n_experts // lay.ep} experts a block per ep "
                             f"rank); " + (f"all-to-all {_gib(sent)} sent per step"
                                           if lay.ep > 1 else "no all-to-all (ep 1)"))
    if advice.recommended is None:
        lines.append("Recommended: none - nothing fits (see warnings)")
    unit, div = ("GiB", GIB) if advice.usable_bytes >= 4 * GIB else ("MiB", 1 << 20)
    a2a = f" {'a2a/step':>8}" if sh.n_experts else ""
    head = f"\n{'layout':30} {'weights':>8} {'grads':>8} {'optim':>8} {'buffers':>8} " \
           f"{'activ':>8} {'logits':>8} {'total':>8}{a2a}  fits   ({unit} per GPU)"
    lines.append(head)
    rows = advice.rows if show_all else advice.rows[:14]
    for lay, e in rows:
        vals = (e.weights, e.grads, e.optimizer, e.fsdp_buffers, e.activations, e.logits, e.total)
        vals += (all_to_all_bytes_per_step(w, lay),) if sh.n_experts else ()
        mark = "yes" if advice.fits(e) else "no"
        note = " (no trainer mode)" if lay.sharding in ("zero1", "zero2") else ""
        lines.append(f"{lay.name:30} " + " ".join(f"{v / div:8.1f}" for v in vals) +
                     f"  {mark}{note}")
    if len(advice.rows) > len(rows):
        lines.append(f"... {len(advice.rows) - len(rows)} more (--all)")
    if advice.warnings:
        lines.append("\nWarnings:")
        lines += [f"  [{code}] {msg}" for code, msg in advice.warnings]
    return "\n".join(lines)


def run_layout_plan(args: argparse.Namespace) -> int:
    """Print the advice (text, or JSON with ``--json``). Returns 0 when a layout fits (and the
    requested one, if any, fits), 1 when it does not, 2 for bad input."""
    try:
        work, num_gpus, gpn, usable, requested, gpu_name = _from_args(args)
        advice = plan_layout(work, num_gpus, gpn, usable, requested)
    except ValueError as e:
        print(f"plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(advice.to_dict(), indent=2))
    else:
        print(_report(advice, gpu_name, args.nodes, args.all))
    ok = advice.recommended is not None and (advice.requested is None or
                                             advice.fits(advice.requested[1]))
    return 0 if ok else 1
