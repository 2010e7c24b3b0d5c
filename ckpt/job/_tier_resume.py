"""The agreement of a tiered resume: which steps every node has, and whether a step loads.

Collective over the job's tier group (``TieredCheckpointManager``'s, main thread only):
every rank calls these at the same points, and every answer is the same on every rank. A
local step counts only when it is committed on every node; a step is loaded only when its
files are there on every rank, and counts only when it loaded on every rank. After a
resume, each node's coordinator deletes its local steps newer than the one loaded.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    RankFailuresError,
)
from ckpt.events import EventBus
from ckpt.format import Manifest
from ckpt.job.manager import CheckpointManager
from ckpt.ranks import Agreement

__all__ = ["common_local_steps", "try_load", "drop_newer_local"]

log = logging.getLogger(__name__)


def common_local_steps(local: CheckpointManager, group, distributed: bool,
                       local_root: str) -> list[int]:
    """Local steps committed on every node (the same list on every rank): each node's
    coordinator lists its root once, the lists are gathered. ``group``: the job's tier
    group."""
    mine: list[int] | None = None  # None: not a node's coordinator, no listing
    if local.rank == 0:
        try:
            mine = [int(s) for s in local.store.committed_steps()]
        except Exception as exc:  # noqa: BLE001 - an unreadable local tier is an empty one
            log.warning("local tier %s unreadable, not used: %s", local_root, exc)
            mine = []
    if not distributed:
        return mine or []
    lists: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(lists, mine, group=group)  # live peers' lists, no storage
    nodes = [set(steps) for steps in lists if steps is not None]
    return sorted(set.intersection(*nodes))


def try_load(world: Agreement, mgr: CheckpointManager, step: int, state: dict[str, Any],
             any_error: bool, **load_options: Any) -> tuple[Manifest | None, str]:
    """Load ``step`` of one tier if it verifies on every rank: (manifest, "") or (None,
    reason), the same on every rank. ``any_error``: every failure falls back (the local
    tier); else only damage does, other errors raise (as ``ckpt.load_latest``)."""
    error: BaseException | None = None
    manifest = None
    try:
        manifest = mgr.store.read_manifest(step)
        if mgr.verify in ("full", "size"):
            mgr.store.verify_manifest(manifest, full=False)  # every file there, full size
    except (CorruptCheckpointError, CheckpointNotFoundError, OSError) as exc:
        error = exc
    except CheckpointError as exc:
        if not any_error:
            raise
        error = exc
    if not world.all(error is None):
        return None, f"not usable ({error or 'failed on another rank'})"
    try:
        mgr.load_latest(state, step=step, **load_options)
    except (CorruptCheckpointError, RankFailuresError) as exc:
        if (not any_error and isinstance(exc, RankFailuresError)
                and not exc.any_of(CorruptCheckpointError)):
            raise
        error = exc
    except Exception as exc:  # noqa: BLE001 - the local tier never stops a resume
        if not any_error:
            raise
        error = exc
    if world.all(error is None):
        return manifest, ""
    return None, f"failed verification while loading ({error or 'failed on another rank'})"


def drop_newer_local(local: CheckpointManager, step: int, events: EventBus,
                     local_root: str) -> None:
    """Each node's coordinator deletes its local steps newer than ``step``."""
    if local.rank != 0:
        return
    try:
        for newer in [s for s in local.store.committed_steps() if s > step]:
            local.store.delete(newer)
            events.emit("local_retention_deleted", newer, tier="local",
                        reason=f"newer than the resumed step {step}")
    except Exception as exc:  # noqa: BLE001 - a later save of that step is refused
        log.warning("could not delete local steps newer than %d in %s: %s", step,
                    local_root, exc)
