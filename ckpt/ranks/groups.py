"""The process groups the store's collectives run on, and how they are freed.

Rule: every collective of the store (its agreements, ``ckpt.ranks.agreement``: numbers in
tensors, JSON text in tensors; DCP's gathers and broadcasts of plans and results) runs on a gloo
group the store owns, or on the group the caller passes. Never on the default group, for
two reasons: under NCCL (the trainer's default group on GPU) it has no CPU backend, and a
collective on CPU tensors raises "No backend type associated with device type cpu"; and the
default group is the training loop's, whose collectives the store's must not interleave with.

Which group, for which caller:

==============================================  ==============================================
caller                                          group
==============================================  ==============================================
``ckpt.save``/``load``/``load_latest``,         :func:`world_group`: one gloo group over the
``process_group`` None (or the default group)   world per default group, made at the first
                                                such call, reused by the later ones
the same, ``process_group`` with a CPU backend  that group
the same, ``process_group`` without one (NCCL)  :func:`world_group` when it spans the whole
                                                world in rank order; otherwise ``ValueError``
``CheckpointManager``                           two private gloo groups
                                                (:func:`private_groups`); with a subgroup,
                                                :func:`world_group` for the one all-gather
                                                that makes them
``TieredCheckpointManager``                     a gloo group over the job, node groups, and
                                                each tier's manager's groups
==============================================  ==============================================

A subgroup without a CPU backend is refused rather than given a gloo twin: ``ckpt.save``
is collective over the subgroup only, and a group made by its members alone
(``use_local_synchronization``) is named after how many groups each member holds, which
need not agree; a mismatch hangs. Pass a gloo group over the same ranks instead
(``dist.new_group(ranks, backend="gloo")``, every rank of the world, once).

Freeing a gloo group means destroying it *and* dropping every reference to it: its worker
threads stop only when the last reference goes. A group still alive at the interpreter's
teardown can abort the process ("terminate called without an active exception"): a worker
thread that releases a finished collective's tensors then needs the interpreter. So every
owner of groups (``CheckpointManager``, ``TieredCheckpointManager``, the world group here)
registers its freeing method with :func:`free_at_exit`, which calls it at exit if the owner
was never closed.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Any, Callable, Iterable

import torch.distributed as dist

from ckpt.ranks.agreement import Agreement
from ckpt.ranks.torchrun import warn_if_not_attempt_scoped

__all__ = ["world_group", "cpu_group", "has_cpu_backend", "private_groups",
           "free_at_exit", "freed", "free_all_at_exit", "destroy_groups"]

log = logging.getLogger(__name__)


# The owners whose groups are not freed yet, each with its freeing method's function (the
# owner held weakly: a dropped owner's groups went with it).
_owners: "weakref.WeakKeyDictionary[Any, Callable[[Any], None]]" = weakref.WeakKeyDictionary()


def free_at_exit(free: Callable[[], None]) -> None:
    """Call ``free`` (a bound method of the owner of groups, e.g. a manager's private
    ``_free_groups``: destroy them and drop every reference, idempotent) at interpreter exit
    unless :func:`freed` came first. The owner is held weakly."""
    _owners[free.__self__] = free.__func__


def freed(owner: Any) -> None:
    """``owner`` freed its groups: nothing to do at exit."""
    _owners.pop(owner, None)


@atexit.register
def free_all_at_exit() -> None:
    """Free the groups of every owner not closed (run by the interpreter at exit)."""
    for owner, free in list(_owners.items()):
        free(owner)


def destroy_groups(groups: Iterable[Any]) -> None:
    """Destroy each group that is not None (best effort: a failure is only a leak)."""
    for group in groups:
        try:
            if group is not None and dist.is_initialized():
                dist.destroy_process_group(group)
        except Exception as exc:  # noqa: BLE001 - only a leak
            log.debug("could not destroy a checkpoint process group: %s", exc)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class _WorldGroup:
    """The store's gloo group over the world of one default group (held weakly: a strong
    reference would keep a destroyed default group's threads alive until teardown)."""

    def __init__(self) -> None:
        self._default = weakref.ref(dist.group.WORLD)
        self.group = dist.new_group(backend="gloo", group_desc="ckpt_world")
        free_at_exit(self.free_groups)

    def current(self) -> bool:
        """Whether it belongs to the current default group and was not freed."""
        return self.group is not None and _distributed() and \
            self._default() is dist.group.WORLD

    def free_groups(self) -> None:
        group, self.group = self.group, None
        freed(self)
        if group is not None and self._default() is dist.group.WORLD:
            destroy_groups([group])
        # else: destroying its default group destroyed it; dropping it is all that is left


_store_world: _WorldGroup | None = None


def world_group():
    """The store's gloo group over the whole world (None without a default group).

    Collective the first time for each default group (it is made then, with
    ``dist.new_group``): every rank of the world calls it at the same point, e.g. inside a
    call that is collective over the world (``ckpt.save`` without a process group). Later
    calls return the same group without communicating, until the default group is
    destroyed; a new default group gets a new one. Freed at exit (see the module)."""
    global _store_world
    if not _distributed():
        return None
    if _store_world is None or not _store_world.current():
        if _store_world is not None:
            _store_world.free_groups()
        _store_world = _WorldGroup()
    return _store_world.group


def has_cpu_backend(group) -> bool:
    """Whether ``group`` runs collectives on CPU tensors (gloo does; NCCL does not)."""
    config = dist.get_backend_config(group)  # e.g. "cpu:gloo,cuda:nccl" or "cuda:nccl"
    return any(part.split(":", 1)[0].strip() == "cpu" for part in config.split(","))


def cpu_group(process_group=None):
    """The group the store's collectives over the ranks of ``process_group`` run on (None
    without a default group): :func:`world_group` for None or the default group; the group
    itself when it has a CPU backend; :func:`world_group` for a group without one that is
    the whole world in rank order (a mesh's NCCL group over every rank). Raises
    ``ValueError`` for a subgroup without a CPU backend (the module says why).

    Collective the first time it returns the world group (see :func:`world_group`):
    call it where every rank of ``process_group`` is, in the same order."""
    if not _distributed():
        return None
    if process_group is None or process_group is dist.group.WORLD:
        return world_group()
    if has_cpu_backend(process_group):
        return process_group
    ranks = dist.get_process_group_ranks(process_group)
    if ranks == list(range(dist.get_world_size())):
        return world_group()
    raise ValueError(
        f"process_group over ranks {ranks} has no CPU backend "
        f"({dist.get_backend_config(process_group)}), and the store's collectives run on CPU "
        f"tensors: pass a gloo group over the same ranks (dist.new_group(ranks, "
        f"backend='gloo'), made once by every rank of the job), or None for the whole job")


def private_groups(process_group, distributed: bool) -> tuple[Any, Any]:
    """Two new gloo groups over the ranks of ``process_group`` (None: the world); (None,
    None) when not ``distributed``. ``process_group`` may have any backend (NCCL too): only
    its ranks are used.

    They live in the default group's key space: per torchrun attempt when it was started by
    ``ckpt.init_distributed`` (``ckpt.ranks.torchrun`` says why that matters). With a subgroup,
    every rank of the world must construct its manager at the same time (each with the
    group it belongs to): the groups of all members are learned with one all-gather over
    the store's world group (:func:`world_group`, made then if it was not yet) and
    created together (``new_subgroups_by_enumeration``)."""
    if not distributed:
        return None, None
    warn_if_not_attempt_scoped()
    if process_group is None:
        return (dist.new_group(backend="gloo", group_desc="ckpt_control"),
                dist.new_group(backend="gloo", group_desc="ckpt_persist"))
    leaders = Agreement(world_group()).all_gather(
        min(dist.get_process_group_ranks(process_group)))
    partition: dict[int, list[int]] = {}
    for rank, leader in enumerate(int(t) for t in leaders):
        partition.setdefault(leader, []).append(rank)
    groups = [sorted(ranks) for _, ranks in sorted(partition.items())]
    ctl, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")
    bg, _ = dist.new_subgroups_by_enumeration(groups, backend="gloo")
    return ctl, bg
