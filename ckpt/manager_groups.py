"""The two private gloo groups of a checkpoint manager: created together, freed together.

One group is for the main thread's agreements, the other for the background persist (DCP's
collectives); never the training loop's group from a background thread. Freeing them is the
manager's job (``CheckpointManager._destroy_groups``, also at interpreter exit).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
import torch.distributed as dist

from ckpt.distributed import warn_if_not_attempt_scoped

__all__ = ["private_groups", "destroy_groups"]

log = logging.getLogger(__name__)


def private_groups(process_group, distributed: bool) -> tuple[Any, Any]:
    """Two new gloo groups over the ranks of ``process_group`` (None: the world); (None,
    None) when not ``distributed``.

    They live in the default group's key space: per torchrun attempt when it was started by
    ``ckpt.init_distributed`` (``ckpt.distributed`` says why that matters). With a subgroup,
    every rank of the world must construct its manager at the same time (each with the
    group it belongs to): the groups of all members are learned with one all-gather over the
    world and created together (``new_subgroups_by_enumeration``)."""
    if not distributed:
        return None, None
    warn_if_not_attempt_scoped()
    if process_group is None:
        return (dist.new_group(backend="gloo", group_desc="ckpt_control"),
                dist.new_group(backend="gloo", group_desc="ckpt_persist"))
    world = dist.get_world_size()
    mine = torch.tensor([min(dist.get_process_group_ranks(process_group))], dtype=torch.int64)
    leaders = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(leaders, mine)
    partition: dict[int, list[int]] = {}
    for rank, leader in enumerate(int(t) for t in leaders):
        partition.setdefault(leader, []).append(rank)
    groups = [sorted(ranks) for _, ranks in sorted(partition.items())]
    ctl, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")
    bg, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")
    return ctl, bg


def destroy_groups(groups: Iterable[Any]) -> None:
    """Destroy each group that is not None (best effort: a failure is only a leak)."""
    for group in groups:
        try:
            if group is not None and dist.is_initialized():
                dist.destroy_process_group(group)
        except Exception as exc:  # noqa: BLE001 - only a leak
            log.debug("could not destroy a checkpoint process group: %s", exc)
