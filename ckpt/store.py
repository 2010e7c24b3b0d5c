"""Discovery, verification and deletion of the checkpoints under one root.

A root holds one folder per checkpoint, ``step_NNNNNNNNN/``. A folder is *committed* when
its ``manifest.json`` exists and parses; *incomplete* when it has no manifest (a save in
flight, or the leftovers of one that died: its ``pending.json`` names the writer); *corrupt*
when the manifest is unreadable or its files fail verification.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from typing import Any, Callable

from ckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckpt.manifest import (
    MANIFEST_NAME,
    PENDING_NAME,
    Manifest,
    parse_step_dirname,
    step_dirname,
)
from ckpt.storage import Storage, crc32c_of

__all__ = ["CheckpointInfo", "CheckpointStore", "COMMITTED", "INCOMPLETE", "CORRUPT"]

log = logging.getLogger(__name__)

COMMITTED, INCOMPLETE, CORRUPT, ROLLED_BACK = "committed", "incomplete", "corrupt", "rolled-back"
_VERIFY_BLOCK = 64 << 20
ROLLED_BACK_MANIFEST = f"rolled-back-{MANIFEST_NAME}"


@dataclass
class CheckpointInfo:
    """One checkpoint folder as an operator sees it."""

    step: int
    status: str
    url: str
    bytes: int
    created: float | None = None
    save_id: str | None = None
    owner: str | None = None
    problem: str | None = None
    user_metadata: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class CheckpointStore:
    """Read-side view of a checkpoint root, plus deletion. Safe to use from any one rank."""

    def __init__(self, root: str | Storage, storage_options: dict[str, Any] | None = None):
        self.storage = root if isinstance(root, Storage) else Storage(root, storage_options)

    # -- listing ---------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Every step that has a folder, committed or not, ascending."""
        steps = []
        for name, kind, _ in self.storage.listdir(""):
            step = parse_step_dirname(name)
            if step is not None and kind == "directory":
                steps.append(step)
        return sorted(steps)

    def read_manifest(self, step: int) -> Manifest:
        rel = f"{step_dirname(step)}/{MANIFEST_NAME}"
        try:
            data = self.storage.read_bytes(rel)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"no committed checkpoint at {self.storage.describe(step_dirname(step))} "
                f"({MANIFEST_NAME} is absent). `ckpt list {self.storage.url}` shows what exists."
            ) from None
        return Manifest.from_json_bytes(data, self.storage.describe(rel), expected_step=step)

    def info(self, step: int, *, check: str = "none") -> CheckpointInfo:
        """Status of one step. ``check``: 'none' (manifest only), 'size', or 'full'."""
        d = step_dirname(step)
        url = self.storage.describe(d)
        try:
            manifest = self.read_manifest(step)
        except CheckpointNotFoundError:
            entries = self.storage.listdir(d)
            if any(name == ROLLED_BACK_MANIFEST for name, _, _ in entries):
                return CheckpointInfo(step, ROLLED_BACK, url, sum(e[2] for e in entries),
                                      problem="un-committed (rollback); its manifest is "
                                              f"kept as {ROLLED_BACK_MANIFEST}")
            owner = None
            try:
                pending = json.loads(self.storage.read_bytes(f"{d}/{PENDING_NAME}"))
                owner = pending.get("owner")
            except (FileNotFoundError, ValueError):
                pass
            return CheckpointInfo(step, INCOMPLETE, url, sum(e[2] for e in entries),
                                  owner=owner, problem="no manifest: not committed")
        except CorruptCheckpointError as exc:
            return CheckpointInfo(step, CORRUPT, url, 0, problem=str(exc))
        info = CheckpointInfo(step, COMMITTED, url, manifest.total_bytes, manifest.created_unix,
                              manifest.save_id, manifest.writer.get("owner"),
                              user_metadata=manifest.user_metadata)
        if check != "none":
            try:
                self.verify_manifest(manifest, full=(check == "full"))
            except CorruptCheckpointError as exc:
                info.status, info.problem = CORRUPT, str(exc)
        return info

    def list(self, *, check: str = "none") -> list[CheckpointInfo]:
        return [self.info(s, check=check) for s in self.steps()]

    def committed_steps(self) -> list[int]:
        return [s for s in self.steps()
                if self.storage.exists(f"{step_dirname(s)}/{MANIFEST_NAME}")]

    # -- verification ----------------------------------------------------------------------
    def verify_manifest(self, manifest: Manifest, *, full: bool = True,
                        progress: Callable[[int, int], None] | None = None) -> None:
        """Check every file's size (and crc32c when ``full``); raise on the first bad one."""
        d = step_dirname(manifest.step)
        sizes = {name: size for name, kind, size in self.storage.listdir(d) if kind == "file"}
        total = manifest.total_bytes if full else len(manifest.files)
        done = 0
        for name, rec in sorted(manifest.files.items()):
            rel = f"{d}/{name}"
            where = self.storage.describe(rel)
            if name not in sizes:
                raise CorruptCheckpointError(f"data file {where} is missing; load an earlier step",
                                             path=where)
            if sizes[name] != rec.size:
                raise CorruptCheckpointError(
                    f"data file {where} is {sizes[name]} bytes, the manifest says {rec.size} "
                    f"(truncated or overwritten); load an earlier step", path=where,
                    expected=rec.size, actual=sizes[name])
            if not full:
                done += 1
                if progress:
                    progress(done, total)
                continue
            crc, offset = 0, 0
            while offset < rec.size:
                end = min(rec.size, offset + _VERIFY_BLOCK)
                block = self.storage.read_bytes(rel, offset, end)
                crc = crc32c_of([block], crc)
                offset = end
                done += len(block)
                if progress:
                    progress(done, total)
            if crc != rec.crc32c:
                raise CorruptCheckpointError(
                    f"checksum mismatch in {where}: expected crc32c {rec.crc32c:08x}, got "
                    f"{crc:08x}. The file is corrupt; load an earlier step.", path=where,
                    expected=f"{rec.crc32c:08x}", actual=f"{crc:08x}")

    def verify(self, step: int, *, full: bool = True,
               progress: Callable[[int, int], None] | None = None) -> Manifest:
        manifest = self.read_manifest(step)
        self.verify_manifest(manifest, full=full, progress=progress)
        return manifest

    def latest(self, *, check: str = "size", below: int | None = None) -> Manifest | None:
        """The newest committed checkpoint that passes ``check``; older ones are tried in turn.

        Every checkpoint skipped on the way is logged with the reason.
        """
        for step in reversed(self.committed_steps()):
            if below is not None and step >= below:
                continue
            try:
                manifest = self.read_manifest(step)
                if check != "none":
                    self.verify_manifest(manifest, full=(check == "full"))
                return manifest
            except CorruptCheckpointError as exc:
                log.warning("skipping checkpoint step %d: %s", step, exc)
        return None

    # -- deletion --------------------------------------------------------------------------
    def delete(self, step: int) -> None:
        """Delete one checkpoint: the manifest first (un-commit), then the data."""
        d = step_dirname(step)
        self.storage.delete(f"{d}/{MANIFEST_NAME}")
        self.storage.delete(d, recursive=True)

    def uncommit(self, step: int) -> str:
        """Un-commit ``step`` reversibly: its manifest is kept as ``rolled-back-manifest.json``.

        The data stays; the checkpoint is no longer visible to loads and resumes (restore the
        manifest's name to undo). Returns the kept manifest's path.
        """
        d = step_dirname(step)
        kept = f"{d}/{ROLLED_BACK_MANIFEST}"
        self.storage.write_bytes(kept, self.storage.read_bytes(f"{d}/{MANIFEST_NAME}"))
        self.storage.delete(f"{d}/{MANIFEST_NAME}")
        return kept

    def aborted_saves(self, live_owner: str | None) -> list[int]:
        """Incomplete folders whose ``pending.json`` names a writer other than ``live_owner``.

        Only folders with a marker are considered: the marker is written before any data, so
        a folder without one (and without a manifest) is not ours to judge and is left alone.
        """
        out = []
        for step in self.steps():
            d = step_dirname(step)
            if self.storage.exists(f"{d}/{MANIFEST_NAME}"):
                continue
            try:
                pending = json.loads(self.storage.read_bytes(f"{d}/{PENDING_NAME}"))
            except (FileNotFoundError, ValueError):
                continue
            if live_owner is None or pending.get("owner") != live_owner:
                out.append(step)
        return out
