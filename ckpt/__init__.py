"""ckpt: a sharded, verifiable checkpoint store for PyTorch training jobs."""

__version__ = "0.1.0"

from ckpt.api import load, load_latest, save  # noqa: E402
from ckpt.attachments import list_attachments, read_attachment  # noqa: E402
from ckpt.distributed import init_distributed  # noqa: E402
from ckpt.errors import (  # noqa: E402
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
from ckpt.manifest import Manifest  # noqa: E402
from ckpt.storage import Storage  # noqa: E402
from ckpt.store import CheckpointInfo, CheckpointStore  # noqa: E402

__all__ = [
    "__version__",
    "save",
    "load",
    "load_latest",
    "read_attachment",
    "list_attachments",
    "init_distributed",
    "Storage",
    "CheckpointStore",
    "CheckpointInfo",
    "Manifest",
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
