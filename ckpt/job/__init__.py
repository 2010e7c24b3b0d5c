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
from ckpt.job.options import DEFAULT_LOCAL_KEEP, LocalTierOptions, ManagerOptions
from ckpt.job.retention import (
    PINS_NAME,
    RETENTION_NAME,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepPinned,
    RetentionPolicy,
    apply_retention,
    read_pins,
    read_retention,
    record_retention,
    set_pinned,
)
from ckpt.job.reader import ReadOnlyCheckpointer
from ckpt.job.tiers import TieredCheckpointManager, node_local_root

__all__ = [
    "Checkpointer", "CheckpointReader", "ResumeInfo", "CheckpointManager",
    "TieredCheckpointManager", "ReadOnlyCheckpointer", "ManagerOptions", "LocalTierOptions",
    "node_local_root", "DEFAULT_LOCAL_KEEP",
    "RetentionPolicy", "KeepLast", "KeepEvery", "KeepPinned", "KeepAll", "KeepBest",
    "apply_retention", "PINS_NAME", "read_pins", "set_pinned", "RETENTION_NAME",
    "record_retention", "read_retention",
]
