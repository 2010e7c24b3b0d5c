"""Monte-Carlo model of a checkpointed job under random failures.

The model is the one Daly (2006) solves exactly, so the simulator and
:func:`expected_wall_time` can be checked against each other:

* the job needs ``work_seconds`` of computation, split into segments of ``interval_seconds``
  (the last one may be shorter); every segment is followed by a blocking checkpoint of
  ``checkpoint_seconds``; the segment's work is safe once its checkpoint completes;
* failures arrive as a Poisson process of rate ``1 / mtbf_seconds`` in wall time and can hit
  anywhere: during computation, during a checkpoint, or during a restart;
* after a failure the job spends ``restart_seconds`` restarting and then resumes from the end of
  the last completed checkpoint (a failure during the restart starts the restart over).

The failure process is drawn once per run and shared by every interval in one call (common
random numbers), so costs of different intervals are compared on the same failure histories and
the differences between them are far less noisy than the costs themselves.

Reference: J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart
dumps", Future Generation Computer Systems 22 (2006) 303-312.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["SimulationResult", "simulate", "simulate_many", "expected_wall_time", "empirical_optimum"]

_GAP_BLOCK = 64  # failure inter-arrival times drawn per run at a time


@dataclass(frozen=True)
class SimulationResult:
    """Summary of ``num_runs`` simulated runs of one job at one checkpoint interval."""

    interval_seconds: float
    num_runs: int
    mean_wall_seconds: float
    """Mean wall time to finish the job, failures, checkpoints and restarts included."""
    stderr_wall_seconds: float
    """Standard error of ``mean_wall_seconds``."""
    mean_wasted_seconds: float
    """Mean wall time not spent on first-time useful work (``wall - work``)."""
    mean_failures: float
    """Mean number of failures per run."""


def _check(name: str, value: float, *, positive: bool) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        need = "a finite number > 0" if positive else "a finite number >= 0"
        raise ValueError(f"{name}={value!r} is invalid: pass {need}")
    return value


def expected_wall_time(
    work_seconds: float,
    checkpoint_seconds: float,
    restart_seconds: float,
    mtbf_seconds: float,
    interval_seconds: float,
) -> float:
    """Exact expected wall time of the job described in the module docstring.

    One segment of ``x`` seconds of work takes ``M e^{R/M} (e^{(x + delta)/M} - 1)`` in
    expectation (Daly 2006, the per-segment term of his exact expression
    ``T = M e^{R/M} (e^{(tau + delta)/M} - 1) W / tau``); the job is ``floor(W/tau)`` full
    segments plus one shorter segment for the remainder, if any.
    """
    work = _check("work_seconds", work_seconds, positive=True)
    delta = _check("checkpoint_seconds", checkpoint_seconds, positive=False)
    restart = _check("restart_seconds", restart_seconds, positive=False)
    mtbf = _check("mtbf_seconds", mtbf_seconds, positive=True)
    tau = _check("interval_seconds", interval_seconds, positive=True)

    def segment(x: float) -> float:
        return mtbf * math.exp(restart / mtbf) * math.expm1((x + delta) / mtbf)

    num_full, remainder = _split(work, tau)
    return num_full * segment(tau) + (segment(remainder) if remainder > 0 else 0.0)


def _split(work: float, tau: float) -> tuple[int, float]:
    """Number of full segments and the leftover work (0 when ``tau`` divides ``work``)."""
    num_full = math.floor(work / tau + 1e-9)
    remainder = work - num_full * tau
    if remainder <= 1e-9 * work:
        remainder = 0.0
    return num_full, remainder


def simulate_many(
    work_seconds: float,
    checkpoint_seconds: float,
    restart_seconds: float,
    mtbf_seconds: float,
    intervals: Sequence[float],
    *,
    num_runs: int = 2000,
    seed: int = 0,
) -> np.ndarray:
    """Wall times of ``num_runs`` runs at each interval: an array of shape
    ``(len(intervals), num_runs)``. Run ``i`` sees the same failure times at every interval.

    Deterministic for a given ``seed``. Cost is about ``len(intervals) * num_runs`` times the
    largest number of failures in any run (``~ wall / mtbf``), in numpy.
    """
    work = _check("work_seconds", work_seconds, positive=True)
    delta = _check("checkpoint_seconds", checkpoint_seconds, positive=False)
    restart = _check("restart_seconds", restart_seconds, positive=False)
    mtbf = _check("mtbf_seconds", mtbf_seconds, positive=True)
    taus = np.array([_check("interval_seconds", t, positive=True) for t in intervals], dtype=float)
    if num_runs < 1:
        raise ValueError(f"num_runs={num_runs!r} is invalid: pass at least 1")
    if taus.size == 0:
        raise ValueError("intervals is empty: pass at least one interval in seconds")

    splits = [_split(work, t) for t in taus]
    # Segment k (0-based) of the job is full length unless it is the last one.
    num_segments = np.array([n + (1 if r > 0 else 0) for n, r in splits], dtype=np.int64)[:, None]
    last_length = np.array([(r if r > 0 else t) + delta for (_, r), t in zip(splits, taus)])[:, None]
    length = (taus + delta)[:, None]

    rng = np.random.default_rng(seed)
    shape = (taus.size, num_runs)
    done_segments = np.zeros(shape, dtype=np.int64)
    wall = np.full(shape, np.nan)
    gap_start = np.zeros(num_runs)  # wall time of the failure that opened the current gap
    gaps = rng.exponential(mtbf, size=(_GAP_BLOCK, num_runs))
    k = 0
    while True:
        if k and k % _GAP_BLOCK == 0:  # blocks are drawn in order, so run i's history is fixed
            gaps = rng.exponential(mtbf, size=(_GAP_BLOCK, num_runs))
        gap = gaps[k % _GAP_BLOCK]
        lost_to_restart = 0.0 if k == 0 else restart
        available = (gap - lost_to_restart)[None, :]
        need = (num_segments - done_segments - 1) * length + last_length
        running = np.isnan(wall)
        finished_now = running & (available >= need)
        wall = np.where(finished_now, gap_start[None, :] + lost_to_restart + need, wall)
        running &= ~finished_now
        if not running.any():
            break
        progress = np.floor(np.maximum(available, 0.0) / length).astype(np.int64)
        done_segments = np.where(running, done_segments + progress, done_segments)
        gap_start = gap_start + gap
        k += 1
    return wall


def simulate(
    work_seconds: float,
    checkpoint_seconds: float,
    restart_seconds: float,
    mtbf_seconds: float,
    interval_seconds: float,
    *,
    num_runs: int = 2000,
    seed: int = 0,
) -> SimulationResult:
    """Simulate ``num_runs`` runs of the job at one checkpoint interval and summarise them."""
    wall = simulate_many(
        work_seconds, checkpoint_seconds, restart_seconds, mtbf_seconds, [interval_seconds],
        num_runs=num_runs, seed=seed,
    )[0]
    # Failures are not tracked per run; in this model a run's failures are the Poisson
    # arrivals before it ends, whose expectation is wall / mtbf.
    return SimulationResult(
        interval_seconds=float(interval_seconds),
        num_runs=num_runs,
        mean_wall_seconds=float(wall.mean()),
        stderr_wall_seconds=float(wall.std(ddof=1) / math.sqrt(num_runs)) if num_runs > 1 else 0.0,
        mean_wasted_seconds=float(wall.mean() - work_seconds),
        mean_failures=float(wall.mean() / mtbf_seconds),
    )


def empirical_optimum(
    checkpoint_seconds: float,
    mtbf_seconds: float,
    *,
    restart_seconds: float = 0.0,
    work_seconds: float | None = None,
    num_runs: int = 4000,
    num_points: int = 25,
    span: float = 2.5,
    seed: int = 0,
) -> float:
    """The checkpoint interval (seconds) that minimises the simulated expected wall time.

    Scans ``num_points`` intervals on a log grid from ``tau0 / span`` to ``tau0 * span`` around
    Young's first-order guess ``tau0 = sqrt(2 delta M)`` (capped below ``M``), simulates every
    interval on the same ``num_runs`` failure histories, fits the mean wall time per unit of
    work with ``c0/tau + c1 + c2 tau + c3 tau^2 + c4 tau^3`` by least squares (the expansion of
    the exact cost to third order) and returns the fitted curve's minimum on the grid's range.
    The curve is flat near its minimum, so a fit over a wide range locates it far more precisely
    than the raw arg-min of noisy samples. ``work_seconds`` defaults to ``20 * mtbf``.
    """
    delta = _check("checkpoint_seconds", checkpoint_seconds, positive=True)
    mtbf = _check("mtbf_seconds", mtbf_seconds, positive=True)
    if span <= 1:
        raise ValueError(f"span={span!r} is invalid: pass a factor > 1")
    if num_points < 6:
        raise ValueError(f"num_points={num_points!r} is invalid: pass at least 6 to fit 5 terms")
    work = 20.0 * mtbf if work_seconds is None else float(work_seconds)
    center = min(math.sqrt(2.0 * delta * mtbf), mtbf / span)
    taus = np.geomspace(center / span, center * span, num_points)
    wall = simulate_many(work, delta, restart_seconds, mtbf, taus, num_runs=num_runs, seed=seed)
    cost = wall.mean(axis=1) / work

    def basis(t: np.ndarray) -> np.ndarray:
        x = t / center  # scaled so the least-squares system is well conditioned
        return np.stack([1.0 / x, np.ones_like(x), x, x**2, x**3], axis=1)

    coef, *_ = np.linalg.lstsq(basis(taus), cost, rcond=None)
    fine = np.geomspace(taus[0], taus[-1], 4001)
    return float(fine[np.argmin(basis(fine) @ coef)])
