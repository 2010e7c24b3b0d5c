"""The Young/Daly model: the checkpoint interval that maximises goodput, and its MTBF input.

:func:`young_daly_interval` and :func:`optimal_interval` turn the cost of one checkpoint and
the mean time between failures into an interval; :class:`FailureHistory` estimates that MTBF
from the failures a job has seen. Used by the ``Auto`` cadence (:mod:`ckpt.cadence.policies`) and by
``ckpt plan`` (:mod:`ckpt.cadence.plan`). Formulas and sources: docs/cadence.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["young_daly_interval", "optimal_interval", "FailureHistory"]


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
    goodput: dict[str, Any] = field(default_factory=dict)
    """The job's goodput ledger as :meth:`ckpt.cadence.goodput.GoodputLedger.to_dict` wrote
    it, carried as is (that class reads and checks it); empty: none yet."""

    @property
    def num_failures(self) -> int:
        return len(self.failure_times)

    def record_failure(self, wall_time: float) -> None:
        self.failure_times.append(float(wall_time))

    def retract_last_failure(self, since: float) -> bool:
        """Take back the newest failure when it was recorded at ``since`` (Unix time) or
        later: a start counted as a failure that turned out not to be one of this history's
        class (a two-tier job's restart that the local tier survived is no node loss).
        Returns whether one was taken back."""
        if self.failure_times and self.failure_times[-1] >= since:
            self.failure_times.pop()
            return True
        return False

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
        out = {"version": 1, "failure_times": list(self.failure_times),
               "uptime_seconds": self.uptime_seconds}
        if self.goodput:  # optional: readers that predate it ignore the key
            out["goodput"] = dict(self.goodput)
        return out

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
        goodput = data.get("goodput", {})
        if not isinstance(goodput, dict):
            raise ValueError(f"failure history field goodput={goodput!r} must be an object")
        return cls(failure_times=[float(t) for t in times], uptime_seconds=float(uptime),
                   goodput=goodput)
