"""A manager's resume: load a given step, or the newest checkpoint that verifies.

Collective over the manager's control group (every rank of the manager calls it with the
same arguments). The walk over candidates is :func:`ckpt.dcp.api.load_latest`'s; this adds the
manager's part: reading into its staging buffers, its events (``load_fallback`` per skipped
step, ``load_done``) and a hook that lets its cadence count from the step resumed.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ckpt.dcp import StagingBuffers, api
from ckpt.events import EventBus
from ckpt.format import Manifest
from ckpt.root import CheckpointStore
from ckpt.storage import Storage

__all__ = ["load_for_manager"]


def load_for_manager(state: dict[str, Any], *, storage: Storage, store: CheckpointStore,
                     events: EventBus, process_group, verify: str, num_threads: int | None,
                     scratch: StagingBuffers | None, step: int | None, strict: bool,
                     ignore_keys: tuple[str, ...], raise_if_all_damaged: bool,
                     extra_state: Callable[[Manifest], dict[str, Any]] | None,
                     on_loaded: Callable[[int], None]) -> Manifest | None:
    """Load ``step`` (or the newest valid checkpoint) into ``state``; None when there is
    nothing to resume from. ``scratch``: staging buffers to read into (None while a save
    persists from them). ``on_loaded(step)`` runs before the ``load_done`` event."""
    t0 = time.monotonic()
    fallbacks: list[int] = []

    def fell_back(skipped: int, reason: str) -> None:
        fallbacks.append(skipped)
        events.emit("load_fallback", skipped, reason=reason)

    if scratch is not None:
        scratch.prepare(api.resolve_state(state))
    if step is not None:
        manifest = api.load_with_extra(
            state, storage, store.read_manifest(step), extra_state,
            verify=verify, strict=strict, process_group=process_group,
            num_threads=num_threads, ignore_keys=ignore_keys, scratch=scratch)
    else:
        manifest = api.load_latest(state, storage, verify=verify, strict=strict,
                                   process_group=process_group,
                                   num_threads=num_threads, ignore_keys=ignore_keys,
                                   on_fallback=fell_back,
                                   raise_if_all_damaged=raise_if_all_damaged,
                                   scratch=scratch, extra_state=extra_state)
    if manifest is not None:
        on_loaded(manifest.step)
        seconds = time.monotonic() - t0
        events.emit("load_done", manifest.step, outcome="loaded", seconds=seconds,
                    bytes=manifest.total_bytes, verify=verify,
                    bytes_per_second=manifest.total_bytes / seconds if seconds > 0
                    else 0.0, num_fallbacks=len(fallbacks))
    return manifest
