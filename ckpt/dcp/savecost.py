"""What one save costs in the background: wall and CPU seconds per phase.

A save's stall is the copy the training thread waits for; everything else runs on the
persist thread (and its writer/checksum threads) while training goes on. On a host with
few cores that work still takes time from training: its CPU seconds compete with the
training threads. ``SaveCost`` records, per phase, the wall seconds on the thread that
waits for it and the CPU seconds of every thread that worked on it (``time.thread_time``),
plus the process's CPU seconds (``time.process_time``, every thread, training included)
over the whole save, every attempt included. The manager emits it as one ``save_cost``
event per committed save.

Phases (``ckpt.events.SAVE_COST_PHASES``, the ``save_cost`` event's vocabulary):

========== ==============================================================================
plan       local plan (its replica checksums count under ``crc``), global plan on the
           coordinator, final plan
collective DCP's gathers/scatters and our agreements: the persist thread's time inside the
           save not spent in another phase (waiting for the slowest rank included)
crc        crc32c of the data (replica checksums at planning, per-item checksums)
write      writing the data files (the bytes handed to the OS)
fsync      making the data files durable (file and folder syncs)
commit     attempt marker, manifest build and commit, lease renewals
bookkeep   after the commit: history, cadence
retention  retention (listing the root, checking the newest, deletions)
========== ==============================================================================

Thread-safe: writer threads add their own CPU seconds.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from ckpt.events import SAVE_COST_PHASES

__all__ = ["SaveCost"]


class SaveCost:
    """Wall and CPU seconds per phase of one save (see the module docstring).

    Created on the persist thread (the *owner*). ``phase`` may be used on any thread; wall
    seconds of phases on helper threads are thread-seconds (summed over threads, they can
    overlap). ``span`` marks owner-thread time spent in known phases when the work happens
    on helpers; ``collective`` is then whatever the owner spent in the save outside them.
    """

    def __init__(self) -> None:
        self.wall: dict[str, float] = {p: 0.0 for p in SAVE_COST_PHASES}
        self.cpu: dict[str, float] = {p: 0.0 for p in SAVE_COST_PHASES}
        self.helper_cpu = 0.0
        # CPU seconds the save took in a writer process (``ckpt.job._writer_process``), if
        # it ran in one: the phases above are then that process's, the totals this one's.
        self.writer_process_cpu: float | None = None
        self._lock = threading.Lock()
        self._owner = threading.get_ident()
        self._accounted = 0.0  # owner wall seconds inside phases or spans
        self._in_span = False
        self._t0 = time.monotonic()
        self._thread0 = time.thread_time()
        self._process0 = time.process_time()
        self._total: tuple[float, float, float] | None = None
        self._lap: tuple[float, float] | None = None

    def add(self, phase: str, wall: float = 0.0, cpu: float = 0.0) -> None:
        assert phase in self.wall, phase
        with self._lock:
            self.wall[phase] += wall
            self.cpu[phase] += cpu
            if threading.get_ident() != self._owner:
                self.helper_cpu += cpu
            elif not self._in_span:
                self._accounted += wall

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the enclosed block (wall and this thread's CPU) as phase ``name``."""
        t0, c0 = time.monotonic(), time.thread_time()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - t0, time.thread_time() - c0)

    @contextmanager
    def span(self) -> Iterator[None]:
        """Owner thread: the enclosed block's wall time is accounted for by phases timed
        inside it (on helper threads or this one); it is not ``collective`` time."""
        assert threading.get_ident() == self._owner
        t0 = time.monotonic()
        self._in_span = True
        try:
            yield
        finally:
            self._in_span = False
            with self._lock:
                self._accounted += time.monotonic() - t0

    @contextmanager
    def collective_scope(self) -> Iterator[None]:
        """Owner thread: the enclosed block (a collective call such as ``dcp.save``) counts
        as ``collective`` except for the phases timed inside it."""
        t0, c0 = time.monotonic(), time.thread_time()
        with self._lock:
            a0, p0 = self._accounted, sum(self.cpu.values()) - self.helper_cpu
        try:
            yield
        finally:
            with self._lock:
                inner_wall = self._accounted - a0
                inner_cpu = sum(self.cpu.values()) - self.helper_cpu - p0
                self.wall["collective"] += max(0.0, time.monotonic() - t0 - inner_wall)
                self.cpu["collective"] += max(0.0, time.thread_time() - c0 - inner_cpu)
                self._accounted = a0 + (time.monotonic() - t0)

    def lap(self, name: str | None = None) -> None:
        """Owner thread, outside any phase: charge the time since the previous ``lap`` to
        phase ``name`` (None: only start counting)."""
        now, cpu = time.monotonic(), time.thread_time()
        if name is not None and self._lap is not None:
            self.add(name, now - self._lap[0], cpu - self._lap[1])
        self._lap = (now, cpu)

    def finish(self) -> None:
        """Close the save's totals (on the owner thread)."""
        self._total = (time.monotonic() - self._t0, time.thread_time() - self._thread0,
                       time.process_time() - self._process0)

    def fields(self) -> dict[str, Any]:
        """The ``save_cost`` event's fields: ``wall_seconds``/``cpu_seconds`` per phase, and
        the totals: ``total_wall_seconds``, ``persist_thread_cpu_seconds`` (the persist
        thread alone), ``helper_cpu_seconds`` (writer and checksum threads),
        ``background_cpu_seconds`` (the two together: what the save took from the CPUs),
        ``process_cpu_seconds`` (every thread of the process over the save, training
        included); in process mode also ``writer_process_cpu_seconds`` (the writer
        process's CPU over the save)."""
        if self._total is None:
            self.finish()
        total_wall, thread_cpu, process_cpu = self._total
        with self._lock:
            wall, cpu, helper = dict(self.wall), dict(self.cpu), self.helper_cpu
        writer = {} if self.writer_process_cpu is None else {
            "writer_process_cpu_seconds": round(self.writer_process_cpu, 6)}
        return {**writer, "wall_seconds": {k: round(v, 6) for k, v in wall.items()},
                "cpu_seconds": {k: round(v, 6) for k, v in cpu.items()},
                "total_wall_seconds": round(total_wall, 6),
                "persist_thread_cpu_seconds": round(thread_cpu, 6),
                "helper_cpu_seconds": round(helper, 6),
                "background_cpu_seconds": round(thread_cpu + helper, 6),
                "process_cpu_seconds": round(process_cpu, 6)}
