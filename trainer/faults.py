"""Failure detection for the training loop: hangs, bad losses, preemption, stragglers.

Each detector is a small object the loop consults once per step. Decisions that change what
the job does (skip a step, roll back, save and leave) must be the same on every rank: the
loss and gradient norm the guard sees are global values (identical on all ranks), and the
preemption flag is agreed with an all-reduce by the loop.
"""

from __future__ import annotations

import faulthandler
import logging
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from typing import Callable

__all__ = ["HangWatchdog", "LossGuard", "NanInjector", "Preemption", "StragglerDetector"]

log = logging.getLogger(__name__)


class HangWatchdog:
    """Kills the process when no step completes for ``timeout_seconds``.

    A hung collective (a dead peer, a deadlock) never returns; the only way forward is to
    leave, so that torchrun restarts the group and the job resumes from its checkpoint. All
    threads' stacks are dumped to stderr first, to show where it hung.

    ``on_hang(idle_seconds)`` runs first (the trainer counts the hang in its metrics); then
    the process stays up ``linger_seconds`` more, so that a metrics scrape can still see
    that count before the process is gone. ``on_grace(extra_seconds)`` is called whenever
    the extra time allowed for the current step changes (a blocking save, warm-up; 0 again
    at the next step), so the metrics' stall threshold can allow the same.
    """

    def __init__(self, timeout_seconds: float, on_hang: Callable[[float], None] | None = None,
                 exit_code: int = 124, linger_seconds: float = 0.0,
                 on_grace: Callable[[float], None] | None = None):
        self.timeout_seconds = timeout_seconds
        self.on_hang = on_hang
        self.exit_code = exit_code
        self.linger_seconds = linger_seconds
        self.on_grace = on_grace
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._grace = 0.0

    @property
    def grace_seconds(self) -> float:
        """Extra time allowed for the current step (e.g. first step, a blocking save)."""
        return self._grace

    @grace_seconds.setter
    def grace_seconds(self, value: float) -> None:
        changed = value != self._grace
        self._grace = value
        if changed and self.on_grace is not None:
            try:
                self.on_grace(value)
            except Exception:  # noqa: BLE001 - monitoring must never break training
                log.exception("on_grace hook failed")

    def start(self) -> "HangWatchdog":
        if self.timeout_seconds > 0:
            self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
            self._thread.start()
        return self

    def progress(self) -> None:
        self._last = time.monotonic()
        self.grace_seconds = 0.0

    def _run(self) -> None:
        while not self._stop.wait(min(5.0, self.timeout_seconds / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_seconds + self.grace_seconds:
                sys.stderr.write(f"\nwatchdog: no training progress for {idle:.0f}s "
                                 f"(limit {self.timeout_seconds:.0f}s); stacks follow\n")
                faulthandler.dump_traceback(all_threads=True)
                if self.on_hang is not None:
                    try:
                        self.on_hang(idle)
                    except Exception:  # noqa: BLE001
                        pass
                sys.stderr.flush()
                if self.linger_seconds > 0:
                    time.sleep(self.linger_seconds)
                os._exit(self.exit_code)

    def stop(self) -> None:
        self._stop.set()


class LossGuard:
    """Flags non-finite losses and spikes (loss > factor x mean of the recent window)."""

    def __init__(self, spike_factor: float = 10.0, window: int = 20):
        self.spike_factor = spike_factor
        self.window: deque[float] = deque(maxlen=max(1, window))

    def check(self, loss: float, grad_norm: float | None = None) -> str | None:
        """Returns None if fine, else the reason ('nan' or 'spike'). Does not record bad values."""
        if not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)):
            return "nan"
        if self.spike_factor > 0 and len(self.window) == self.window.maxlen:
            mean = sum(self.window) / len(self.window)
            if loss > self.spike_factor * mean:
                return "spike"
        self.window.append(loss)
        return None

    def state_dict(self) -> dict:
        return {"window": list(self.window)}

    def load_state_dict(self, state: dict) -> None:
        self.window.clear()
        self.window.extend(float(x) for x in state.get("window", []))


class NanInjector:
    """Fault injection for tests of the alerting: the loss of step ``step`` (1-based, the
    step being computed) becomes NaN, as if the forward pass had overflowed. 0 = off.

    Applied after the backward pass and before the loss guard, so the guard, the
    ``failure`` event and the metrics see exactly what a real NaN produces.
    """

    def __init__(self, step: int = 0):
        self.step = step

    def apply(self, step: int, loss: float) -> float:
        return math.nan if self.step and step == self.step else loss


class Preemption:
    """Records SIGTERM/SIGUSR1 so the loop can checkpoint and leave at a step boundary.

    Both mean "you are about to be stopped": a scheduler's preemption (Slurm, Kubernetes),
    ``scancel --signal``, or the warning ahead of a time limit (Slurm's
    ``--signal=B:USR1@N``, which the batch script forwards to the ranks). The loop answers
    with a blocking save of the current step and exit 75 (requeue me).

    ``grace_seconds`` is how long the scheduler waits between the signal and the kill (the
    ``N`` above; 0: not known). Such a save must fit in it: :meth:`check_save_seconds` warns,
    once per process, when a save took longer.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, grace_seconds: float = 0.0):
        self.grace_seconds = grace_seconds
        self.received: int | None = None
        self._previous = {}
        self._warned = False

    def install(self) -> "Preemption":
        """Handle the signals from now on (main thread only; again: nothing changes).
        ``python -m trainer`` installs it right after reading the config, so that a signal
        during start-up (rendezvous, building, resuming) is kept for the first step boundary
        instead of killing the process unsaved."""
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return self
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        self.received = signum
        log.warning("received %s: will checkpoint and exit after this step",
                    signal.Signals(signum).name)

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()

    def check_save_seconds(self, seconds: float | None, step: int | None) -> bool:
        """Warn in one line when a save (of ``step``) took ``seconds`` > ``grace_seconds``:
        the save a signal asks for would be killed before it commits. True if it warned
        (once per process; nothing when either number is not known)."""
        if (self._warned or not self.grace_seconds or not isinstance(seconds, (int, float))
                or not seconds > self.grace_seconds):
            return False
        self._warned = True
        log.warning("the save of step %s took %.1fs, longer than the preemption grace of "
                    "%gs (fault.preemption_grace_seconds): a preempted or time-limited job "
                    "would be killed before its checkpoint commits; signal it earlier (Slurm: "
                    "--signal=B:USR1@N, N above a save and a step) and set the key to N",
                    step, seconds, self.grace_seconds)
        return True


class StragglerDetector:
    """Finds ranks whose step time is well above the median of all ranks."""

    def __init__(self, factor: float = 2.0):
        self.factor = factor

    def find(self, step_seconds_by_rank: list[float]) -> list[int]:
        if self.factor <= 0 or len(step_seconds_by_rank) < 2:
            return []
        # The lower median: with an even number of ranks the upper one is already a slow
        # rank's time, so 2 ranks could never show a straggler (nor could half of 2k).
        ordered = sorted(step_seconds_by_rank)
        median = ordered[(len(ordered) - 1) // 2]
        return [r for r, t in enumerate(step_seconds_by_rank)
                if median > 0 and t > self.factor * median]
