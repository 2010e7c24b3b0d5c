"""Ranks: joining torchrun's process group, the groups the store talks on, deciding together.

``torchrun`` (:func:`init_distributed`): a process group whose keys are scoped per torchrun
attempt, so ``--max-restarts`` works. ``groups``: the rule that the store's collectives
never run on the default group, the gloo groups it owns instead (:func:`world_group`,
:func:`cpu_group`, a manager's :func:`private_groups`), and how they are freed at exit.
``agreement`` (:class:`Agreement`): the one way ranks decide something together. ``peer``
(:func:`swap_bytes`): bytes between two ranks, one message out while one comes in.
"""

from ckpt.ranks.agreement import Agreement
from ckpt.ranks.groups import (
    GroupOwner,
    cpu_group,
    destroy_groups,
    free_all_at_exit,
    free_at_exit,
    freed,
    has_cpu_backend,
    private_groups,
    world_group,
)
from ckpt.ranks.peer import CHUNK_BYTES, swap_bytes
from ckpt.ranks.torchrun import init_distributed, is_attempt_scoped

__all__ = [
    "init_distributed", "is_attempt_scoped", "Agreement",
    "world_group", "cpu_group", "has_cpu_backend", "private_groups",
    "GroupOwner", "free_at_exit", "freed", "free_all_at_exit", "destroy_groups",
    "swap_bytes", "CHUNK_BYTES",
]
