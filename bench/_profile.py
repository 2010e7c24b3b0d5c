"""Where the time of one save and one load goes: per-function thread-seconds.

cProfile only sees the calling thread, and our persist work runs in writer threads, so this
wraps the functions of interest with ``perf_counter`` timers that add up across threads
(sums can exceed the wall time when threads overlap). Used by ``--profile``; changes no
code on disk (the wrappers are installed for the run and removed after).
"""

from __future__ import annotations

import functools
import threading
import time
from contextlib import contextmanager
from typing import Any


class _Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()

    def add(self, name: str, dt: float) -> None:
        with self.lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + dt
            self.calls[name] = self.calls.get(name, 0) + 1


@contextmanager
def _patched(targets: list[tuple[Any, str, str]], timers: _Timers):
    saved = []
    for owner, attr, label in targets:
        orig = getattr(owner, attr)

        def make(orig=orig, label=label):
            @functools.wraps(orig)
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                try:
                    return orig(*a, **k)
                finally:
                    timers.add(label, time.perf_counter() - t0)
            return wrapper

        saved.append((owner, attr, orig))
        setattr(owner, attr, make())
    try:
        yield
    finally:
        for owner, attr, orig in reversed(saved):
            setattr(owner, attr, orig)


def profile_ours(state: dict, root: str, num_threads: int) -> dict[str, Any]:
    """One staging copy, one synchronous ``ckpt.save``, loads with verify full and none."""
    import torch.distributed.checkpoint.state_dict_saver as saver

    from ckpt.dcp import (
        api,
        layout as dcp_layout,
        planners,
        reader as dcp_reader,
        staging,
        writer as dcp_writer,
    )
    from ckpt.storage import Storage

    out: dict[str, Any] = {}
    targets = [
        (staging.StagingBuffers, "stage", "StagingBuffers.stage"),
        (dcp_writer.CkptWriter, "prepare_global_plan", "CkptWriter.prepare_global_plan"),
        (dcp_writer.CkptWriter, "write_data", "CkptWriter.write_data"),
        (dcp_writer.CkptWriter, "finish", "CkptWriter.finish (manifest commit)"),
        (dcp_layout, "tensor_view_bytes", "dcp_layout.tensor_view_bytes"),
        (planners, "crc32c_of", "crc32c on save, planning (planners.crc32c_of)"),
        (dcp_writer, "crc32c_of", "crc32c on save, writer (dcp_writer.crc32c_of)"),
        (dcp_reader, "crc32c_of", "crc32c on load (dcp_reader.crc32c_of)"),
        (Storage, "write_buffers", "Storage.write_buffers (write+fsync)"),
        (Storage, "create_exclusive", "Storage.create_exclusive"),
        (Storage, "read_bytes", "Storage.read_bytes"),
        (Storage, "size", "Storage.size"),
        (dcp_reader.CkptReader, "read_data", "CkptReader.read_data"),
        (planners.SafeLoadPlanner, "create_local_plan", "SafeLoadPlanner.create_local_plan"),
        (saver, "_save_state_dict", "dcp _save_state_dict (whole save)"),
    ]
    buffers = staging.StagingBuffers()
    buffers.stage(api.resolve_state(state))  # allocate: profile the steady-state copy
    runs = {
        "stage": lambda: buffers.stage(api.resolve_state(state)),
        "save": lambda: api.save(state, root, 1, num_threads=num_threads),
        "load_full": lambda: api.load(state, root, 1, verify="full", num_threads=num_threads),
        "load_none": lambda: api.load(state, root, 1, verify="none", num_threads=num_threads),
    }
    for name, fn in runs.items():
        timers = _Timers()
        with _patched(targets, timers):
            t0 = time.perf_counter()
            fn()
            wall = time.perf_counter() - t0
        out[name] = {"wall_seconds": wall,
                     "thread_seconds": dict(sorted(timers.seconds.items(),
                                                   key=lambda kv: -kv[1])),
                     "calls": timers.calls}
    return out
