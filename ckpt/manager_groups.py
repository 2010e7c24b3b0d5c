"""The two private gloo groups of a checkpoint manager: created together, freed together.

One group is for the main thread's agreements, the other for the background persist (DCP's
collectives); never the training loop's group from a background thread, and never the
default group at all (``ckpt.groups`` states the rule). The manager frees them at
``close()``, or at exit through :func:`ckpt.groups.free_at_exit` (which says why both
destroying and dropping them matter).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ckpt.distributed import warn_if_not_attempt_scoped
from ckpt.groups import world_group

__all__ = ["private_groups"]


def private_groups(process_group, distributed: bool) -> tuple[Any, Any]:
    """Two new gloo groups over the ranks of ``process_group`` (None: the world); (None,
    None) when not ``distributed``. ``process_group`` may have any backend (NCCL too): only
    its ranks are used.

    They live in the default group's key space: per torchrun attempt when it was started by
    ``ckpt.init_distributed`` (``ckpt.distributed`` says why that matters). With a subgroup,
    every rank of the world must construct its manager at the same time (each with the
    group it belongs to): the groups of all members are learned with one all-gather over
    the store's world group (``ckpt.groups.world_group``, made then if it was not yet) and
    created together (``new_subgroups_by_enumeration``)."""
    if not distributed:
        return None, None
    warn_if_not_attempt_scoped()
    if process_group is None:
        return (dist.new_group(backend="gloo", group_desc="ckpt_control"),
                dist.new_group(backend="gloo", group_desc="ckpt_persist"))
    world = dist.get_world_size()
    mine = torch.tensor([min(dist.get_process_group_ranks(process_group))], dtype=torch.int64)
    leaders = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(leaders, mine, group=world_group())
    partition: dict[int, list[int]] = {}
    for rank, leader in enumerate(int(t) for t in leaders):
        partition.setdefault(leader, []).append(rank)
    groups = [sorted(ranks) for _, ranks in sorted(partition.items())]
    ctl, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")
    bg, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")
    return ctl, bg
