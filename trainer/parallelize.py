"""Apply TP, FSDP2/DDP and pipeline parallelism to the reference transformer.

Order, per pipeline stage module (all built on the meta device, so no rank ever holds
the full model): tensor parallel on ``mesh["tp"]`` -> expert parallel on ``mesh["ep"]``
(the routed experts split over ep, ``trainer.expert_parallel``) -> activation checkpointing of the
chosen blocks (``apply_activation_checkpointing``, torchtitan's place: after TP, before
FSDP, so FSDP's all-gather hooks stay outside the recomputed region) -> FSDP2 on
``mesh["dp"]`` (HSDP: on the 2-D ``mesh["dp_replicate", "dp_shard"]``, sharded over dp_shard, replicated over
dp_replicate; FSDP2 reduce-scatters within a replica and all-reduces across them; the
experts of an ep layout on ``dp_shard_mod_ep``, ``trainer.mesh``) ->
``to_empty`` + ``init_weights(seed)`` (layout-independent values, see ``trainer.model``)
-> DDP wrapper when ``dp_mode == "ddp"`` (pp == 1; with pp > 1 the gradients are
all-reduced once per step instead, see ``build_parallel_model``) -> ``PipelineStage`` +
schedule when pp > 1. A degree of 1 skips that step (no FSDP on a 1-rank dp axis).
Mixed precision: FSDP2's MixedPrecisionPolicy when FSDP runs, else autocast.

The TP plan and the FSDP2 groups of one stage module are :mod:`trainer.parallel_plans`
(``apply_tp``, ``apply_fsdp``). ``build_parallel_model`` returns a
``ParallelModel``; the train loop only needs ``train_step`` / ``forward_backward``,
``clip_grad_norm_``, ``parameters``/``model_parts`` and the state-dict helpers. All methods that communicate must be called by every rank
of the mesh, in the same order.

Size: the one order in which the parallelisms are applied to a stage, each step of it
short; kept together so that the order reads in one place.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Collection, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from trainer.comms import CommMeter
from trainer.config import ModelConfig, ParallelConfig
from trainer.expert_parallel import shard_experts
from trainer.mesh import dp_mesh, expert_fsdp_mesh, fsdp_mesh
from trainer.model import Transformer, cross_entropy_loss
from trainer.parallel_plans import apply_fsdp, apply_tp
from trainer.pipeline import (
    build_pipeline_stages,
    build_schedule,
    build_stage_modules,
    run_schedule,
)

__all__ = ["ParallelModel", "build_parallel_model", "apply_activation_checkpointing"]


class ParallelModel:
    """This rank's part of the model plus the machinery to train it.

    Attributes:
        model_parts: this rank's stage modules (one, or ``stages_per_rank`` with
            interleaved pipelining), never wrapped: parameter names equal the full model's.
        mesh: the (pp, dp, tp) DeviceMesh (HSDP: (pp, dp_replicate, dp_shard, tp) with a
            flattened "dp"; see ``trainer.mesh``), or None for a plain single process.
        comm: the :class:`trainer.comms.CommMeter` of this rank's gradient and parameter
            collectives (DDP buckets, FSDP2, the pipeline's flat all-reduce and sends) and
            of its MoE blocks' expert-parallel all-to-alls.
    """

    def __init__(self, model_cfg, par, mesh, parts, runners, stages, schedule, device,
                 param_dtype: torch.dtype = torch.float32):
        self.model_cfg: ModelConfig = model_cfg
        self.par: ParallelConfig = par
        self.param_dtype = param_dtype
        self.mesh = mesh
        self.model_parts: list[nn.Module] = parts
        self._runners = runners  # what forward calls (DDP wrappers or the parts)
        self._stages = stages
        self._schedule = schedule
        self.device = device
        self._fsdp = mesh is not None and par.dp > 1 and par.dp_mode == "fsdp"
        self._loss_divisor = 1.0
        self.holds_last_stage = stages is None or any(s.is_last for s in stages)
        self.comm = CommMeter(device)

    def parameters(self) -> Iterator[nn.Parameter]:
        """All parameters of this rank (for the optimizer)."""
        for part in self.model_parts:
            yield from part.parameters()

    def train(self, mode: bool = True) -> "ParallelModel":
        for part in self.model_parts:
            part.train(mode)
        return self

    def _autocast(self):
        # FSDP2 casts params itself (MixedPrecisionPolicy); elsewhere use autocast.
        if self.param_dtype == torch.bfloat16 and not self._fsdp:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _grad_sync(self, sync: bool):
        """Context that suppresses the dp gradient reduction when ``sync`` is False."""
        runner = self._runners[0]
        if sync or self.mesh is None or self.par.dp == 1:
            return contextlib.nullcontext()
        if isinstance(runner, nn.parallel.DistributedDataParallel):
            return runner.no_sync()

        @contextlib.contextmanager
        def fsdp_no_sync():
            runner.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                runner.set_requires_gradient_sync(True)

        return fsdp_no_sync()

    def _allreduce_grads(self) -> None:
        """Average plain-tensor gradients over the dp group, one flat buffer per dtype."""
        group = dp_mesh(self.mesh).get_group()
        by_dtype: dict = {}
        for p in self.parameters():
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            mark = self.comm.start()
            self.comm.timed("all_reduce", flat.numel() * flat.element_size(),
                            dist.all_reduce(flat, group=group), mark)
            flat /= self.par.dp
            for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(reduced.view_as(g))

    def _pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy_loss(logits, targets) / self._loss_divisor

    def forward_backward(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        num_accum_steps: int = 1,
        sync_grads: bool = True,
    ) -> float:
        """Forward and backward on this dp rank's slice; gradients *accumulate* in ``.grad``.

        Args:
            inputs, targets: (local_batch, seq) token ids, this dp rank's slice of the global
                batch (same on all pp and tp ranks of the dp replica).
            num_accum_steps: how many calls make up one optimizer step; gradients are
                scaled by ``1 / num_accum_steps`` so the result is the mean over all of them.
            sync_grads: False on all but the last accumulation call skips the dp
                reduction. Exception: with pp > 1 and FSDP the pipeline stages reduce on
                every call anyway (the sums are the same, only the traffic is higher).

        Returns the mean token cross-entropy of this call's global batch (all dp ranks),
        identical on every rank. Every rank of the mesh must call it.
        """
        n_mb = self.par.num_microbatches
        self._loss_divisor = float(n_mb * num_accum_steps)
        for part in self.model_parts:  # the balancing loss is divided as the cross-entropy
            part.set_aux_loss_scale(1.0 / self._loss_divisor)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        with self._autocast():
            if self._schedule is not None:
                for stage in self._stages:
                    stage.submod.train()
                losses = run_schedule(self._schedule, self._stages, inputs, targets)
                if sync_grads and self.par.dp > 1 and self.par.dp_mode == "ddp":
                    self._allreduce_grads()
                local = (
                    torch.stack([l.detach().float() for l in losses]).sum() * num_accum_steps
                    if losses
                    else torch.zeros((), device=self.device)
                )
            else:
                local = torch.zeros((), device=self.device)
                pairs = list(zip(inputs.chunk(n_mb), targets.chunk(n_mb)))
                for i, (x, y) in enumerate(pairs):
                    with self._grad_sync(sync_grads and i == len(pairs) - 1):
                        ce = cross_entropy_loss(self._runners[0](x), y)
                        (ce / self._loss_divisor).backward()
                    local += ce.detach().float()
                local /= n_mb
        if sync_grads and self.mesh is not None:
            self._reduce_partial_grads()
        return self._global_mean(local)

    def _reduce_partial_grads(self) -> None:
        """Turn ``Partial`` DTensor gradients into ``Replicate`` ones, in place.

        With sequence parallel and no FSDP, the norm weights (Replicate on tp) get
        gradients that are per-rank partial sums over sequence shards. Left as they are,
        every optimizer op touching them would all-reduce again, and the grad norm could
        not be taken locally; one all-reduce each here fixes both.
        """
        for p in self.parameters():
            g = p.grad
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                placements = [Replicate() if pl.is_partial() else pl for pl in g.placements]
                p.grad = g.redistribute(g.device_mesh, placements)

    def take_router_stats(self) -> dict:
        """Router statistics of this rank's MoE blocks since the last call, by global layer
        index (``trainer.model.RouterStats``; empty for a dense model). Local."""
        return {k: v for part in self.model_parts for k, v in part.take_router_stats().items()}

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One forward+backward of a whole optimizer step (no accumulation); see ``forward_backward``."""
        return self.forward_backward(inputs, targets)

    def _global_mean(self, local: torch.Tensor) -> float:
        if self.mesh is None:
            return float(local)
        # Each dp replica's loss sits on its last-stage ranks (tp copies are equal);
        # everyone else contributes 0, so one world all-reduce gives every rank the value.
        value = local.detach().clone() if self.holds_last_stage else torch.zeros_like(local)
        dist.all_reduce(value)
        return float(value) / (self.par.dp * self.par.tp)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scale gradients so their *global* norm is at most ``max_norm``; return that norm.

        The norm covers every parameter of the model once, across dp shards (FSDP), tp
        shards and pp stages, so it equals the single-process norm. Every rank calls it;
        it costs one all-reduce of a scalar over the world.
        """
        total = self._global_grad_norm(norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
        return float(total)

    def _global_grad_norm(self, norm_type: float) -> torch.Tensor:
        # Each rank sums |local grad|^p over its local shards, weighting every shard by
        # 1 / (number of ranks holding an identical copy of it), then one world all-reduce
        # adds everything up. Copies = ranks on the dp and tp axes that the gradient is
        # not sharded over (pp stages hold different parameters, never copies). This beats
        # DTensor norms + full_tensor(): one collective instead of one or two per
        # (mesh, placements) group, and no reliance on gradient placements matching.
        replicas = 1 if self.mesh is None else self.par.dp * self.par.tp
        is_inf = math.isinf(norm_type)
        acc = torch.zeros((), device=self.device, dtype=torch.float32)
        for p in self.parameters():
            g = p.grad
            if g is None:
                continue
            shards = 1
            if isinstance(g, DTensor):
                # forward_backward(sync_grads=True) leaves no Partial gradients behind.
                assert not any(pl.is_partial() for pl in g.placements), g.placements
                for dim, placement in enumerate(g.placements):
                    # Not is_shard(): FSDP2 over TP uses _StridedShard, which says False.
                    if not placement.is_replicate():
                        shards *= g.device_mesh.size(dim)
                g = g.to_local()
            norm = torch.linalg.vector_norm(g, norm_type, dtype=torch.float32)
            acc = torch.maximum(acc, norm) if is_inf else acc + norm**norm_type * (shards / replicas)
        if self.mesh is not None:
            dist.all_reduce(acc, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM)
        return acc if is_inf else acc ** (1.0 / norm_type)

    # --- checkpoint helpers: keys are the full model's FQNs on every layout -------------
    def model_state_dict(self) -> dict:
        """This rank's model state (DTensor shards under FSDP/TP), merged over its parts."""
        return {k: v for part in self.model_parts for k, v in get_model_state_dict(part).items()}

    def optimizer_state_dict(self, optimizers: Sequence[torch.optim.Optimizer]) -> dict:
        """Flattened optimizer state; ``optimizers[i]`` must own exactly ``model_parts[i]``'s params."""
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        self._check_optimizers(optimizers)
        out: dict = {}
        for part, optim in zip(self.model_parts, optimizers):
            out.update(get_optimizer_state_dict(part, optim, options=opts))
        return out

    def load_model_state_dict(self, state: dict) -> None:
        """Load (in place) from a dict with the keys of ``model_state_dict`` (a superset is fine)."""
        for part in self.model_parts:
            own = {k: state[k] for k in part.state_dict() if k in state}
            set_model_state_dict(part, own)

    def load_optimizer_state_dict(
        self, optimizers: Sequence[torch.optim.Optimizer], state: dict
    ) -> None:
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        self._check_optimizers(optimizers)
        for part, optim in zip(self.model_parts, optimizers):
            set_optimizer_state_dict(part, optim, state, options=opts)

    def _check_optimizers(self, optimizers) -> None:
        if len(optimizers) != len(self.model_parts):
            raise ValueError(
                f"need one optimizer per model part ({len(self.model_parts)}), got "
                f"{len(optimizers)}; build them as [Opt(p.parameters()) for p in model_parts]"
            )


def apply_activation_checkpointing(model: Transformer, layer_ids: Collection[int]) -> None:
    """Recompute the activations of ``model``'s blocks whose global index is in
    ``layer_ids`` during backward instead of keeping them from the forward (blocks this
    module does not hold are ignored). Each such block's ``forward`` runs under
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: only the block's input is
    saved, and backward runs the block's forward once more.

    The block stays where it is (no ``CheckpointWrapper`` module around it), so parameter
    names, state-dict keys, the init rule's names and the Hugging Face export are those of
    the model without recomputation: a checkpoint of either loads into the other. Call it
    after tensor parallelism and before FSDP2 (torchtitan's order): TP's hooks live on the
    block's children and rerun inside the recomputation; FSDP2's all-gather and reshard
    hooks sit on the block itself, around it. No randomness runs in a block, so the RNG
    state is not stashed (``preserve_rng_state=False``) and the recomputed values are the
    forward's, bit for bit, wherever the kernels are deterministic.
    """
    for name, block in model.layers.items():
        if int(name) in layer_ids:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False,
                                              preserve_rng_state=False)


def build_parallel_model(
    model_cfg: ModelConfig,
    par: ParallelConfig,
    mesh,
    seed: int,
    device: Optional[torch.device | str] = None,
    param_dtype: torch.dtype = torch.float32,
    recomputed_layers: Collection[int] = (),
) -> ParallelModel:
    """Build, parallelize and initialise this rank's part of the model.

    Contract: every rank of ``mesh`` calls it with identical arguments (it issues collectives
    on the dp/tp/pp groups). ``par`` is resolved and checked against ``model_cfg`` (by
    ``Config.resolved``, or ``par.check`` for library callers); ``mesh`` is
    ``build_mesh(par)``, or None for a plain single-process model (par all-ones). Parameter
    values depend only on ``seed`` and the parameter name, never on the layout. ``device``
    defaults to the current CUDA device for a cuda mesh, else CPU. ``param_dtype``
    ``torch.bfloat16`` computes in bf16 (gradients reduced in fp32). ``recomputed_layers``:
    global indices of the blocks whose activations are recomputed in backward
    (``TrainingConfig.recomputed_layers``; see ``apply_activation_checkpointing``).
    """
    world = 1 if mesh is None else mesh.size()
    if par.world_size != world:
        raise ValueError(f"parallel: pp * dp * tp = {par.world_size} but the mesh has {world} "
                         "ranks; build the mesh with build_mesh(par)")
    if device is None:
        is_cuda = mesh is not None and mesh.device_type == "cuda"
        device = torch.device("cuda", torch.cuda.current_device()) if is_cuda else torch.device("cpu")
    device = torch.device(device)
    if mesh is None:
        with torch.device(device):
            model = Transformer(model_cfg)
        apply_activation_checkpointing(model, recomputed_layers)
        model.init_weights(seed)
        return ParallelModel(model_cfg, par, None, [model], [model], None, None, device,
                             param_dtype)

    pp_rank = mesh["pp"].get_local_rank()
    modules = build_stage_modules(model_cfg, pp_rank, par.pp, par.stages_per_rank, "meta")
    parts, runners = [], []
    for _, module in modules:
        if par.tp > 1:
            apply_tp(module, mesh["tp"], par.sequence_parallel)
        if par.ep > 1:
            for moe in module.moe_blocks().values():
                shard_experts(moe.experts, mesh["ep"])
        apply_activation_checkpointing(module, recomputed_layers)
        if par.dp > 1 and par.dp_mode == "fsdp":
            apply_fsdp(module, fsdp_mesh(mesh, par), param_dtype,
                       reshard_after_forward=par.pp == 1,
                       expert_mesh=expert_fsdp_mesh(mesh, par) if par.ep > 1 else None)
        module.to_empty(device=device)
        module.init_weights(seed)
        parts.append(module)
        if par.dp > 1 and par.dp_mode == "ddp" and par.pp == 1:
            runners.append(
                nn.parallel.DistributedDataParallel(module, process_group=dp_mesh(mesh).get_group())
            )
        else:
            # DDP under a pipeline schedule trips the reducer's first-iteration bucket
            # rebuild (torch 2.13: the schedule's metadata-inference forward arms the
            # autograd hooks, so every micro-batch's backward is recorded, "rebuilt params
            # size 38 vs 19"). With pp > 1, ddp mode therefore all-reduces gradients itself
            # once per step (``_allreduce_grads``): same math, no backward overlap.
            runners.append(module)

    stages = None
    if par.pp > 1:
        stage_modules = [(sid, r) for (sid, _), r in zip(modules, runners)]
        stages = build_pipeline_stages(
            stage_modules, par.num_stages, device, mesh["pp"].get_group()
        )
        pm = ParallelModel(model_cfg, par, mesh, parts, runners, stages, None, device, param_dtype)
        pm._schedule = build_schedule(stages, par.pp_schedule, par.num_microbatches,
                                      pm._pipeline_loss)
        return _metered(pm)
    return _metered(ParallelModel(model_cfg, par, mesh, parts, runners, stages, None, device,
                                  param_dtype))


def _metered(pm: ParallelModel) -> ParallelModel:
    """Attach ``pm.comm`` to the collectives it measures (``trainer.comms``), before the
    first step."""
    for part, runner in zip(pm.model_parts, pm._runners):
        if isinstance(runner, nn.parallel.DistributedDataParallel):
            pm.comm.attach_ddp(runner)
        else:
            pm.comm.attach_fsdp(part)
        for moe in part.moe_blocks().values():
            if moe.experts.ep_group is not None:  # split over ep: its all-to-alls run
                moe.experts.comm = pm.comm
    for stage in pm._stages or ():
        pm.comm.attach_stage(stage)
    return pm
