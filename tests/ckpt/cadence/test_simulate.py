"""The Monte-Carlo simulator against Daly's exact expectation, and Auto against its optimum."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ckpt.cadence.policies import Auto
from ckpt.cadence.young_daly import young_daly_interval
from ckpt.cadence.simulate import empirical_optimum, expected_wall_time, simulate, simulate_many


def daly_exact(work, delta, restart, mtbf, tau):
    """Daly (2006): T = M e^{R/M} (e^{(tau + delta)/M} - 1) W / tau, for W a multiple of tau."""
    return mtbf * math.exp(restart / mtbf) * math.expm1((tau + delta) / mtbf) * work / tau


def test_expected_wall_time_is_dalys_formula_for_whole_segments():
    assert expected_wall_time(1000.0, 5.0, 30.0, 400.0, 50.0) == pytest.approx(daly_exact(1000, 5, 30, 400, 50))


def test_expected_wall_time_adds_a_short_last_segment():
    full = expected_wall_time(100.0, 5.0, 30.0, 400.0, 50.0)
    short = 400.0 * math.exp(30 / 400) * math.expm1((20 + 5) / 400)
    assert expected_wall_time(120.0, 5.0, 30.0, 400.0, 50.0) == pytest.approx(full + short)


def test_without_failures_wall_time_is_work_plus_checkpoints():
    # MTBF so long that no run fails: 10 segments of 10 s each plus 10 checkpoints of 1 s.
    result = simulate(100.0, 1.0, 5.0, 1e15, 10.0, num_runs=50)
    assert result.mean_wall_seconds == pytest.approx(110.0)
    assert result.mean_wasted_seconds == pytest.approx(10.0)


@pytest.mark.parametrize(
    "work,delta,restart,mtbf,tau",
    [
        (20000.0, 1.0, 10.0, 1000.0, 40.0),     # delta/M = 1e-3, near the optimum
        (20000.0, 50.0, 250.0, 1000.0, 300.0),  # delta/M = 0.05, near the optimum
        (20000.0, 50.0, 250.0, 1000.0, 900.0),  # far above the optimum: many failed segments
        (5000.0, 10.0, 0.0, 1000.0, 70.0),      # work not a multiple of tau: short last segment
        (3000.0, 500.0, 500.0, 1000.0, 600.0),  # delta/M = 0.5: failures during checkpoints dominate
    ],
)
def test_simulator_agrees_with_daly_exact_expectation(work, delta, restart, mtbf, tau):
    result = simulate(work, delta, restart, mtbf, tau, num_runs=8000, seed=1)
    expected = expected_wall_time(work, delta, restart, mtbf, tau)
    assert abs(result.mean_wall_seconds - expected) < 4 * result.stderr_wall_seconds
    assert result.mean_wall_seconds == pytest.approx(expected, rel=0.02)
    assert result.mean_failures > 0


def test_simulation_is_deterministic_and_shares_failures_across_intervals():
    a = simulate_many(10000.0, 2.0, 10.0, 1000.0, [30.0, 60.0], num_runs=300, seed=7)
    b = simulate_many(10000.0, 2.0, 10.0, 1000.0, [60.0], num_runs=300, seed=7)
    assert a.shape == (2, 300)
    np.testing.assert_array_equal(a[1], b[0])  # run i sees the same failures at any interval
    assert not np.array_equal(a, simulate_many(10000.0, 2.0, 10.0, 1000.0, [30.0, 60.0], num_runs=300, seed=8))


@pytest.mark.parametrize("ratio", [1e-4, 1e-3, 1e-2, 0.05])
def test_auto_interval_within_5_percent_of_simulated_optimum(ratio):
    mtbf = 3600.0
    delta = ratio * mtbf
    restart = 5 * delta  # restart cost shifts the wall time, not the optimum
    # Auto, fed one measured checkpoint costing delta with no bandwidth floor and no budget.
    auto = Auto(mtbf_seconds=mtbf, prior_weight=1e12)  # prior dominates the few seconds of uptime
    auto.record_save(stall_seconds=delta, persist_seconds=0.0, num_bytes=0)
    tau_auto = auto.describe()["interval_seconds"]
    assert auto.describe()["active_bound"] == "young_daly"
    assert tau_auto == pytest.approx(young_daly_interval(delta, mtbf), rel=1e-9)

    tau_sim = empirical_optimum(delta, mtbf, restart_seconds=restart, num_runs=4000, seed=0)
    assert tau_auto == pytest.approx(tau_sim, rel=0.05)

    # The exact optimum of Daly's expectation solves (tau + delta)/M = -ln(1 - tau/M).
    lo, hi = 1e-12, mtbf * (1 - 1e-12)
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (mid + delta) / mtbf + math.log1p(-mid / mtbf) > 0 else (lo, mid)
    assert tau_auto == pytest.approx(lo, rel=0.001)
    assert tau_sim == pytest.approx(lo, rel=0.05)


@pytest.mark.parametrize(
    "call",
    [
        lambda: simulate(0.0, 1.0, 1.0, 100.0, 10.0),
        lambda: simulate(100.0, -1.0, 1.0, 100.0, 10.0),
        lambda: simulate(100.0, 1.0, 1.0, 0.0, 10.0),
        lambda: simulate(100.0, 1.0, 1.0, 100.0, 0.0),
        lambda: simulate(100.0, 1.0, 1.0, 100.0, 10.0, num_runs=0),
        lambda: simulate_many(100.0, 1.0, 1.0, 100.0, []),
        lambda: empirical_optimum(1.0, 100.0, span=1.0),
        lambda: expected_wall_time(100.0, 1.0, float("nan"), 100.0, 10.0),
    ],
)
def test_validation(call):
    with pytest.raises(ValueError, match="invalid|empty"):
        call()
