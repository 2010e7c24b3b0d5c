"""Discovery, verification and deletion of the checkpoints under one root (the read side).

A root holds one folder per step, ``step_NNNNNNNNN/``. A step is *committed* when its
manifest exists, parses, describes that step and was not fenced off; *incomplete* when it
has no manifest (a save in flight, or the leftovers of one that died); *rolled-back* when
its manifest was un-committed (kept, restorable); *fenced* when its manifest was created by
a writer that had lost the lease; *corrupt* when the manifest is unreadable or its files
fail verification. The life-cycle itself (every transition, every file name) lives in
:mod:`ckpt.root.lifecycle`.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Callable

from ckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ckpt.format import Manifest, step_dirname
from ckpt.root.lifecycle import (
    COMMITTED,
    CORRUPT,
    FENCED,
    INCOMPLETE,
    ROLLED_BACK,
    Entry,
    Lifecycle,
)
from ckpt.root.verify import verify_files
from ckpt.storage import Storage

__all__ = ["CheckpointInfo", "CheckpointStore"]

log = logging.getLogger(__name__)

@dataclass
class CheckpointInfo:
    """One checkpoint (one version of one step) as an operator sees it."""

    step: int
    status: str
    url: str
    bytes: int
    created: float | None = None
    save_id: str | None = None
    owner: str | None = None
    problem: str | None = None
    user_metadata: dict[str, Any] | None = None

    @property
    def id(self) -> str | None:
        return self.save_id

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "id": self.save_id}


def _info(store: "CheckpointStore", e: Entry) -> CheckpointInfo:
    url = store.storage.describe(step_dirname(e.step))
    m = e.manifest
    if m is not None:
        return CheckpointInfo(e.step, e.status, url, m.total_bytes, m.created_unix, m.save_id,
                              m.writer.get("owner"), e.problem, m.user_metadata)
    owner = (e.marker or {}).get("owner")
    created = (e.marker or {}).get("started_unix")
    return CheckpointInfo(e.step, e.status, url, e.bytes,
                          created if isinstance(created, (int, float)) else None, e.id,
                          owner if isinstance(owner, str) else None, e.problem)


class CheckpointStore:
    """Read-side view of a checkpoint root. Safe to use from any one process.

    ``delete`` and ``uncommit`` go through the root's :class:`~ckpt.root.lifecycle.Lifecycle`;
    a job's manager gives the store its own (the one holding the write lease).
    """

    def __init__(self, root: str | Storage, storage_options: dict[str, Any] | None = None,
                 *, lifecycle: Lifecycle | None = None):
        self.storage = root if isinstance(root, Storage) else Storage(root, storage_options)
        self.life = lifecycle or Lifecycle(self.storage)

    # -- listing ---------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Every step that has a folder, committed or not, ascending."""
        return self.life.steps()

    def read_manifest(self, step: int) -> Manifest:
        """The committed manifest of ``step`` (``CheckpointNotFoundError`` when there is
        none or it was fenced off, ``CorruptCheckpointError`` when it is damaged)."""
        return self.life.read_committed(step)

    def entries(self, step: int) -> list[CheckpointInfo]:
        """Every version of ``step`` (committed, rolled back, incomplete, fenced, corrupt)."""
        return [_info(self, e) for e in self.life.entries(step)]

    def info(self, step: int, *, check: str = "none") -> CheckpointInfo:
        """Status of one step: its committed version if any, else its most telling one.

        ``check``: 'none' (manifest only), 'size', or 'full'.
        """
        entries = self.life.entries(step)
        if not entries:
            return CheckpointInfo(step, INCOMPLETE, self.storage.describe(step_dirname(step)),
                                  0, problem="no manifest: not committed")
        order = {COMMITTED: 0, CORRUPT: 1, FENCED: 2, ROLLED_BACK: 3, INCOMPLETE: 4}
        return self._checked(min(entries, key=lambda e: order.get(e.status, 9)), check)

    def _checked(self, e: Entry, check: str) -> CheckpointInfo:
        """``e`` as an operator sees it, a committed one verified as ``check`` says."""
        info = _info(self, e)
        if e.status == COMMITTED and check != "none":
            try:
                self.verify_manifest(e.manifest, full=(check == "full"))
            except CorruptCheckpointError as exc:
                info.status, info.problem = CORRUPT, str(exc)
        return info

    def list(self, *, check: str = "none", all_versions: bool = False) -> list[CheckpointInfo]:
        """One row per step; with ``all_versions`` one row per version (each with an id)."""
        if not all_versions:
            return [self.info(s, check=check) for s in self.steps()]
        return [self._checked(e, check) for step in self.steps()
                for e in self.life.entries(step)]

    def committed_steps(self) -> list[int]:
        """Steps whose folder holds a manifest (cheap: no manifest is read or checked)."""
        return [s for s in self.steps() if self.life.has_manifest(s)]

    # -- verification ----------------------------------------------------------------------
    def verify_manifest(self, manifest: Manifest, *, full: bool = True,
                        progress: Callable[[int, int], None] | None = None) -> None:
        """Check every file's size (and crc32c when ``full``); raise on the first bad one."""
        verify_files(self.storage, manifest, full=full, progress=progress)

    def verify(self, step: int, *, full: bool = True,
               progress: Callable[[int, int], None] | None = None) -> Manifest:
        manifest = self.read_manifest(step)
        self.verify_manifest(manifest, full=full, progress=progress)
        return manifest

    def latest(self, *, check: str = "size") -> Manifest | None:
        """The newest committed checkpoint that passes ``check``; older ones are tried in turn.

        Every checkpoint skipped on the way is logged with the reason.
        """
        for step in reversed(self.committed_steps()):
            try:
                manifest = self.read_manifest(step)
                if check != "none":
                    self.verify_manifest(manifest, full=(check == "full"))
                return manifest
            except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                log.warning("skipping checkpoint step %d: %s", step, exc)
        return None

    # -- changes (through the life-cycle) -------------------------------------------------
    def delete(self, step: int) -> None:
        """Delete the committed checkpoint of ``step`` (manifest first, then its files)."""
        self.life.delete(step)

    def uncommit(self, step: int) -> str:
        """Un-commit ``step`` reversibly; returns the id of the kept (rolled-back) version."""
        return self.life.uncommit(step)

    def uncommit_newer(self, step: int) -> list[tuple[int, str | None, CheckpointError | None]]:
        """Un-commit every committed step newer than ``step``, newest first (rollback, and a
        resume that went past newer checkpoints). Returns ``(step, kept id, None)`` for each
        one rolled back and ``(step, None, error)`` for each left as it was because it is
        damaged beyond reading (it does not count anyway)."""
        out: list[tuple[int, str | None, CheckpointError | None]] = []
        for newer in reversed([s for s in self.committed_steps() if s > step]):
            try:
                out.append((newer, self.life.uncommit(newer), None))
            except CheckpointError as exc:
                out.append((newer, None, exc))
        return out
