"""A checkpointer that only reads: resume from a root another job (or replica group) writes.

:class:`ReadOnlyCheckpointer` implements :class:`~ckpt.job.checkpointer.CheckpointReader`
as the managers do, and changes nothing under the root: no lease, no run recorded, nothing
un-committed. A standby replica group of a fault-tolerant job loads the writing group's
checkpoints with it (``trainer.train``).
"""

from __future__ import annotations

from typing import Any, Callable

from ckpt.dcp import api
from ckpt.format import Manifest
from ckpt.job.checkpointer import CheckpointReader, ResumeInfo
from ckpt.job.options import ManagerOptions
from ckpt.root import CheckpointStore
from ckpt.storage import Storage

__all__ = ["ReadOnlyCheckpointer"]


class ReadOnlyCheckpointer(CheckpointReader):
    """Load a root's checkpoints without writing to it.

    ``options``: only ``verify``, ``num_threads`` and ``storage_options`` are used.
    ``process_group``: the ranks that load together (collective over it, as ``ckpt.load``;
    default: the world).
    """

    def __init__(self, root: str | Storage, options: ManagerOptions | None = None, *,
                 process_group=None):
        self.options = options or ManagerOptions()
        self.storage = root if isinstance(root, Storage) else Storage(
            root, dict(self.options.storage_options) if self.options.storage_options else None)
        self.store = CheckpointStore(self.storage)
        self.process_group = process_group
        self._resumed: ResumeInfo | None = None

    @property
    def resumed(self) -> ResumeInfo | None:
        return self._resumed

    def load_latest(self, state: dict[str, Any], *, step: int | None = None,
                    strict: bool = True, ignore_keys: tuple[str, ...] = (),
                    raise_if_all_damaged: bool = False,
                    extra_state: Callable[[Manifest], dict[str, Any]] | None = None
                    ) -> Manifest | None:
        """As :meth:`CheckpointReader.load_latest`; nothing under the root changes."""
        options = dict(verify=self.options.verify, strict=strict, ignore_keys=ignore_keys,
                       num_threads=self.options.num_threads,
                       process_group=self.process_group)
        if step is not None:
            manifest = api.load_with_extra(state, self.storage, self.store.read_manifest(step),
                                           extra_state, **options)
        else:
            manifest = api.load_latest(state, self.storage, extra_state=extra_state,
                                       raise_if_all_damaged=raise_if_all_damaged, **options)
        self._resumed = None if manifest is None else ResumeInfo(
            manifest.step, "durable", self.storage.url)
        return manifest

    def all_steps(self) -> list[int]:
        return self.store.committed_steps()

    def close(self, *, flush: bool = True) -> None:
        """Nothing is held."""
