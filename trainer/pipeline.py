"""Pipeline parallelism on the ``pp`` mesh axis: which layers each stage holds, and schedules.

Stage layout: with ``pp`` ranks and ``v = stages_per_rank`` there are ``S = pp * v``
stages; pp rank ``r`` holds stages ``r, r + pp, r + 2 pp, ...`` (the "loop" placement
that ``ScheduleInterleaved1F1B`` expects). Layers are cut into ``S`` contiguous runs as
evenly as possible, earlier stages taking the remainder (``split_layers``). Stage 0 also
holds the token embedding; stage ``S - 1`` holds the final norm and the output projection.

Contract for running a schedule (see ``run_schedule``): every rank of the pp group calls
``schedule.step`` once per training step with the same number of micro-batches; only the
rank holding stage 0 passes the input ids and only the rank holding stage ``S - 1``
passes the targets and receives per-micro-batch losses.

``torch.distributed.pipelining`` is imported only when a pipeline is built: it brings in
TorchDynamo, about 0.4 s of CPU at every start of a rank that has no pipeline.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from trainer.config import ModelConfig
from trainer.model import Transformer

__all__ = [
    "split_layers",
    "stage_ids_for_rank",
    "build_stage_modules",
    "build_pipeline_stages",
    "build_schedule",
    "run_schedule",
]


def split_layers(n_layers: int, num_stages: int) -> list[list[int]]:
    """Global layer indices of each stage: contiguous, sizes differ by at most one.

    >>> split_layers(5, 2)
    [[0, 1, 2], [3, 4]]
    """
    if not 1 <= num_stages <= n_layers:
        raise ValueError(
            f"cannot split {n_layers} layers into {num_stages} pipeline stages; "
            "every stage needs at least one layer"
        )
    base, extra = divmod(n_layers, num_stages)
    out, start = [], 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def stage_ids_for_rank(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """Stages held by pp rank ``pp_rank`` (loop placement: ``r, r + pp, ...``)."""
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def build_stage_modules(
    model_cfg: ModelConfig,
    pp_rank: int,
    pp: int,
    stages_per_rank: int,
    device: torch.device | str = "meta",
) -> list[tuple[int, nn.Module]]:
    """Build this pp rank's stage modules, un-initialised, as ``[(stage_id, module), ...]``.

    Called independently on each rank (no communication). Modules are created on
    ``device`` (default meta: materialise with ``to_empty`` after parallelizing, then call
    ``init_weights``).
    """
    num_stages = pp * stages_per_rank
    layers = split_layers(model_cfg.n_layers, num_stages)
    out = []
    for stage_id in stage_ids_for_rank(pp_rank, pp, stages_per_rank):
        with torch.device(device):
            module = Transformer(
                model_cfg,
                layer_ids=layers[stage_id],
                has_embedding=stage_id == 0,
                has_output=stage_id == num_stages - 1,
            )
        out.append((stage_id, module))
    return out


def build_pipeline_stages(
    modules: Sequence[tuple[int, nn.Module]],
    num_stages: int,
    device: torch.device,
    pp_group,
):
    """Wrap already-parallelized stage modules in ``PipelineStage`` objects.

    Shapes are inferred on the first ``step`` (dynamic metadata inference), so the same
    stages work for any micro-batch size. ``modules`` may be FSDP2 modules or DDP
    wrappers; ``PipelineStage`` syncs their gradients once per step, not per micro-batch.
    """
    from torch.distributed.pipelining import PipelineStage

    return [
        PipelineStage(module, stage_id, num_stages, device, group=pp_group)
        for stage_id, module in modules
    ]


def build_schedule(
    stages: list,
    schedule: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    """The schedule object for ``schedule`` in ``("gpipe", "1f1b", "interleaved1f1b")``.

    ``scale_grads=False``: ``loss_fn`` already divides by the number of micro-batches (and
    of accumulation steps), because the schedule's own scaling divides the *accumulated*
    gradient and would break gradient accumulation across several ``step`` calls.
    """
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    name = schedule.lower()
    if name == "interleaved1f1b":
        return ScheduleInterleaved1F1B(
            stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False
        )
    single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}.get(name)
    if single is None:
        raise ValueError(
            f"parallel.schedule must be 'gpipe', '1f1b' or 'interleaved1f1b', got {schedule!r}"
        )
    if len(stages) != 1:
        raise ValueError(
            f"schedule {schedule!r} runs one stage per rank, got {len(stages)}; "
            "use 'interleaved1f1b' for parallel.stages_per_rank > 1"
        )
    return single(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


def run_schedule(schedule, stages: list, inputs: torch.Tensor, targets: torch.Tensor) -> list:
    """Run one forward+backward over all micro-batches; return this rank's micro-batch losses.

    Every pp rank calls this with its (identical) local batch; the list is empty on ranks
    that do not hold the last stage.
    """
    is_first = any(stage.is_first for stage in stages)
    is_last = any(stage.is_last for stage in stages)
    losses: list = []
    args = (inputs,) if is_first else ()
    if is_last:
        schedule.step(*args, target=targets, losses=losses, return_outputs=False)
    else:
        schedule.step(*args, return_outputs=False)
    return losses
