"""How tensor parallelism and FSDP2 are applied to one (pipeline stage) module of the
reference transformer: the Megatron-style TP plan and the FSDP2/HSDP sharding groups.

:func:`trainer.parallelize.build_parallel_model` calls them in order (TP, then FSDP) on
every stage module, on the meta device, before the weights are materialised; both must be
called by every rank of the mesh with the same arguments.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainer.model import Transformer

__all__ = ["apply_tp", "apply_fsdp"]


def _mlp_plan(block, between_blocks, sequence_parallel: bool) -> dict:
    """The TP plan of a block's MLP. A dense MLP is split Megatron-style; a mixture of
    experts is not split over tp (TP is for the dense parts; experts scale with ep): each tp
    rank runs the whole MoE on the whole (replicated) tokens, so under sequence parallelism
    its input is gathered and its output cut back to this rank's sequence shard."""
    if block.moe is not None:
        if not sequence_parallel:
            return {}
        return {"moe": PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
            use_local_input=True, output_layouts=(Replicate(),),
            desired_output_layouts=(between_blocks,), use_local_output=True)}
    plan = {"feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=between_blocks)}
    if block.feed_forward.w3 is not None:
        plan["feed_forward.w3"] = ColwiseParallel()
    if sequence_parallel:
        plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                  desired_input_layouts=(Replicate(),))
    return plan


def apply_tp(model: Transformer, tp_mesh, sequence_parallel: bool = False) -> None:
    """Megatron-style TP on one (stage) module: q/k/v and w1/w3 column-sharded, wo and w2
    row-sharded, embedding row-sharded (vocab), output projection column-sharded with
    replicated logits; MoE blocks' MLPs replicated (``_mlp_plan``). With
    ``sequence_parallel`` the norms run on sequence shards and activations between blocks
    stay sharded along the sequence (dim 1)."""
    between_blocks = Shard(1) if sequence_parallel else Replicate()
    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=between_blocks
        )
    if model.output is not None:
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
        # Replicated logits keep the loss a plain cross-entropy; a vocab-sharded loss
        # (loss_parallel) would save memory for large vocabularies.
        plan["output"] = ColwiseParallel(
            input_layouts=between_blocks, output_layouts=Replicate(), use_local_output=True
        )
    parallelize_module(model, tp_mesh, plan)

    for block in model.layers.values():
        block_plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=between_blocks),
            **_mlp_plan(block, between_blocks, sequence_parallel),
        }
        if sequence_parallel:
            gather = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
            block_plan.update(
                {
                    "attention_norm": SequenceParallel(),
                    "attention": gather,
                    "ffn_norm": SequenceParallel(),
                }
            )
        parallelize_module(block, tp_mesh, block_plan)


def apply_fsdp(
    model: Transformer,
    dp_mesh,
    param_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    expert_mesh=None,
) -> None:
    """FSDP2 on one (stage) module: one group per block, one for the remaining root params.

    ``dp_mesh`` is 1-D (FSDP: shard over all of it) or 2-D (HSDP: replicate over its first
    axis, shard over the second). ``expert_mesh`` (expert parallelism: the routed experts
    are DTensors split over ep already): each MoE block's experts get a group of their own
    on it (``trainer.mesh.expert_fsdp_mesh``), inside the block's.

    Under pipelining pass ``reshard_after_forward=False``: a stage runs forward for every
    micro-batch before the matching backwards, and resharding would all-gather per
    micro-batch. Gradients are reduced in fp32 whatever the compute dtype.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.layers.values():
        if expert_mesh is not None and block.moe is not None:
            fully_shard(block.moe.experts, mesh=expert_mesh, mp_policy=mp,
                        reshard_after_forward=reshard_after_forward)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    # The root keeps its params gathered after forward: backward starts with them.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
