"""Test doubles for the manager tests: a fault-injecting Storage and tiny cadence policies.

``FaultyStorage`` is a real ``Storage`` (every write still reaches the backend) that can be
told to be slow, to fail whole save attempts, or to refuse deletes. It is built inside the
process that uses it (rank processes build their own), so it never needs to be pickled.
"""

from __future__ import annotations

import errno
import json
import os
import re
import threading
import time
from typing import Iterable

from ckpt.cadence.policies import CadenceBase
from ckpt.storage import Storage

__all__ = ["FaultyStorage", "EveryN", "OnlyRankWants", "wait_for"]

_DATA_FILE = re.compile(r"(?:^|/)r\d{5}_([0-9a-f]+)_\d+\.bin$")


class FaultyStorage(Storage):
    """A Storage with injectable faults on data files (``rNNNNN_<save_id>_K.bin``).

    Args:
        delay_seconds: sleep before each data-file write (keeps a save in flight).
        fail_attempts: the first N save attempts (distinct save ids) fail every data-file
            write with ``OSError(ENOSPC)``; -1 fails every attempt.
        fail_delete_steps: deleting anything under these steps' folders raises
            ``PermissionError``.
        block: when set, a data-file write waits (forever) until the event is set.
    """

    def __init__(self, url: str, storage_options=None, *, delay_seconds: float = 0.0,
                 fail_attempts: int = 0, fail_delete_steps: Iterable[int] = (),
                 block: threading.Event | None = None):
        super().__init__(url, storage_options)
        self.delay_seconds = delay_seconds
        self.fail_attempts = fail_attempts
        self.fail_delete_steps = set(fail_delete_steps)
        self.block = block
        self.failed_save_ids: list[str] = []
        self.ok_save_ids: list[str] = []
        self.num_data_writes = 0
        self.writing = threading.Event()  # set once the first data-file write has begun
        self._lock = threading.Lock()

    def _should_fail(self, save_id: str) -> bool:
        with self._lock:
            if save_id in self.failed_save_ids:
                return True
            if save_id in self.ok_save_ids:
                return False
            fail = self.fail_attempts < 0 or len(self.failed_save_ids) < self.fail_attempts
            (self.failed_save_ids if fail else self.ok_save_ids).append(save_id)
            return fail

    def write_buffers(self, rel, buffers, **kwargs):
        m = _DATA_FILE.search(rel)
        if m:
            with self._lock:
                self.num_data_writes += 1
            self.writing.set()
            if self.block is not None:
                self.block.wait()
            if self.delay_seconds:
                time.sleep(self.delay_seconds)
            if self._should_fail(m.group(1)):
                raise OSError(errno.ENOSPC, f"injected failure: no space left writing {rel}")
        return super().write_buffers(rel, buffers, **kwargs)

    def delete(self, rel, recursive=False):
        for step in self.fail_delete_steps:
            if rel.strip("/").startswith(f"step_{step:09d}"):
                raise PermissionError(errno.EACCES, f"injected: cannot delete {rel}")
        return super().delete(rel, recursive=recursive)


class EveryN(CadenceBase):
    """Deterministic cadence: save when ``step % n == 0`` (same answer on every rank)."""

    deterministic = True

    def __init__(self, n: int):
        super().__init__()
        self.n = n
        self.saved: list[int] = []

    def describe(self) -> dict:
        return self._describe(self.n, None, "fixed")

    def should_save(self, step: int, now: float) -> bool:
        return step % self.n == 0

    def record_saved(self, step: int, now: float) -> None:
        super().record_saved(step, now)
        self.saved.append(step)


class OnlyRankWants(CadenceBase):
    """Non-deterministic cadence: only ``rank`` wants to save, at ``step`` (ranks disagree)."""

    deterministic = False

    def __init__(self, rank: int, my_rank: int, step: int):
        super().__init__()
        self.rank, self.my_rank, self.step = rank, my_rank, step

    def describe(self) -> dict:
        return self._describe(None, None, "fixed")

    def should_save(self, step: int, now: float) -> bool:
        return self.my_rank == self.rank and step == self.step


def wait_for(cond, timeout: float = 20.0, interval: float = 0.02) -> bool:
    """Poll ``cond()`` until true or ``timeout``; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def lease_released(root) -> bool:
    """The lease record stays at a local root after release, marked released."""
    path = os.path.join(str(root), "_lease.json")
    with open(path) as f:
        return json.load(f)["released"] is True


def marker_names(names) -> list[str]:
    """The attempt markers (``pending-<id>.json``) among a folder's file names."""
    return sorted(n for n in names if n.startswith("pending-") and n.endswith(".json"))
