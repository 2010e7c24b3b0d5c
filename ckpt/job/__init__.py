"""A job's checkpoints: the manager that saves on a cadence, persists in the background,
keeps what retention says and resumes from the newest checkpoint that verifies.

``manager`` (:class:`CheckpointManager`): orchestration on the training thread. ``gate``
(:class:`SaveGate`): whether a save is due and may start, agreed by every rank.
``persist``: the background half of a save (write, commit, retry). ``retention``: which
committed checkpoints to keep. ``tiers`` (:class:`TieredCheckpointManager`): a fast local
tier per node under the durable one (``_tier_layout``: where local checkpoints live).
"""

from ckpt.job.manager import CheckpointManager
from ckpt.job.retention import (
    PINS_NAME,
    KeepAll,
    KeepEvery,
    KeepLast,
    KeepPinned,
    RetentionPolicy,
    apply_retention,
    read_pins,
    set_pinned,
)
from ckpt.job.tiers import DEFAULT_LOCAL_KEEP, TieredCheckpointManager, node_local_root

__all__ = [
    "CheckpointManager", "TieredCheckpointManager", "node_local_root", "DEFAULT_LOCAL_KEEP",
    "RetentionPolicy", "KeepLast", "KeepEvery", "KeepPinned", "KeepAll", "apply_retention",
    "PINS_NAME", "read_pins", "set_pinned",
]
