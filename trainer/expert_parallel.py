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
   experts (:func:`exchange_rows`), regrouped there by local expert;
3. the local experts run on their rows;
4. ``combine``: the rows go back where they came from (the reverse :func:`exchange_rows`),
   in the order the sender sorted them.

Dropless: a rank receives however many rows the router sent (no capacity factor), so the
all-to-all sizes change from step to step.

Measured: given the rank's :class:`trainer.comms.CommMeter` (``GroupedExperts.comm``, which
``trainer.parallelize`` sets on every block split over ep), every exchange of rows, forward
and backward (and a recomputed block's forward again), counts as ``all_to_all``: the bytes
this rank sends to the other ranks of its group, timed from the call to its completion on
this rank (``trainer.comms`` says how, on CUDA and on CPU). The exchange of the row counts
before it is not timed: it is where a rank waits for peers that route later, which would
otherwise read as a slow link.

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
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from trainer.comms import CommMeter

__all__ = ["Route", "dispatch", "combine", "exchange_rows", "shard_experts",
           "local_expert_weight"]


@dataclass
class Route:
    """How :func:`dispatch` moved one block's rows: what :func:`combine` undoes."""

    group: dist.ProcessGroup
    send_splits: list[int]  # rows this rank sent to each ep rank
    recv_splits: list[int]  # rows this rank received from each ep rank
    order: torch.Tensor  # received rows -> grouped by local expert
    meter: CommMeter | None = None  # what times the exchanges (trainer.comms), if any


def dispatch(rows: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup,
             meter: CommMeter | None = None) -> tuple[torch.Tensor, list[int], Route]:
    """Send ``rows`` (sorted by global expert id, ``counts[e]`` of them for expert ``e``) to
    the ep ranks holding their experts; return the rows this rank received, grouped by its
    local experts, how many each local expert got, and the :class:`Route` for
    :func:`combine`. Collective over ``group``: every rank of it calls it. ``meter``: the
    rank's :class:`trainer.comms.CommMeter`, which then counts the rows' exchanges (this
    one, its backward, and :func:`combine`'s)."""
    ep = group.size()
    local = counts.numel() // ep
    counts = counts.to(torch.int64)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)
    # Row s of the matrix: how many rows rank s sends to each of this rank's experts.
    matrix = received_counts.view(ep, local)
    send_splits = counts.view(ep, local).sum(1).tolist()
    recv_splits = matrix.sum(1).tolist()
    received = exchange_rows(rows, recv_splits, send_splits, group, meter)
    expert_of_row = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(
        matrix.flatten().to(rows.device))
    order = expert_of_row.argsort(stable=True)
    return received[order], matrix.sum(0).tolist(), Route(group, send_splits, recv_splits, order,
                                                          meter)


def combine(outputs: torch.Tensor, route: Route) -> torch.Tensor:
    """The local experts' ``outputs`` (in :func:`dispatch`'s grouped order) back to the
    ranks their rows came from, in the order each sent them. Collective over the route's
    group."""
    back = torch.empty_like(outputs).index_copy(0, route.order, outputs)
    return exchange_rows(back, route.send_splits, route.recv_splits, route.group, route.meter)


def exchange_rows(rows: torch.Tensor, recv_splits: list[int], send_splits: list[int],
                  group: dist.ProcessGroup, meter: CommMeter | None = None) -> torch.Tensor:
    """The all-to-all of rows: ``send_splits[r]`` consecutive rows of ``rows`` to rank ``r``
    of ``group``, ``recv_splits[r]`` received from it (in rank order); differentiable (the
    gradient goes back by the reverse exchange). Collective over ``group``, forward and
    backward alike. ``meter``: counts each exchange as ``all_to_all`` (module docstring)."""
    return _ExchangeRows.apply(rows, recv_splits, send_splits, group, meter)


def _exchange(rows: torch.Tensor, recv_splits: list[int], send_splits: list[int],
              group: dist.ProcessGroup, meter: CommMeter | None) -> torch.Tensor:
    rows = rows.contiguous()
    out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
    mark = meter.start() if meter is not None else None
    dist.all_to_all_single(out, rows, recv_splits, send_splits, group=group)
    if meter is not None:
        me = group.rank()
        row_bytes = rows[0].numel() * rows.element_size() if rows.shape[0] else 0
        meter.finish("all_to_all", row_bytes * sum(n for r, n in enumerate(send_splits)
                                                   if r != me), mark)
    return out


class _ExchangeRows(torch.autograd.Function):
    """:func:`exchange_rows`: forward sends by ``send_splits``; backward sends the received
    rows' gradient back (by ``recv_splits``), so each row's gradient reaches its sender."""

    @staticmethod
    def forward(ctx, rows, recv_splits, send_splits, group, meter):
        ctx.exchange = (recv_splits, send_splits, group, meter)
        return _exchange(rows, recv_splits, send_splits, group, meter)

    @staticmethod
    def backward(ctx, grad):
        recv_splits, send_splits, group, meter = ctx.exchange
        return _exchange(grad, send_splits, recv_splits, group, meter), None, None, None, None


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
