"""A job's checkpoints: the manager that saves on a cadence, persists in the background,
keeps what retention says and resumes from the newest checkpoint that verifies.

``checkpointer`` (:class:`Checkpointer`): the one contract both managers implement (its
read half, :class:`CheckpointReader`, also :class:`ReadOnlyCheckpointer` in ``reader``).
``options``: their options objects (:class:`ManagerOptions`, :class:`LocalTierOptions`).
``manager`` (:class:`CheckpointManager`): orchestration on the training thread, staging and
resume. ``gate`` (:class:`~ckpt.job.gate.SaveGate`): the one save decision, agreed by every
rank. ``persist``: the background half of a save (write, commit, retry). ``retention``:
which committed checkpoints to keep. ``tiers`` (:class:`TieredCheckpointManager`): a fast
local tier per node under the durable one. Internals: ``_claim`` (a manager's claim on its
root: lease, cleanup, failure history), ``_commits`` (what a manager knows of its commits,
the bookkeeping after each), ``_inflight`` (the staged copy a save persists, the one
background slot), ``_tier_layout`` (where local checkpoints live), ``_copies`` (each
node's local checkpoints copied to the next node, and fetched back at a resume), ``_copy``
(one committed version sent to a neighbouring node and committed there).
"""

from ckpt.job.checkpointer import Checkpointer, CheckpointReader, ResumeInfo
from ckpt.job.manager import CheckpointManager
from ckpt.job.options import LocalTierOptions, ManagerOptions
from ckpt.job.retention import (
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepPinned,
    read_pins,
    read_retention,
    set_pinned,
)
from ckpt.job.reader import ReadOnlyCheckpointer
from ckpt.job.tiers import TieredCheckpointManager, node_local_root

__all__ = [
    "Checkpointer", "CheckpointReader", "ResumeInfo", "CheckpointManager",
    "TieredCheckpointManager", "ReadOnlyCheckpointer", "ManagerOptions", "LocalTierOptions",
    "node_local_root", "KeepLast", "KeepEvery", "KeepPinned", "KeepAll", "KeepBest", "read_pins",
    "set_pinned", "read_retention",
]
