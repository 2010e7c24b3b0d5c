"""The two private gloo groups of a checkpoint manager: created together, freed together.

One group is for the main thread's agreements, the other for the background persist (DCP's
collectives); never the training loop's group from a background thread.

Freeing a gloo group means destroying it *and* dropping every reference to it: its worker
threads stop only when the last reference goes. A group still alive at the interpreter's
teardown can abort the process ("terminate called without an active exception"): a worker
thread that releases a finished collective's tensors then needs the interpreter. So an
owner of groups (``CheckpointManager``, ``TieredCheckpointManager``) registers with
:func:`free_at_exit` and has ``free_groups()`` called at exit if it was never closed.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Any, Iterable, Protocol

import torch
import torch.distributed as dist

from ckpt.distributed import warn_if_not_attempt_scoped

__all__ = ["private_groups", "destroy_groups", "GroupOwner", "free_at_exit", "freed",
           "free_all_at_exit"]

log = logging.getLogger(__name__)


class GroupOwner(Protocol):
    def free_groups(self) -> None:
        """Destroy the owner's groups and drop every reference to them (idempotent)."""


_owners: "weakref.WeakSet[GroupOwner]" = weakref.WeakSet()  # groups not freed yet


def free_at_exit(owner: GroupOwner) -> None:
    """Call ``owner.free_groups()`` at interpreter exit unless :func:`freed` came first."""
    _owners.add(owner)


def freed(owner: GroupOwner) -> None:
    """``owner`` freed its groups: nothing to do at exit."""
    _owners.discard(owner)


@atexit.register
def free_all_at_exit() -> None:
    """Free the groups of every owner not closed (run by the interpreter at exit)."""
    for owner in list(_owners):
        owner.free_groups()


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
