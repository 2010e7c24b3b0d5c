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
job's mean time between failures, bounded below by the bandwidth floor and the overhead budget.
See docs/cadence.md for the formulas and their sources.
"""

from __future__ import annotations

import math
import re
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "CadencePolicy",
    "CadenceBase",
    "EverySteps",
    "EverySeconds",
    "Auto",
    "FailureHistory",
    "young_daly_interval",
    "optimal_interval",
    "Interval",
    "parse_interval",
    "parse_duration",
    "DURATION_FORMS",
    "INTERVAL_FORMS",
]

# The one duration grammar of the project: the trainer's config, CheckpointManager(cadence=...)
# and `ckpt plan` all parse through parse_duration / Interval.parse.
_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0,
                   "d": 86400.0}
_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

DURATION_FORMS = ("a number with an optional unit ms, s or sec, m or min, h, d "
                  "(e.g. '500ms', '30sec', '5m', '1.5h', '1d')")
"""The accepted duration spellings, as error messages and docs state them."""
INTERVAL_FORMS = ("'auto', a whole number of steps such as '50', or a duration such as "
                  "'500ms', '30sec', '5m', '1.5h', '1d'")
"""The accepted checkpoint-interval spellings, as error messages and docs state them."""


def _split_duration(text: str) -> tuple[float, str] | None:
    """``(number, unit)`` with the unit lower-cased ('' for none), or None if malformed."""
    match = _DURATION_RE.match(str(text))
    if not match or match.group(2).lower() not in {"", *_DURATION_UNITS}:
        return None
    return float(match.group(1)), match.group(2).lower()


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a number >= 0 with an optional unit ``ms``, ``s``/``sec``,
    ``m``/``min``, ``h`` or ``d`` (case-insensitive; no unit means seconds), e.g. ``"300"``,
    ``"30sec"``, ``"5m"``, ``"1.5h"``. Raises ``ValueError`` naming the value and the forms."""
    parts = _split_duration(text)
    if parts is None:
        raise ValueError(f"invalid duration {text!r}: pass {DURATION_FORMS}")
    number, unit = parts
    return number * _DURATION_UNITS.get(unit, 1.0)


def young_daly_interval(delta: float, mtbf: float) -> float:
    """Daly's (2006) higher-order optimum of the compute time between checkpoints, in seconds.

    ``tau = sqrt(2 delta M) [1 + sqrt(delta / 2M) / 3 + delta / 18M] - delta`` for
    ``delta < 2M``, else ``tau = M``; ``delta`` is the cost of one checkpoint to training and
    ``M`` the mean time between failures, both in seconds. For ``delta << M`` this is Young's
    (1974) ``sqrt(2 delta M)``.
    """
    delta, mtbf = float(delta), float(mtbf)
    if not (math.isfinite(delta) and delta >= 0):
        raise ValueError(f"delta={delta!r} is invalid: pass the checkpoint cost in seconds, >= 0")
    if not (math.isfinite(mtbf) and mtbf > 0):
        raise ValueError(f"mtbf={mtbf!r} is invalid: pass the mean time between failures, > 0 s")
    if delta >= 2.0 * mtbf:
        return mtbf
    ratio = delta / (2.0 * mtbf)
    return math.sqrt(2.0 * delta * mtbf) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - delta


def optimal_interval(
    delta: float, mtbf: float, persist_seconds: float = 0.0, overhead_budget: float | None = None
) -> tuple[float, str]:
    """``(seconds, active_bound)``: the Young/Daly interval raised to the two floors.

    * ``"bandwidth"``: never shorter than ``persist_seconds`` (one checkpoint's bytes over the
      measured bandwidth), so a save finishes persisting before the next one starts;
    * ``"overhead_budget"``: never shorter than ``delta / overhead_budget``, so checkpoint cost
      stays within that fraction of the interval (``None`` disables it);
    * otherwise ``"young_daly"``. On a tie the Young/Daly value is reported.
    """
    tau = young_daly_interval(delta, mtbf)
    persist = float(persist_seconds)
    if not (math.isfinite(persist) and persist >= 0):
        raise ValueError(f"persist_seconds={persist_seconds!r} is invalid: pass seconds >= 0")
    candidates = [(tau, "young_daly"), (persist, "bandwidth")]
    if overhead_budget is not None:
        if not 0 < overhead_budget <= 1:
            raise ValueError(
                f"overhead_budget={overhead_budget!r} is invalid: pass a fraction in (0, 1], "
                f"e.g. 0.01 for 1%, or None for no budget"
            )
        candidates.append((float(delta) / overhead_budget, "overhead_budget"))
    best = candidates[0]
    for value, name in candidates[1:]:
        if value > best[0]:
            best = (value, name)
    return best


@dataclass
class FailureHistory:
    """Failures seen by a job across its restarts, for an MTBF estimate.

    JSON-safe through ``to_dict``/``from_dict`` so the store can keep it in a small file under
    the checkpoint root.
    """

    failure_times: list[float] = field(default_factory=list)
    """Wall-clock time (Unix seconds) of each observed failure, in the order recorded."""
    uptime_seconds: float = 0.0
    """Total time the job was observed running, over all its runs."""

    @property
    def num_failures(self) -> int:
        return len(self.failure_times)

    def record_failure(self, wall_time: float) -> None:
        self.failure_times.append(float(wall_time))

    def add_uptime(self, seconds: float) -> None:
        if seconds > 0:
            self.uptime_seconds += float(seconds)

    def mtbf(self, prior_seconds: float, prior_weight: float = 1.0) -> float:
        """Posterior MTBF: ``(w * M_prior + uptime) / (w + num_failures)``.

        This is the reciprocal of the posterior mean failure rate under a
        ``Gamma(shape=w, rate=w * M_prior)`` prior on the rate, i.e. the prior counts as ``w``
        failures seen over ``w * M_prior`` seconds. With no history it is ``M_prior``; with
        much history it tends to ``uptime / num_failures``.
        """
        if not prior_seconds > 0:
            raise ValueError(f"prior_seconds={prior_seconds!r} is invalid: pass an MTBF > 0 s")
        if not prior_weight > 0:
            raise ValueError(f"prior_weight={prior_weight!r} is invalid: pass a weight > 0")
        return (prior_weight * prior_seconds + self.uptime_seconds) / (prior_weight + self.num_failures)

    def to_dict(self) -> dict[str, Any]:
        return {"version": 1, "failure_times": list(self.failure_times), "uptime_seconds": self.uptime_seconds}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FailureHistory":
        """Inverse of ``to_dict``; raises ``ValueError`` naming the bad field."""
        if not isinstance(data, dict) or data.get("version") != 1:
            raise ValueError(f"failure history {data!r} is not version 1: expected {{'version': 1, ...}}")
        times, uptime = data.get("failure_times", []), data.get("uptime_seconds", 0.0)
        if not isinstance(times, list) or not all(isinstance(t, (int, float)) for t in times):
            raise ValueError(f"failure history field failure_times={times!r} must be a list of numbers")
        if not isinstance(uptime, (int, float)) or uptime < 0:
            raise ValueError(f"failure history field uptime_seconds={uptime!r} must be a number >= 0")
        return cls(failure_times=[float(t) for t in times], uptime_seconds=float(uptime))


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


@dataclass(frozen=True)
class Interval:
    """A parsed checkpoint interval: ``kind`` is ``"auto"``, ``"steps"`` (``steps`` set) or
    ``"seconds"`` (``seconds`` set). :meth:`parse` is the one parser of interval strings."""

    kind: str
    steps: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str | int) -> "Interval":
        """``"auto"``; a whole number of steps >= 1 (``"50"``, or the int ``50`` from TOML); or
        a duration > 0 with a unit (``"500ms"``, ``"30sec"``, ``"5m"``, ``"1.5h"``, ``"1d"``;
        see :func:`parse_duration`). Case and surrounding spaces do not matter. Raises
        ``ValueError`` naming the value and the accepted forms."""
        if isinstance(text, bool):
            raise ValueError(f"invalid checkpoint interval {text!r}: pass {INTERVAL_FORMS}")
        raw = str(text).strip()
        if raw.lower() == "auto":
            return cls("auto")
        if re.fullmatch(r"[0-9]+", raw):
            if int(raw) < 1:
                raise ValueError(f"invalid checkpoint interval {text!r}: a step count must be >= 1; "
                                 f"pass {INTERVAL_FORMS}")
            return cls("steps", steps=int(raw))
        parts = _split_duration(raw)
        if parts is not None and parts[1]:  # a bare number means steps, never seconds
            seconds = parse_duration(raw)
            if seconds > 0:
                return cls("seconds", seconds=seconds)
        raise ValueError(f"invalid checkpoint interval {text!r}: pass {INTERVAL_FORMS}")

    def policy(self, **auto_options: Any) -> CadencePolicy:
        """The policy for this interval; ``auto_options`` go to :class:`Auto` only."""
        if self.kind == "steps":
            return EverySteps(self.steps)
        if self.kind == "seconds":
            return EverySeconds(self.seconds)
        return Auto(**auto_options)


def parse_interval(text: str | int, **auto_options: Any) -> CadencePolicy:
    """Policy for an interval string (:meth:`Interval.parse`): ``"auto"`` ->
    ``Auto(**auto_options)``, ``"50"`` -> ``EverySteps(50)``, ``"300s"`` / ``"5m"`` ->
    ``EverySeconds``. ``auto_options`` are used only for ``"auto"``."""
    return Interval.parse(text).policy(**auto_options)
