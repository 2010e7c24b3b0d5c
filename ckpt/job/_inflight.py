"""A manager's save in flight: the staged copy it persists, and the one background slot.

:class:`StagedCopy`: a copy of the state staged into a manager's reused host buffers at one
step (staging is the one stall of a save). A manager remembers the newest copy it staged so
that another manager can persist the same copy at the same step
(``TierLink.reusable``: ``ckpt.job.tiers`` saves both tiers with one stall).

:class:`InflightSave`: at most one save persists at a time. The slot owns the persist thread
(one worker), the job in flight, its step and the outcome of the newest save that failed. The
training thread starts jobs, waits for them and re-raises failures; the persist thread records
a failure (``failure``) before its job finishes, so whoever waited for the job sees it.
Whether a failure is re-raised on every rank alike is the manager's business (it agrees that
first).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from ckpt.errors import CheckpointError

__all__ = ["StagedCopy", "InflightSave"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagedCopy:
    """A copy of the state staged by a manager at ``step`` (in its staging buffers), which
    another manager may persist too (``TierLink.reusable``): one stall for two saves.
    ``wait_ready()`` blocks until the copies are done (on CUDA they are only enqueued) and
    returns their device time when known. ``window_bytes``: None when the whole state was
    staged; else the state did not fit the staging budget, ``staged`` holds the live tensors
    that did not (persisted before training goes on), and device ones reach the host at
    most this many bytes at a time (``ckpt.dcp.staging``)."""

    step: int
    staged: Any
    nbytes: int
    stall_seconds: float
    wait_ready: Callable[[], float | None] = lambda: None
    window_bytes: int | None = None


class InflightSave:
    """The persist thread of one manager and the save it runs (if any)."""

    def __init__(self, thread_name_prefix: str = "ckpt-persist"):
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=thread_name_prefix)
        self.future: Future | None = None
        self.step: int | None = None  # the step of the newest job started
        self.failure: BaseException | None = None  # of the newest save, until re-raised

    def start(self, step: int, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the persist thread as the save of ``step``; forgets the
        previous save's failure (``wait()`` reports the newest save's outcome only)."""
        self.failure = None
        self.future, self.step = self.executor.submit(fn, *args), step

    def running(self) -> bool:
        return self.future is not None and not self.future.done()

    def join(self) -> Any:
        """Block until the newest job is done; its result (None without one)."""
        return self.future.result() if self.future is not None else None

    def wait(self, raise_errors: bool) -> Any:
        """``join()``, then (``raise_errors``) ``raise_failure()``."""
        result = self.join()
        if raise_errors:
            self.raise_failure()
        return result

    def raise_failure(self) -> None:
        """Re-raise (and forget) the newest save's failure, if any."""
        if self.failure is not None:
            exc, self.failure = self.failure, None
            raise exc

    def raise_agreed_failure(self) -> None:
        """Some rank saw the last save fail: every rank did (or will), so all raise here."""
        self.join()
        exc, self.failure = self.failure, None
        raise exc if exc is not None else CheckpointError(
            "the previous checkpoint save failed on another rank")

    def close(self) -> None:
        """Wait for the job in flight (its failure is logged, and kept in ``failure``),
        then stop the persist thread."""
        try:
            if self.future is not None:
                try:
                    self.join()
                except BaseException as exc:  # noqa: BLE001
                    log.error("in-flight save failed during close: %s", exc)
        finally:
            self.executor.shutdown(wait=True)
