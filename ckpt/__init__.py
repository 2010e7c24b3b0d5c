"""ckpt: a sharded, verifiable checkpoint store for PyTorch training jobs.

The packages, bottom up: each imports only from those before it (and the three modules at
the top level), never from one after it (tests/ckpt/test_layers.py checks the real import
graph, function-level imports included).

- ``errors``, ``events``, ``units``: what every package may use;
- ``format``: what lies on storage: the manifest (the commit), strict JSON, values, CRC32C;
- ``storage``: one interface over fsspec, retries, and everything that knows a backend;
- ``ranks``: torchrun's process group, the gloo groups the store talks on, agreements, which
  attempt of which run (torchrun's or Slurm's) this process is;
- ``root``: a root and its one writer: lease, fence, the folder life-cycle, the store;
- ``cadence``: how often to save: policies, Young/Daly, failure history, ``ckpt plan``;
- ``dcp``: bytes through torch.distributed.checkpoint: save/load, planners, writer and
  reader, host staging, stateful adapters, attachments;
- ``job``: a job's checkpoints: the manager, its save gate, the background persist,
  retention, the two-tier manager;
- ``export``: a checkpoint as full tensors (``.pt``, ``.safetensors``, Hugging Face);
- ``hf``: a Hugging Face folder's weights into a model of any layout (``load_hf``);
- ``cli``: the ``ckpt`` command and its read-only inspection.

A save is planned in ``dcp`` (planners), written in ``dcp`` (writer) and committed in
``root`` (lifecycle); a job decides when in ``job`` (gate) with ``cadence``; a resume finds
its checkpoint through ``root`` (store) and loads it through ``dcp`` (reader).

This module is the public API: what users import, and what the documentation names.
"""

from ckpt._version import __version__
from ckpt.cadence import parse_interval
from ckpt.dcp import (
    ModelState,
    PerRankState,
    RNGState,
    list_attachments,
    load,
    load_latest,
    rank_key,
    read_attachment,
    save,
)
from ckpt.errors import (
    AllCheckpointsDamagedError,
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    LeaseHeldError,
    LeaseLostError,
    RankFailuresError,
    StateMismatchError,
    StorageUnavailableError,
)
from ckpt.events import Event, EventBus, JsonlEventLog
from ckpt.format import Manifest
from ckpt.hf import HFLoadReport, load_hf
from ckpt.job import (
    CheckpointManager,
    Checkpointer,
    CheckpointReader,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepPinned,
    LocalTierOptions,
    ManagerOptions,
    ReadOnlyCheckpointer,
    ResumeInfo,
    TieredCheckpointManager,
)
from ckpt.ranks import init_distributed
from ckpt.root import CheckpointInfo, CheckpointStore
from ckpt.storage import Storage

__all__ = [
    "__version__",
    # saving and loading
    "save",
    "load",
    "load_latest",
    "read_attachment",
    "list_attachments",
    "load_hf",
    "HFLoadReport",
    "init_distributed",
    # a job's checkpoints
    "Checkpointer",
    "CheckpointReader",
    "ResumeInfo",
    "CheckpointManager",
    "ManagerOptions",
    "TieredCheckpointManager",
    "LocalTierOptions",
    "ReadOnlyCheckpointer",
    "parse_interval",
    "KeepLast",
    "KeepEvery",
    "KeepPinned",
    "KeepAll",
    "KeepBest",
    "Event",
    "EventBus",
    "JsonlEventLog",
    # what to save
    "ModelState",
    "RNGState",
    "PerRankState",
    "rank_key",
    # a root
    "Storage",
    "CheckpointStore",
    "CheckpointInfo",
    "Manifest",
    # errors
    "CheckpointError",
    "AllCheckpointsDamagedError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "FormatVersionError",
    "LeaseHeldError",
    "LeaseLostError",
    "RankFailuresError",
    "StateMismatchError",
    "StorageUnavailableError",
]
