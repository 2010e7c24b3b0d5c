"""Fault tolerance across replica groups, on torchft: a group dies, the others train on.

Turned on by ``[fault_tolerance] enabled = true`` (docs/trainer.md, "Fault-tolerant replica
groups"). The job's ``parallel.dp_replicate`` replicas become torchft replica groups, each
its own torchrun job; a lighthouse holds the quorum; the durable store stays the floor.

Modules:

- ``lighthouse``: run one (``python -m trainer lighthouse``), check it answers, watch it;
- ``replicas``: one group's side of torchft: quorum, cross-group average, commit
  (imports torchft, the optional ``ft`` extra, so the trainer imports it only when fault
  tolerance is on; so does ``transport``);
- ``state``: what a rejoining group receives (this rank's share of the replica), digests;
- ``wire`` and ``transport``: that state as bytes (JSON and raw tensors, no pickle) over HTTP;
- ``writer``: which group writes durable checkpoints (the holder of the store's lease);
- ``local``: every group and a lighthouse on one machine (``python -m trainer ft-local``).
"""

from trainer.ft.lighthouse import LighthouseUnreachable, check_reachable, serve
from trainer.ft.state import ReplicaMismatchError, ReplicaState
from trainer.ft.writer import WriterRole

__all__ = ["LighthouseUnreachable", "check_reachable", "serve", "ReplicaState",
           "ReplicaMismatchError", "WriterRole"]
