"""Cadence policies: when to take the next checkpoint.

A policy is a small object with one decision method. The training loop, after every step::

    policy.record_step(step_seconds)          # measured time of the step just finished
    if policy.should_save(step, now):         # cheap, no I/O; does not change the schedule
        policy.record_saved(step, now)        # a save was started at this step and time
        ...stage, then persist in the background...
        policy.record_save(stall_seconds, persist_seconds, num_bytes)   # when it completes

``now`` is a monotonic clock in seconds (``time.monotonic()``), the same clock for every call
to one policy; intervals count from the last ``record_saved``, or from step 0 and the first
``now`` seen. After restoring a checkpoint, call
``record_saved(restored_step, now)`` so the next save is one interval after it.
``should_save`` keeps answering True until ``record_saved`` is called, so a save the caller
skipped (e.g. because the previous one is still persisting) is retried at the next step. Its one
side effect: the first call fixes the clock origin if ``record_saved`` was never called.

Multi-rank jobs: every rank must reach the same decision. ``EverySteps`` decides on the step
alone (its ``deterministic`` attribute is True); ``EverySeconds`` and ``Auto`` depend on clocks
and measurements that differ per rank, so agree on the decision (e.g. broadcast or all-reduce
max), or feed every rank the same (reduced) measurements.

``Auto`` picks the interval with Young/Daly from the measured cost of a checkpoint and the
job's mean time between failures, bounded below by the bandwidth floor and the overhead budget
(the formulas live in :mod:`ckpt.cadence.young_daly`; see docs/cadence.md for them and their sources).
Interval strings (``"auto"``, ``"50"``, ``"5m"``) become policies through :func:`parse_interval`;
their grammar is :mod:`ckpt.cadence.interval`'s. The formulas, :class:`FailureHistory`, ``Interval``
and the duration parser are re-exported here, where callers have always imported them.
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from typing import Any, Protocol, runtime_checkable

from ckpt.cadence.interval import Interval
from ckpt.cadence.young_daly import FailureHistory, optimal_interval

__all__ = [
    "CadencePolicy",
    "CadenceBase",
    "EverySteps",
    "EverySeconds",
    "Auto",
    "parse_interval",
]


@runtime_checkable
class CadencePolicy(Protocol):
    """What a training loop (or ``CheckpointManager``) may call on a cadence policy.

    Every shipped policy implements all of it (through :class:`CadenceBase`), so callers need
    no ``hasattr`` probes. Order of calls: see the module docstring. Clocks:

    * ``should_save(step, now)`` and ``record_saved(step, now)``: ``now`` is a monotonic clock
      in seconds (``time.monotonic()``), the same clock in every call to one policy (only
      differences are used; a wall clock that steps back or jumps would move saves).
    * ``record_step`` and ``record_save``: durations in seconds, measured with a monotonic
      timer (``time.monotonic()`` / ``time.perf_counter()`` differences).
    * ``record_failure(wall_time)``: Unix time (``time.time()``), because the failure history
      outlives the process and is compared across restarts.

    Attributes: ``deterministic`` is True when ``should_save`` depends on the step alone (every
    rank agrees without talking); ``history`` is the job's :class:`FailureHistory`, which the
    policy adds uptime to (``record_step``, stalls in ``record_save``) and a caller may replace
    with the job's shared one.
    """

    deterministic: bool
    history: FailureHistory

    def should_save(self, step: int, now: float) -> bool: ...
    def record_step(self, step_seconds: float) -> None: ...
    def record_save(
        self, stall_seconds: float, persist_seconds: float, num_bytes: int, slowdown_seconds: float = 0.0
    ) -> None: ...
    def record_saved(self, step: int, now: float) -> None: ...
    def record_failure(self, wall_time: float) -> None: ...
    def describe(self) -> dict[str, Any]: ...


class _Ewma:
    """Exponentially weighted moving average; ``None`` until the first sample."""

    def __init__(self, weight: float) -> None:
        self.weight, self.value = weight, None

    def add(self, sample: float) -> None:
        sample = float(sample)
        self.value = sample if self.value is None else self.value + self.weight * (sample - self.value)


class CadenceBase(ABC):
    """Base of every shipped policy, implementing :class:`CadencePolicy`: the last save, the
    clock origin, the step-time EWMA and uptime in ``history``. Subclasses implement
    ``should_save`` and ``describe``; the feedback hooks default to bookkeeping only."""

    name = "policy"
    deterministic = False
    """True when decisions depend on the step alone, so every rank agrees without talking."""

    def __init__(self, smoothing: float = 0.3, history: FailureHistory | None = None) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing={smoothing!r} is invalid: pass the EWMA weight of a new sample in (0, 1]")
        self._step_seconds = _Ewma(smoothing)
        self._last_step = 0
        self._last_time: float | None = None
        self.history = history if history is not None else FailureHistory()

    def _since(self, step: int, now: float) -> tuple[int, float]:
        if self._last_time is None:  # the first clock reading is the origin
            self._last_time = float(now)
        return step - self._last_step, float(now) - self._last_time

    @abstractmethod
    def should_save(self, step: int, now: float) -> bool:
        """True when a save should start at ``step`` (``now``: monotonic seconds)."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """JSON-safe ``{"policy", "interval_steps", "interval_seconds", "active_bound", "inputs"}``."""

    def record_step(self, step_seconds: float) -> None:
        if step_seconds >= 0:
            self._step_seconds.add(step_seconds)
            self.history.add_uptime(step_seconds)

    def record_save(
        self, stall_seconds: float, persist_seconds: float, num_bytes: int, slowdown_seconds: float = 0.0
    ) -> None:
        self.history.add_uptime(stall_seconds)

    def record_saved(self, step: int, now: float) -> None:
        self._last_step, self._last_time = int(step), float(now)

    def record_failure(self, wall_time: float) -> None:
        self.history.record_failure(wall_time)

    def _describe(self, steps: int | None, seconds: float | None, bound: str, **inputs: Any) -> dict[str, Any]:
        inputs["step_seconds"] = self._step_seconds.value
        return {"policy": self.name, "interval_steps": steps, "interval_seconds": seconds,
                "active_bound": bound, "inputs": inputs}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"


class EverySteps(CadenceBase):
    """Save every ``num_steps`` steps after the last save."""

    name = "every_steps"
    deterministic = True

    def __init__(self, num_steps: int) -> None:
        super().__init__()
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps={num_steps!r} is invalid: pass a whole number of steps >= 1")
        self.num_steps = num_steps

    def should_save(self, step: int, now: float) -> bool:
        return step - self._last_step >= self.num_steps

    def describe(self) -> dict[str, Any]:
        step = self._step_seconds.value
        return self._describe(self.num_steps, None if step is None else self.num_steps * step, "fixed")


class EverySeconds(CadenceBase):
    """Save when ``seconds`` have passed since the last save (or since the first ``now`` seen)."""

    name = "every_seconds"

    def __init__(self, seconds: float) -> None:
        super().__init__()
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"seconds={seconds!r} is invalid: pass an interval > 0 seconds")
        self.seconds = float(seconds)

    def should_save(self, step: int, now: float) -> bool:
        return self._since(step, now)[1] >= self.seconds

    def describe(self) -> dict[str, Any]:
        step = self._step_seconds.value
        steps = None if not step else max(1, round(self.seconds / step))
        return self._describe(steps, self.seconds, "fixed")


class Auto(CadenceBase):
    """Young/Daly interval from measured checkpoint cost, bandwidth and failure history.

    Until the first ``record_save`` it saves after ``initial_steps`` steps or ``initial_seconds``
    seconds, whichever comes first (either may be ``None``), so the cost can be measured. Then
    the interval is ``optimal_interval(delta, M, persist, overhead_budget)`` where

    * ``delta`` = EWMA of ``stall_seconds + slowdown_seconds`` (the cost to training),
    * ``persist`` = last ``num_bytes`` / measured bandwidth, the bandwidth being the EWMA of
      ``persist_seconds / num_bytes`` (averaged as time per byte, so slow saves weigh more),
    * ``M`` = ``history.mtbf(mtbf_seconds, prior_weight)``; uptime is accumulated from
      ``record_step`` and stalls, failures from ``record_failure``.

    ``overhead_budget`` (a fraction, or ``None`` for none) caps ``delta / interval``; when it
    binds, the interval is longer than the optimum, which costs goodput in lost work.

    The interval is converted to steps (rounded up) with the step-time EWMA, and decisions are made in steps
    once a step time is known (in seconds before). It is recomputed when a save starts or
    completes and when a failure is recorded, so ``should_save`` stays arithmetic only.
    """

    name = "auto"

    def __init__(
        self,
        mtbf_seconds: float = 86400.0,
        overhead_budget: float | None = None,
        initial_steps: int | None = None,
        initial_seconds: float | None = 300.0,
        history: FailureHistory | None = None,
        prior_weight: float = 1.0,
        smoothing: float = 0.3,
    ) -> None:
        super().__init__(smoothing, history)
        if not (math.isfinite(mtbf_seconds) and mtbf_seconds > 0):
            raise ValueError(f"mtbf_seconds={mtbf_seconds!r} is invalid: pass the prior MTBF in seconds, > 0")
        if initial_steps is None and initial_seconds is None:
            raise ValueError("initial_steps and initial_seconds are both None: set at least one")
        if initial_steps is not None and (not isinstance(initial_steps, int) or initial_steps < 1):
            raise ValueError(f"initial_steps={initial_steps!r} is invalid: pass a whole number >= 1 or None")
        if initial_seconds is not None and not initial_seconds > 0:
            raise ValueError(f"initial_seconds={initial_seconds!r} is invalid: pass seconds > 0 or None")
        optimal_interval(1.0, 1.0, 0.0, overhead_budget)  # validates overhead_budget
        self.history.mtbf(mtbf_seconds, prior_weight)  # validates prior_weight
        self.mtbf_seconds, self.prior_weight = float(mtbf_seconds), float(prior_weight)
        self.overhead_budget = overhead_budget
        self.initial_steps, self.initial_seconds = initial_steps, initial_seconds
        self._cost = _Ewma(smoothing)
        self._seconds_per_byte = _Ewma(smoothing)  # averaged as time so slow saves weigh more
        self._num_bytes: int | None = None
        self._persist_seconds = 0.0
        self._interval_seconds: float | None = None  # None until the first record_save
        self._interval_steps: int | None = None
        self._bound = "initial"
        # record_save usually comes from the background persist thread; should_save reads
        # the cached interval without the lock (a stale read only shifts one decision).
        self._lock = threading.Lock()

    def _retune(self) -> None:
        if self._cost.value is not None:
            per_byte = self._seconds_per_byte.value
            self._persist_seconds = per_byte * self._num_bytes if per_byte and self._num_bytes else 0.0
            self._interval_seconds, self._bound = optimal_interval(
                self._cost.value, self.mtbf(), self._persist_seconds, self.overhead_budget
            )
        step = self._step_seconds.value
        if self._interval_seconds is not None and step:
            # Rounded up so the floors still hold in steps.
            self._interval_steps = max(1, math.ceil(self._interval_seconds / step - 1e-9))

    def mtbf(self) -> float:
        """Current MTBF estimate in seconds (prior refined by ``history``)."""
        return self.history.mtbf(self.mtbf_seconds, self.prior_weight)

    def should_save(self, step: int, now: float) -> bool:
        steps, seconds = self._since(step, now)
        if self._interval_seconds is None:
            return (self.initial_steps is not None and steps >= self.initial_steps) or (
                self.initial_seconds is not None and seconds >= self.initial_seconds
            )
        if self._interval_steps is not None:
            return steps >= self._interval_steps
        return seconds >= self._interval_seconds

    def record_step(self, step_seconds: float) -> None:
        with self._lock:
            super().record_step(step_seconds)
            if self._interval_steps is None:
                self._retune()

    def record_save(
        self, stall_seconds: float, persist_seconds: float, num_bytes: int, slowdown_seconds: float = 0.0
    ) -> None:
        """Feed the measured cost of one completed checkpoint: ``stall_seconds`` training was
        blocked, ``persist_seconds`` writing ``num_bytes`` took, ``slowdown_seconds`` of extra
        step time while persisting in the background."""
        for name, value in (("stall_seconds", stall_seconds), ("persist_seconds", persist_seconds),
                            ("slowdown_seconds", slowdown_seconds), ("num_bytes", num_bytes)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value!r} is invalid: pass a measured value >= 0")
        with self._lock:
            super().record_save(stall_seconds, persist_seconds, num_bytes, slowdown_seconds)
            self._cost.add(stall_seconds + slowdown_seconds)
            if num_bytes > 0 and persist_seconds > 0:
                self._seconds_per_byte.add(persist_seconds / num_bytes)
                self._num_bytes = int(num_bytes)
            self._retune()

    def record_saved(self, step: int, now: float) -> None:
        with self._lock:
            super().record_saved(step, now)
            self._retune()

    def record_failure(self, wall_time: float) -> None:
        with self._lock:
            super().record_failure(wall_time)
            self._retune()

    def describe(self) -> dict[str, Any]:
        seconds, steps = self._interval_seconds, self._interval_steps
        if seconds is None:
            seconds, steps = self.initial_seconds, self.initial_steps
        per_byte = self._seconds_per_byte.value
        return self._describe(
            steps, seconds, self._bound,
            checkpoint_cost_seconds=self._cost.value,
            persist_seconds=self._persist_seconds if self._cost.value is not None else None,
            num_bytes=self._num_bytes,
            bandwidth_bytes_per_second=1.0 / per_byte if per_byte else None,
            mtbf_seconds=self.mtbf(),
            mtbf_prior_seconds=self.mtbf_seconds,
            num_failures=self.history.num_failures,
            uptime_seconds=self.history.uptime_seconds,
            overhead_budget=self.overhead_budget,
        )


def parse_interval(text: str | int, **auto_options: Any) -> CadencePolicy:
    """Policy for an interval string (:meth:`Interval.parse`): ``"auto"`` ->
    ``Auto(**auto_options)``, ``"50"`` -> ``EverySteps(50)``, ``"300s"`` / ``"5m"`` ->
    ``EverySeconds``. ``auto_options`` are used only for ``"auto"``."""
    interval = Interval.parse(text)
    if interval.kind == "steps":
        return EverySteps(interval.steps)
    if interval.kind == "seconds":
        return EverySeconds(interval.seconds)
    return Auto(**auto_options)
