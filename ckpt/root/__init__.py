"""A checkpoint root and its one writer: the lease, the fence, the life-cycle, the store.

``lease`` (:class:`Lease`): one writer per root, with a heartbeat and a generation.
``fence``: which manifests count once the lease has changed hands. ``lifecycle``
(:class:`Lifecycle`): every transition of a checkpoint folder (begin, commit, abandon,
cleanup, uncommit, restore, delete) and every file name in it, made by the lease holder.
``lineage``: the run log and the rule saying which versions belong to the current
trajectory (:class:`Trajectory`). ``store`` (:class:`CheckpointStore`): the read side: list, read, verify, and
(:func:`walk_newest`) the one walk to the newest checkpoint that verifies, which every
resume uses. ``parts``: reading a version's parts (a loading rank's few, or all of them).
``verify`` (:func:`verify_checkpoint`): the one definition of a good checkpoint.
"""

from ckpt.root.fence import Fence
from ckpt.root.lease import (
    DEFAULT_LEASE_TTL_SECONDS,
    Lease,
    acquire_for_ranks,
    acquire_lease,
    read_lease,
    release_lease,
)
from ckpt.root.lifecycle import (
    COMMITTED,
    CORRUPT,
    FENCED,
    INCOMPLETE,
    ROLLED_BACK,
    Lifecycle,
)
from ckpt.root.lineage import LINEAGE_NAME, Trajectory, read_runs, record_run
from ckpt.root.parts import complete_parts, parts_for_rank
from ckpt.root.store import Candidate, CheckpointInfo, CheckpointStore, walk_newest

__all__ = [
    "Lease", "read_lease", "DEFAULT_LEASE_TTL_SECONDS", "Fence", "Lifecycle", "COMMITTED",
    "INCOMPLETE", "CORRUPT", "ROLLED_BACK", "FENCED", "acquire_lease", "acquire_for_ranks",
    "release_lease", "CheckpointStore", "CheckpointInfo", "Candidate", "walk_newest",
    "parts_for_rank", "complete_parts", "LINEAGE_NAME", "Trajectory", "read_runs", "record_run",
]
