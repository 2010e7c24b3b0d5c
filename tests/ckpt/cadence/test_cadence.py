"""Cadence policies: decisions over simulated steps and clocks, Young/Daly, bounds, parsing."""

from __future__ import annotations

import json
import math

import pytest

from ckpt.cadence import CadencePolicy, FailureHistory, Interval, parse_interval
from ckpt.cadence.interval import INTERVAL_FORMS
from ckpt.cadence.policies import Auto, CadenceBase, EverySeconds, EverySteps
from ckpt.cadence.young_daly import optimal_interval, young_daly_interval
from ckpt.units import parse_duration

# Hand-computed: delta = 2 s, M = 10000 s -> sqrt(2 * 2 * 10000) = 200, sqrt(delta/2M) = 0.01,
# delta/18M = 1/90000; 200 * (1 + 0.01/3 + 1/90000) - 2 = 198.668888...
YD_2_10000 = 200 * (1 + 0.01 / 3 + 1 / 90000) - 2


def run(policy: CadencePolicy, num_steps: int, step_seconds: float = 1.0, save_if=lambda step: True):
    """Drive ``policy`` like a training loop; return the steps at which saves were started."""
    saved = []
    now = 1000.0
    policy.should_save(0, now)  # sets the clock origin, as the loop's first check would
    for step in range(1, num_steps + 1):
        now += step_seconds
        policy.record_step(step_seconds)
        if policy.should_save(step, now) and save_if(step):
            policy.record_saved(step, now)
            saved.append(step)
    return saved


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize("text,seconds", [("300", 300), ("300s", 300), ("5m", 300), ("1.5h", 5400),
                                          ("250ms", 0.25), ("2d", 172800), (" 10 min ", 600), ("0", 0),
                                          ("30sec", 30), ("30 SEC", 30), ("1e3ms", 1)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "5x", "-5s", "1.5.h", "5 m s"])
def test_parse_duration_errors_name_value_and_units(text):
    with pytest.raises(ValueError) as err:
        parse_duration(text)
    assert repr(text) in str(err.value) and "5m" in str(err.value)


def test_parse_interval_forms():
    assert isinstance(parse_interval("auto"), Auto)
    assert isinstance(parse_interval(" AUTO "), Auto)
    steps = parse_interval("50")
    assert isinstance(steps, EverySteps) and steps.num_steps == 50
    for text, seconds in [("300s", 300), ("5m", 300), ("1.5h", 5400)]:
        policy = parse_interval(text)
        assert isinstance(policy, EverySeconds) and policy.seconds == pytest.approx(seconds)


def test_parse_interval_passes_options_to_auto_only():
    auto = parse_interval("auto", mtbf_seconds=3600.0, overhead_budget=0.02)
    assert auto.mtbf_seconds == 3600.0 and auto.overhead_budget == 0.02
    assert isinstance(parse_interval("50", mtbf_seconds=3600.0), EverySteps)


@pytest.mark.parametrize("text", ["", "0", "0s", "-5", "1.5", "5x", "auto2", "every 5m", "5 steps", "1w"])
def test_parse_interval_errors_name_value_and_forms(text):
    with pytest.raises(ValueError) as err:
        parse_interval(text)
    message = str(err.value)
    assert repr(text) in message and "'auto'" in message and "'50'" in message and "'5m'" in message
    assert INTERVAL_FORMS in message and "\n" not in message


# The union of every spelling any part of the project accepted: the config, the library and the
# CLI all parse through Interval.parse / parse_duration.
SPELLINGS = [
    ("auto", Interval("auto")), (" Auto ", Interval("auto")), ("50", Interval("steps", steps=50)),
    (50, Interval("steps", steps=50)), ("500ms", Interval("seconds", seconds=0.5)),
    ("300s", Interval("seconds", seconds=300.0)), ("30sec", Interval("seconds", seconds=30.0)),
    ("5m", Interval("seconds", seconds=300.0)), ("5min", Interval("seconds", seconds=300.0)),
    ("1.5h", Interval("seconds", seconds=5400.0)), ("1H", Interval("seconds", seconds=3600.0)),
    ("1d", Interval("seconds", seconds=86400.0)), ("2.5 s", Interval("seconds", seconds=2.5)),
]


@pytest.mark.parametrize("text,expected", SPELLINGS)
def test_every_interval_spelling_parses_to_its_policy(text, expected):
    assert Interval.parse(text) == expected
    policy = parse_interval(text)
    kind = {"auto": Auto, "steps": EverySteps, "seconds": EverySeconds}[expected.kind]
    assert type(policy) is kind
    if expected.kind == "steps":
        assert policy.num_steps == expected.steps
    if expected.kind == "seconds":
        assert policy.seconds == pytest.approx(expected.seconds)
        assert parse_duration(str(text)) == pytest.approx(expected.seconds)


@pytest.mark.parametrize("text,expected", [(t, e) for t, e in SPELLINGS if isinstance(t, str)])
def test_checkpoint_manager_accepts_every_interval_spelling(tmp_path, text, expected):
    from ckpt.job import CheckpointManager

    with CheckpointManager(str(tmp_path / "root"), cadence=text, retention=[]) as mgr:
        assert isinstance(mgr.cadence, CadencePolicy)
        assert getattr(mgr.cadence, "seconds", None) == expected.seconds
        assert getattr(mgr.cadence, "num_steps", None) == expected.steps


# ---------------------------------------------------------------- fixed policies


def test_every_steps_saves_on_multiples():
    assert run(EverySteps(50), 200) == [50, 100, 150, 200]


def test_every_steps_retries_a_skipped_save_and_counts_from_the_last_one():
    busy = {50, 51}  # the caller skipped these (previous save still persisting)
    assert run(EverySteps(50), 160, save_if=lambda s: s not in busy) == [52, 102, 152]


def test_every_steps_after_resume_counts_from_restored_step():
    policy = EverySteps(50)
    policy.record_saved(137, 0.0)
    assert not policy.should_save(186, 1.0) and policy.should_save(187, 1.0)


def test_every_seconds_over_simulated_clock():
    # 7 s steps, 30 s interval: due at the first step >= 30 s after the last save.
    assert run(EverySeconds(30.0), 20, step_seconds=7.0) == [5, 10, 15, 20]


def test_fixed_policies_describe_is_json_safe():
    policy = EverySteps(10)
    assert policy.describe()["interval_seconds"] is None
    policy.record_step(0.5)
    d = policy.describe()
    assert (d["policy"], d["interval_steps"], d["interval_seconds"], d["active_bound"]) == (
        "every_steps", 10, 5.0, "fixed")
    json.dumps(d, allow_nan=False)
    d = EverySeconds(60).describe()
    assert d["interval_seconds"] == 60 and d["interval_steps"] is None
    json.dumps(d, allow_nan=False)


@pytest.mark.parametrize("make", [lambda: EverySteps(0), lambda: EverySteps(2.5), lambda: EverySeconds(0),
                                  lambda: EverySeconds(float("nan"))])
def test_fixed_policy_validation(make):
    with pytest.raises(ValueError, match="invalid"):
        make()


def test_policies_satisfy_protocol():
    for policy in (EverySteps(1), EverySeconds(1), Auto()):
        assert isinstance(policy, CadencePolicy)
    # Only a step-count decision is the same on every rank without communication.
    assert EverySteps(1).deterministic and not EverySeconds(1).deterministic and not Auto().deterministic


SHIPPED = [lambda: EverySteps(3), lambda: EverySeconds(30.0), lambda: Auto(initial_steps=2),
           lambda: parse_interval("30sec"), lambda: parse_interval("auto")]


@pytest.mark.parametrize("make", SHIPPED)
def test_every_shipped_policy_implements_the_whole_protocol(make):
    policy = make()
    assert isinstance(policy, CadencePolicy) and isinstance(policy, CadenceBase)
    # Every member is called directly: a caller never needs hasattr.
    assert isinstance(policy.deterministic, bool) and isinstance(policy.history, FailureHistory)
    assert policy.should_save(0, 100.0) is False
    policy.record_step(1.5)
    policy.record_saved(1, 101.5)
    policy.record_save(0.25, 2.0, 1000, slowdown_seconds=0.0)
    policy.record_failure(1.7e9)
    described = policy.describe()
    assert described["policy"] == policy.name and json.loads(json.dumps(described)) == described
    # Uptime is the step time plus the stall, counted once, in the policy's history.
    assert policy.history.uptime_seconds == pytest.approx(1.75)
    assert policy.history.failure_times == [1.7e9]


def test_history_is_replaceable_by_the_jobs_shared_one():
    shared = FailureHistory(uptime_seconds=10.0)
    for policy in (EverySteps(3), EverySeconds(30.0), Auto()):
        policy.history = shared
        policy.record_step(2.0)
    assert shared.uptime_seconds == pytest.approx(16.0)


def test_a_policy_must_decide_and_describe():
    class NoDecision(CadenceBase):
        def describe(self):
            return {}

    with pytest.raises(TypeError, match="should_save"):
        NoDecision()


def test_manager_shares_its_history_with_every_policy_and_counts_uptime_once(tmp_path):
    import time

    import torch

    from ckpt.job import CheckpointManager

    for i, policy in enumerate((EverySteps(100), EverySeconds(3600.0), Auto(initial_steps=100))):
        with CheckpointManager(str(tmp_path / str(i)), cadence=policy, retention=[]) as mgr:
            assert mgr.cadence.history is mgr.history
            t0 = time.monotonic()
            for step in range(1, 4):
                assert not mgr.maybe_save(step, {"w": torch.ones(1)})
                if step < 3:
                    time.sleep(0.1)
            spanned = time.monotonic() - t0
            # Two gaps of at least 0.1 s between the three calls, within the time the calls
            # spanned; counted twice it would be about twice the gaps, more than that span.
            assert 0.19 <= mgr.history.uptime_seconds <= spanned, (mgr.history.uptime_seconds,
                                                                   spanned)


# ---------------------------------------------------------------- formulas


def test_young_daly_hand_computed():
    assert young_daly_interval(2.0, 10000.0) == pytest.approx(YD_2_10000, rel=1e-12)
    assert young_daly_interval(0.0, 100.0) == 0.0
    assert young_daly_interval(300.0, 100.0) == 100.0  # delta >= 2M -> M
    # delta << M: Young's sqrt(2 delta M)
    assert young_daly_interval(1e-3, 1e6) == pytest.approx(math.sqrt(2e3), rel=1e-4)


@pytest.mark.parametrize("delta,mtbf", [(-1, 10), (1, 0), (1, -5), (float("inf"), 10), (1, float("nan"))])
def test_young_daly_validation(delta, mtbf):
    with pytest.raises(ValueError, match="invalid"):
        young_daly_interval(delta, mtbf)


def test_optimal_interval_reports_each_bound():
    assert optimal_interval(2.0, 10000.0) == (pytest.approx(YD_2_10000), "young_daly")
    assert optimal_interval(2.0, 10000.0, persist_seconds=500.0) == (500.0, "bandwidth")
    assert optimal_interval(2.0, 10000.0, overhead_budget=0.001) == (pytest.approx(2000.0), "overhead_budget")
    # Both floors: the larger one wins.
    assert optimal_interval(2.0, 10000.0, 500.0, 0.002) == (pytest.approx(1000.0), "overhead_budget")
    assert optimal_interval(2.0, 10000.0, 1500.0, 0.002) == (1500.0, "bandwidth")
    # A budget that does not bind leaves Young/Daly active.
    assert optimal_interval(2.0, 10000.0, overhead_budget=0.5)[1] == "young_daly"


@pytest.mark.parametrize("budget", [0, -0.1, 1.5])
def test_optimal_interval_budget_validation(budget):
    with pytest.raises(ValueError, match="overhead_budget"):
        optimal_interval(1.0, 100.0, overhead_budget=budget)


# ---------------------------------------------------------------- failure history


def test_failure_history_posterior_mtbf_and_round_trip():
    history = FailureHistory()
    assert history.mtbf(86400.0) == 86400.0
    history.add_uptime(3 * 3600.0)
    history.record_failure(1.7e9)
    history.record_failure(1.7e9 + 3600)
    # (w * M0 + uptime) / (w + n) = (2 * 86400 + 10800) / (2 + 2)
    assert history.mtbf(86400.0, prior_weight=2.0) == pytest.approx((2 * 86400 + 10800) / 4)
    restored = FailureHistory.from_dict(json.loads(json.dumps(history.to_dict())))
    assert restored == history and restored.num_failures == 2


@pytest.mark.parametrize("data", [{}, {"version": 2}, {"version": 1, "failure_times": "x"},
                                  {"version": 1, "uptime_seconds": -1}, []])
def test_failure_history_from_dict_errors(data):
    with pytest.raises(ValueError):
        FailureHistory.from_dict(data)


# ---------------------------------------------------------------- Auto


def test_auto_initial_interval_before_any_measurement():
    assert run(Auto(initial_steps=20, initial_seconds=None), 45)[:2] == [20, 40]
    assert run(Auto(initial_seconds=30.0), 12, step_seconds=7.0)[:1] == [5]
    assert Auto(initial_steps=20).describe()["active_bound"] == "initial"
    with pytest.raises(ValueError, match="initial"):
        Auto(initial_steps=None, initial_seconds=None)


def test_auto_hand_computed_interval_in_seconds_and_steps():
    policy = Auto(mtbf_seconds=10000.0, initial_steps=5)
    for _ in range(3):
        policy.record_step(0.5)
    policy.record_saved(5, 100.0)
    policy.record_save(stall_seconds=1.5, persist_seconds=4.0, num_bytes=4_000_000_000, slowdown_seconds=0.5)
    d = policy.describe()
    # delta = stall + slowdown = 2 s; the prior has only a few seconds of uptime added.
    mtbf = 10000.0 + 3 * 0.5 + 1.5
    expected = young_daly_interval(2.0, mtbf)
    assert expected == pytest.approx(YD_2_10000, rel=1e-3)
    assert d["active_bound"] == "young_daly"
    assert d["interval_seconds"] == pytest.approx(expected)
    assert d["interval_steps"] == math.ceil(expected / 0.5)
    assert d["inputs"]["checkpoint_cost_seconds"] == 2.0
    assert d["inputs"]["bandwidth_bytes_per_second"] == pytest.approx(1e9)
    assert d["inputs"]["persist_seconds"] == pytest.approx(4.0)
    assert d["inputs"]["mtbf_seconds"] == pytest.approx(mtbf)
    json.dumps(d, allow_nan=False)
    steps = d["interval_steps"]
    assert not policy.should_save(5 + steps - 1, 1e9) and policy.should_save(5 + steps, 0.0)


def test_auto_bandwidth_bound_active_and_reported():
    policy = Auto(mtbf_seconds=10000.0)
    policy.record_step(1.0)
    policy.record_save(stall_seconds=2.0, persist_seconds=500.0, num_bytes=500 * 10**8)
    d = policy.describe()
    assert d["active_bound"] == "bandwidth"
    assert d["interval_seconds"] == pytest.approx(500.0) and d["interval_steps"] == 500


def test_auto_overhead_budget_bound_active_and_reported():
    policy = Auto(mtbf_seconds=10000.0, overhead_budget=0.001)
    policy.record_step(1.0)
    policy.record_save(stall_seconds=2.0, persist_seconds=1.0, num_bytes=10**9)
    d = policy.describe()
    assert d["active_bound"] == "overhead_budget"
    assert d["interval_seconds"] == pytest.approx(2000.0) and d["interval_steps"] == 2000
    assert d["inputs"]["overhead_budget"] == 0.001


def test_auto_retunes_as_measurements_change():
    policy = Auto(mtbf_seconds=10000.0, smoothing=0.5)
    policy.record_step(1.0)
    policy.record_save(2.0, 1.0, 10**9)
    first = policy.describe()["interval_seconds"]
    policy.record_save(8.0, 1.0, 10**9)  # EWMA: 2 + 0.5 * (8 - 2) = 5 s
    assert policy.describe()["inputs"]["checkpoint_cost_seconds"] == pytest.approx(5.0)
    second = policy.describe()["interval_seconds"]
    assert second == pytest.approx(young_daly_interval(5.0, policy.mtbf())) and second > first
    # Storage slows down: persist time grows past Young/Daly and the floor takes over.
    for _ in range(20):
        policy.record_save(5.0, 2000.0, 10**9)
    d = policy.describe()
    assert d["active_bound"] == "bandwidth" and d["interval_seconds"] == pytest.approx(2000.0, rel=1e-3)
    # Faster steps mean more steps per interval, once the next save starts.
    for _ in range(50):
        policy.record_step(0.25)
    policy.record_saved(100, 0.0)
    assert policy.describe()["interval_steps"] == pytest.approx(8000, rel=1e-3)


def test_auto_failures_shorten_the_interval():
    history = FailureHistory(uptime_seconds=0.0)
    policy = Auto(mtbf_seconds=86400.0, history=history)
    policy.record_step(1.0)
    policy.record_save(10.0, 1.0, 10**9)
    before = policy.describe()["interval_seconds"]
    for t in range(3):
        policy.record_failure(1.7e9 + t)
    d = policy.describe()
    assert d["inputs"]["num_failures"] == 3 and history.num_failures == 3
    assert d["inputs"]["mtbf_seconds"] == pytest.approx((86400.0 + 11.0) / 4)
    assert d["interval_seconds"] == pytest.approx(young_daly_interval(10.0, (86400.0 + 11.0) / 4))
    assert d["interval_seconds"] < before


def test_auto_decides_in_seconds_until_a_step_time_is_known():
    policy = Auto(mtbf_seconds=10000.0)
    policy.record_saved(0, 0.0)
    policy.record_save(2.0, 1.0, 10**9)
    assert policy.describe()["interval_steps"] is None
    assert not policy.should_save(10**6, 198.0) and policy.should_save(1, 199.0)


@pytest.mark.parametrize("kwargs", [dict(mtbf_seconds=0), dict(overhead_budget=2.0), dict(prior_weight=0),
                                    dict(smoothing=0), dict(initial_steps=0), dict(initial_seconds=-1)])
def test_auto_validation(kwargs):
    with pytest.raises(ValueError, match="invalid"):
        Auto(**kwargs)


def test_auto_record_save_validation():
    with pytest.raises(ValueError, match="stall_seconds"):
        Auto().record_save(-1.0, 1.0, 10)
