"""Our StorageWriter and StorageReader for torch.distributed.checkpoint.

DCP's planners (:mod:`ckpt.planners`) decide *what* each rank saves and loads; these classes
decide *where* the bytes go, and keep the manifest, commit and checksums ours. DCP's own
``.metadata`` file is a pickle; ours is the JSON manifest (:mod:`ckpt.manifest`).

This module only gathers the pieces under the names callers import:

- :mod:`ckpt.dcp_writer`: ``CkptWriter`` (data files, per-item checksums, the commit);
- :mod:`ckpt.dcp_reader`: ``CkptReader`` (transactional, verified reads), ``VERIFY_MODES``;
- :mod:`ckpt.dcp_layout`: how tensors become a data file's bytes and back,
  ``default_threads``.

Call order (DCP's contract): every rank ``set_up_storage_writer`` -> ``prepare_local_plan``;
the coordinator ``prepare_global_plan`` (here it also begins the attempt through
:mod:`ckpt.commit`: refuses a committed step, writes the attempt's marker before any data
exists); every rank ``write_data``; the coordinator ``finish`` (commits the manifest through
:mod:`ckpt.commit`, which fences off a writer that lost the lease). Loads: every rank
``read_data`` (stages and verifies), then ``apply`` once every rank succeeded.
"""

from __future__ import annotations

from ckpt.dcp_layout import default_threads
from ckpt.dcp_reader import VERIFY_MODES, CkptReader
from ckpt.dcp_writer import CkptWriter

__all__ = ["CkptWriter", "CkptReader", "VERIFY_MODES", "default_threads"]
