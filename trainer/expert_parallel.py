"""Expert parallelism: the routed experts of every MoE block split over the ``ep`` ranks,
tokens sent to the rank that holds their expert and back with two all-to-alls.

Where the ranks come from: ``parallel.ep`` divides ``dp_shard`` (torchtitan's rule), and the
mesh splits that axis row-major into ``(dp_shard_mod_ep, ep)`` (:mod:`trainer.mesh`), so the
``ep`` ranks of a group are adjacent data-parallel ranks. Each holds ``n_experts / ep``
experts of every MoE block (the stacked ``[n_experts, ...]`` weights as DTensors sharded on
dim 0 over the ``ep`` mesh axis, so a checkpoint stores them under their global shape and
reshards them to any other ``ep``), and reads its own slice of the batch like any dp rank.
FSDP2 shards the experts further over ``dp_shard_mod_ep`` (and replicates them over
``dp_replicate``); everything else is sharded over all of ``dp_shard`` as without experts.

One MoE block's forward on each rank of an ep group (every rank of the group calls
:func:`dispatch` and :func:`combine` once per block forward, in the same order; the
backward runs the same exchanges in reverse):

1. the router picks ``experts_per_token`` experts per token; the (token, choice) rows are
   sorted by expert (:class:`trainer.model.MoE`);
2. ``dispatch``: an all-to-all of ``n_experts`` integers (how many rows this rank sends to
   each expert), then an all-to-all of the rows themselves to the ranks holding their
   experts, regrouped there by local expert;
3. the local experts run on their rows;
4. ``combine``: the rows go back where they came from (the reverse all-to-all), in the
   order the sender sorted them.

Dropless: a rank receives however many rows the router sent (no capacity factor), so the
all-to-all sizes change from step to step.

Gradients: the holder of an expert sums the gradient contributions of the tokens of all ``ep``
ranks of its group (they reach it through the all-to-all's backward); FSDP2 then averages
over the ``dp_shard_mod_ep`` and ``dp_replicate`` ranks. The dp mean is over all ``dp``
ranks, so the expert weights' gradient is scaled by ``1 / ep`` on the way in
(:func:`local_expert_weight`), which makes it the same mean as every other parameter's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

__all__ = ["Route", "dispatch", "combine", "shard_experts", "local_expert_weight"]


@dataclass
class Route:
    """How :func:`dispatch` moved one block's rows: what :func:`combine` undoes."""

    group: dist.ProcessGroup
    send_splits: list[int]  # rows this rank sent to each ep rank
    recv_splits: list[int]  # rows this rank received from each ep rank
    order: torch.Tensor  # received rows -> grouped by local expert


def dispatch(rows: torch.Tensor, counts: torch.Tensor,
             group: dist.ProcessGroup) -> tuple[torch.Tensor, list[int], Route]:
    """Send ``rows`` (sorted by global expert id, ``counts[e]`` of them for expert ``e``) to
    the ep ranks holding their experts; return the rows this rank received, grouped by its
    local experts, how many each local expert got, and the :class:`Route` for
    :func:`combine`. Collective over ``group``: every rank of it calls it."""
    ep = group.size()
    local = counts.numel() // ep
    counts = counts.to(torch.int64)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)
    # Row s of the matrix: how many rows rank s sends to each of this rank's experts.
    matrix = received_counts.view(ep, local)
    send_splits = counts.view(ep, local).sum(1).tolist()
    recv_splits = matrix.sum(1).tolist()
    received = all_to_all_single_autograd(rows.contiguous(), recv_splits, send_splits, group)
    expert_of_row = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(
        matrix.flatten().to(rows.device))
    order = expert_of_row.argsort(stable=True)
    return received[order], matrix.sum(0).tolist(), Route(group, send_splits, recv_splits, order)


def combine(outputs: torch.Tensor, route: Route) -> torch.Tensor:
    """The local experts' ``outputs`` (in :func:`dispatch`'s grouped order) back to the
    ranks their rows came from, in the order each sent them. Collective over the route's
    group."""
    back = torch.empty_like(outputs).index_copy(0, route.order, outputs)
    return all_to_all_single_autograd(back, route.send_splits, route.recv_splits, route.group)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def local_expert_weight(weight: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's experts of a stacked expert weight, as a plain tensor for the matmuls;
    with a group, the gradient scaled by ``1 / ep`` (the module docstring says why)."""
    if isinstance(weight, DTensor):
        weight = weight.to_local()
    if group is None or group.size() == 1:
        return weight
    return _ScaleGrad.apply(weight, 1.0 / group.size())


def shard_experts(experts: nn.Module, ep_mesh) -> None:
    """Turn ``experts``' stacked weights (``[n_experts, ...]``, on the meta device or not)
    into DTensors sharded on dim 0 over ``ep_mesh`` and route its forward over the mesh's
    group. Every rank of the mesh calls it (no communication for meta tensors)."""
    for name, param in list(experts.named_parameters(recurse=False)):
        experts.register_parameter(name, nn.Parameter(distribute_tensor(
            param, ep_mesh, [Shard(0)], src_data_rank=None)))  # each rank keeps its slice
    experts.ep_group = ep_mesh.get_group()
