"""Bytes and seconds of the trainer's collectives, by kind, measured where they run.

A :class:`CommMeter` belongs to one rank's :class:`trainer.parallelize.ParallelModel`; the
train loop takes its totals once per step (:meth:`CommMeter.take`) into the ``train_step``
event (``comm_bytes``, ``comm_seconds``: ``{kind: value}``), which ``monitoring/`` turns into
``train_comm_bytes_total`` / ``train_comm_seconds_total``; their rates' ratio is the achieved
bandwidth per kind.

Kinds (``ckpt.events.COMM_KINDS``) and where each is measured:

=================  ==========================================================================
``all_reduce``     DDP's gradient buckets (a DDP comm hook that is DDP's own default,
                   ``allreduce_hook``, timed), and the one flat gradient all-reduce per step of
                   ``dp_mode="ddp"`` under a pipeline
``reduce_scatter`` FSDP2's gradient reduce-scatter (its ``set_custom_reduce_scatter`` with
                   FSDP2's default, timed)
``all_gather``     FSDP2's parameter all-gather (``set_custom_all_gather``, likewise)
``send_recv``      the pipeline's activations and gradients between stages: bytes only (see
                   below)
``all_to_all``     expert parallelism's exchanges of token rows (``trainer.expert_parallel``:
                   dispatch and combine, forward and backward, a recomputed block's forward
                   again), timed in ``exchange_rows``; the meter is the MoE blocks'
                   ``GroupedExperts.comm``
=================  ==========================================================================

What a measurement is: ``bytes`` is the collective's whole buffer (all-reduce: the tensor;
all-gather: the gathered output; reduce-scatter: the input), as nccl-tests count "size", so
``bytes / seconds`` is the algorithm bandwidth; for an all-to-all, the bytes this rank sends
to the other ranks (the rows it keeps move no data; the layout planner's
``all_to_all_bytes_per_step`` counts the same). ``seconds`` runs from the call on this rank
to its completion on this rank: on CUDA, between two CUDA events on the stream the collective
runs after (read when they have completed, never synchronising the host); on CPU, wall time
(an asynchronous collective's completion is its future's callback). It includes waiting for
peers that arrive later, so a rank that waits for a slow peer inside a timed collective sees
its bandwidth fall too; the per-step collectives that are not timed (the loss, the gradient
norm) absorb most of that skew.

Not measured: the pipeline's sends and receives are counted in bytes but not timed (the
schedule issues and waits for them inside torch's pipelining code, and their waits are
mostly pipeline bubbles, not transfers: a bandwidth from them would measure the bubble);
tensor-parallel collectives inside DTensor ops; HSDP's all-reduce across replicas inside
FSDP2; the replica groups' average (``trainer.ft``); the exchange of row counts before
each expert-parallel dispatch (``n_experts`` integers, where a rank waits for its peers'
routing: ``trainer.expert_parallel``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import FSDPModule

# The interfaces FSDPModule.set_custom_all_gather / set_custom_reduce_scatter take (torch 2.13
# documents them there but exports them only from this module).
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from ckpt.events import COMM_KINDS

__all__ = ["CommMeter"]


class CommMeter:
    """Per-kind totals of one rank's collectives since the last :meth:`take`.

    Measurements arrive from the training thread, the autograd thread (DDP hooks) and the
    process group's threads (futures' callbacks); a lock guards the totals. On CUDA a
    measurement whose end event has not completed yet waits in a list and counts at the
    first :meth:`take` after it completed.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self._lock = threading.Lock()
        self._bytes = dict.fromkeys(COMM_KINDS, 0)
        self._seconds = dict.fromkeys(COMM_KINDS, 0.0)
        self._pending: list[tuple[str, Any, Any]] = []  # (kind, start event, end event)

    # -- measuring -------------------------------------------------------------------------
    def start(self) -> Any:
        """A start mark on this thread's current stream (CUDA) or clock (CPU)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def finish(self, kind: str, nbytes: int, mark: Any) -> None:
        """Count one collective of ``kind`` and ``nbytes`` that began at ``mark`` and has
        completed on this rank (CPU), or whose completion is now enqueued on the current
        stream (CUDA)."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            with self._lock:
                self._bytes[kind] += int(nbytes)
                self._pending.append((kind, mark, end))
            return
        seconds = time.perf_counter() - mark
        with self._lock:
            self._bytes[kind] += int(nbytes)
            self._seconds[kind] += seconds

    def count_bytes(self, kind: str, nbytes: int) -> None:
        """Bytes of a transfer this meter does not time (``send_recv``)."""
        with self._lock:
            self._bytes[kind] += int(nbytes)

    def timed(self, kind: str, nbytes: int, work: Any, mark: Any) -> Any:
        """``work`` returned by a collective started at ``mark``: a ``dist.Work`` (asynchronous:
        counted when its future completes) or None (synchronous: complete now). Returns
        ``work``."""
        if work is None:
            self.finish(kind, nbytes, mark)
        else:
            work.get_future().then(lambda _fut: self.finish(kind, nbytes, mark))
        return work

    # -- reading ---------------------------------------------------------------------------
    def take(self) -> tuple[dict[str, int], dict[str, float]]:
        """``({kind: bytes}, {kind: seconds})`` counted since the last call, then zeroed;
        kinds with nothing counted are left out. Never blocks on the device."""
        with self._lock:
            waiting = []
            for kind, begin, end in self._pending:
                if end.query():
                    self._seconds[kind] += begin.elapsed_time(end) / 1000.0
                else:
                    waiting.append((kind, begin, end))
            self._pending = waiting
            nbytes = {k: v for k, v in self._bytes.items() if v}
            seconds = {k: v for k, v in self._seconds.items() if v}
            self._bytes = dict.fromkeys(COMM_KINDS, 0)
            self._seconds = dict.fromkeys(COMM_KINDS, 0.0)
        return nbytes, seconds

    # -- attaching to DDP, FSDP2 and pipeline stages ---------------------------------------
    def attach_ddp(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Time DDP's bucket all-reduces: DDP's default comm hook, unchanged (the same
        average, the same results), wrapped. Before the first backward."""
        ddp.register_comm_hook(ddp.process_group, self._ddp_hook)

    def _ddp_hook(self, process_group, bucket):  # no annotations: DDP checks them as types
        buf = bucket.buffer()
        nbytes, mark = buf.numel() * buf.element_size(), self.start()

        def done(fut: torch.futures.Future) -> torch.Tensor:
            self.finish("all_reduce", nbytes, mark)
            return fut.value()

        return allreduce_hook(process_group, bucket).then(done)

    def attach_fsdp(self, module: nn.Module) -> None:
        """Time FSDP2's all-gathers and reduce-scatters of every FSDP module in ``module``
        (FSDP2's default collectives, wrapped). Before the first forward."""
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.set_custom_all_gather(_TimedAllGather(self))
                sub.set_custom_reduce_scatter(_TimedReduceScatter(self))

    def attach_stage(self, stage: Any) -> None:
        """Count the bytes of a ``PipelineStage``'s sends and receives (the tensors of the
        P2P ops it hands the schedule)."""
        for name in ("get_fwd_send_ops", "get_fwd_recv_ops", "get_bwd_send_ops",
                     "get_bwd_recv_ops"):
            original = getattr(stage, name)

            def counted(*args: Any, _original=original, **kwargs: Any) -> list:
                ops = _original(*args, **kwargs)
                self.count_bytes("send_recv", sum(op.tensor.numel() * op.tensor.element_size()
                                                  for op in ops))
                return ops

            setattr(stage, name, counted)


class _TimedAllGather(AllGather):
    """FSDP2's default all-gather (``dist.all_gather_single`` into a fresh buffer), timed by a
    :class:`CommMeter` (``all_gather``)."""

    def __init__(self, meter: CommMeter):
        self.meter = meter

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        mark = self.meter.start()
        work = dist.all_gather_single(output_tensor, input_tensor, group=group,
                                      async_op=async_op)
        return self.meter.timed("all_gather",
                                output_tensor.numel() * output_tensor.element_size(), work, mark)


class _TimedReduceScatter(ReduceScatter):
    """FSDP2's default reduce-scatter (``dist.reduce_scatter_single``), timed by a
    :class:`CommMeter` (``reduce_scatter``)."""

    def __init__(self, meter: CommMeter):
        self.meter = meter

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        mark = self.meter.start()
        work = dist.reduce_scatter_single(output=output_tensor, input=input_tensor,
                                          group=group, op=op, async_op=async_op)
        return self.meter.timed("reduce_scatter",
                                input_tensor.numel() * input_tensor.element_size(), work, mark)
