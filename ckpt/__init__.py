"""ckpt: a sharded, verifiable checkpoint store for PyTorch training jobs.

The modules by concern. Imports go one way: at import time a module imports only modules
of its own group or of the groups above it (tests/ckpt/test_layers.py checks it).

- **format**, what lies on storage: ``manifest`` (``manifest_schema`` records and names,
  ``manifest_check`` digest and validation of untrusted documents), ``jsonio`` (strict,
  bounded JSON), ``codec`` (non-tensor values), ``errors``, ``_crc``;
- **storage**: ``storage`` (one interface, ``_retry``), ``backends`` (``local``, ``s3``);
- **a root and its one writer**: ``lease``, ``fence``, ``commit`` (a checkpoint folder's
  whole life-cycle: begin, commit, abandon, cleanup, rollback, restore, delete), ``store``
  (``CheckpointStore``: list, verify, read);
- **bytes through DCP**: ``api`` (``save``/``load``/``load_latest``), ``planners``,
  ``dcp_io`` (``dcp_writer``, ``dcp_reader``, ``dcp_layout``), ``stateful``, ``staging``
  (``host_arena``), ``attachments``, ``agreement`` (ranks deciding together), ``groups``
  (the gloo groups the store's collectives run on, never the default group; freed at
  exit), ``savecost``;
- **how often**: ``cadence`` (policies), ``interval``, ``units``, ``young_daly``, ``plan``
  (``ckpt plan``), ``bandwidth``, ``simulate``;
- **a job's checkpoints**: ``manager`` (``CheckpointManager``, orchestration; its units
  ``savestep``, ``inflight``, ``persist``, ``manager_commit``, ``manager_groups``,
  ``manager_lease``, ``manager_load``, ``manager_staging``, ``steptime``, ``history``,
  ``retention``, ``events``), ``tiers`` (a local tier under the durable one:
  ``tier_layout``, ``tier_resume``), ``distributed`` (``init_distributed``);
- **operator tools**: ``inspect``, ``export`` (``export_select``, ``export_files``,
  ``export_hf``), ``cli`` (``cli_read``, ``cli_admin``, ``cli_common``, ``cli_errors``),
  ``__main__``.

The package stays flat: every module path above is importable as it is
(``ckpt.manager``, ``ckpt.store``, ...), and the documentation and users' code name them.
"""

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
