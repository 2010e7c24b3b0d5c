"""Ranks: joining torchrun's process group, the groups the store talks on, deciding together.

``torchrun`` (:func:`init_distributed`): a process group whose keys are scoped per torchrun
attempt, so ``--max-restarts`` works. ``groups``: the rule that the store's collectives
never run on the default group, the gloo groups it owns instead (:func:`world_group`,
:func:`cpu_group`, a manager's :func:`private_groups`), and how they are freed at exit.
``agreement`` (:class:`Agreement`): the one way ranks decide something together. ``peer``
(:func:`swap_bytes`): bytes between two ranks, one message out while one comes in.
``launcher`` (:func:`launcher_run`): which attempt of which run this process is, as torchrun
or Slurm (:class:`SlurmJob`) tells it.
"""

from ckpt.ranks.agreement import Agreement
from ckpt.ranks.groups import cpu_group, destroy_groups, free_at_exit, freed, private_groups
from ckpt.ranks.launcher import LauncherRun, SlurmJob, launcher_run, slurm_int
from ckpt.ranks.peer import CHUNK_BYTES, swap_bytes
from ckpt.ranks.torchrun import init_distributed

__all__ = [
    "init_distributed", "Agreement", "cpu_group", "private_groups", "free_at_exit", "freed",
    "destroy_groups", "swap_bytes", "CHUNK_BYTES", "LauncherRun", "SlurmJob", "launcher_run",
    "slurm_int",
]
