"""The exporter alone: series from start-up, counting that means what it says, start-up state
from the store, one port per local rank, and the docs' own-loop recipe on two real ranks."""

from __future__ import annotations

import math
import re
import time
import urllib.request
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

from ckpt.dcp import api
from ckpt.events import EventBus
from ckpt.root import CheckpointStore
from monitoring import Metrics, local_port
from monitoring.metrics import DEFAULT_HOST, FAILURE_KINDS, COPY_OUTCOMES, SAVE_OUTCOMES, TIERS
from tests.dist import free_port, run_ranks
from trainer.config import MetricsConfig

ROOT = Path(__file__).resolve().parents[2]


# Read at each scrape, not moved by events: the hardware and the goodput ledger's live time.
_LIVE = ("train_device_memory_", "train_host_memory_", "train_memory_", "train_gpu_",
         "train_goodput_")


def _samples(metrics: Metrics, live: bool = True) -> dict[tuple[str, tuple], float]:
    """Every sample served; ``live=False`` leaves out those read at each scrape."""
    from prometheus_client import generate_latest

    out = {}
    for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        if not live and fam.name.startswith(_LIVE):
            continue
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


_TIERED = ("ckpt_saves_total", "ckpt_save_stall_seconds", "ckpt_last_committed_step",
            "ckpt_last_commit_timestamp_seconds")


def _value(metrics: Metrics, name: str, **labels: str) -> float:
    """A sample's value; a series with a ``tier`` label is the durable tier's unless told."""
    labels.setdefault("rank", metrics.rank)
    if name.startswith(_TIERED):
        labels.setdefault("tier", "durable")
    return _samples(metrics)[(name, tuple(sorted(labels.items())))]


def test_every_series_exists_before_the_first_event():
    m = Metrics(rank=3)
    s = _samples(m)
    for tier in TIERS:
        t = (("rank", "3"), ("tier", tier))
        for outcome in SAVE_OUTCOMES:
            assert s[("ckpt_saves_total", (("outcome", outcome), *t))] == 0
        assert s[("ckpt_save_stall_seconds_count", t)] == 0
        assert s[("ckpt_last_committed_step", t)] == -1
        assert abs(s[("ckpt_last_commit_timestamp_seconds", t)] - time.time()) < 60
    for kind in FAILURE_KINDS:
        assert s[("train_failures_total", (("kind", kind), ("rank", "3")))] == 0
    for name in ("ckpt_storage_retries_total", "ckpt_load_fallbacks_total",
                 "ckpt_lease_lost_total", "ckpt_retention_failures_total",
                 "ckpt_retention_deleted_total", "ckpt_loads_total", "train_resumes_total"):
        assert s[(name, (("rank", "3"),))] == 0, name
    for name in ("ckpt_save_persist_seconds_count", "train_step_seconds_count"):
        assert s[(name, (("rank", "3"),))] == 0, name
    r = (("rank", "3"),)
    assert s[("train_last_step_timestamp_seconds", r)] == s[
        ("train_process_start_timestamp_seconds", r)]
    assert s[("ckpt_age_limit_seconds", r)] == math.inf  # interval unknown: never pages
    assert s[("train_stall_threshold_seconds", r)] == 900.0  # startup allowance
    for outcome in COPY_OUTCOMES:
        assert s[("ckpt_peer_copies_total", (("outcome", outcome), *r))] == 0
    assert s[("ckpt_peer_copied_bytes_total", r)] == 0
    assert s[("ckpt_peer_copy_lag_seconds", r)] == 0
    assert s[("ckpt_peer_copied_step", r)] == -1


def test_stall_threshold_follows_the_typical_step_and_stays_below_the_watchdog():
    bus = EventBus()
    m = Metrics(bus, stall_factor=10, stall_min_seconds=2, stall_max_seconds=60,
                startup_seconds=300)
    for step in range(1, 30):
        bus.emit("train_step", step, loss=1.0, step_seconds=1.0)
    assert _value(m, "train_step_seconds_typical") == 1.0
    assert _value(m, "train_stall_threshold_seconds") == 10.0
    for step in range(30, 80):
        bus.emit("train_step", step, loss=1.0, step_seconds=0.01)
    assert _value(m, "train_stall_threshold_seconds") == 2.0  # the floor
    for step in range(80, 200):
        bus.emit("train_step", step, loss=1.0, step_seconds=30.0)
    assert _value(m, "train_stall_threshold_seconds") == 60.0  # the watchdog's cap
    m.allow_grace(3600)  # a blocking save: the watchdog allows it, so does the alert
    assert _value(m, "train_stall_threshold_seconds") == 3660.0
    bus.emit("train_step", 200, loss=1.0, step_seconds=30.0)
    assert _value(m, "train_stall_threshold_seconds") == 60.0


def test_watchdog_grace_reaches_the_stall_threshold():
    from trainer.faults import HangWatchdog

    m = Metrics(startup_seconds=100)
    wd = HangWatchdog(0, on_grace=m.allow_grace)
    wd.grace_seconds = 120.0  # warm-up, as the trainer sets it
    assert _value(m, "train_stall_threshold_seconds") == 220.0
    wd.progress()
    assert _value(m, "train_stall_threshold_seconds") == 100.0


def test_expected_interval_and_age_limit_from_the_cadence_or_the_step_time():
    bus = EventBus()
    m = Metrics(bus, age_slack_seconds=5)
    bus.emit("cadence", None, interval_steps=50, interval_seconds=None, policy="fixed")
    assert _value(m, "ckpt_age_limit_seconds") == math.inf  # steps known, step time not
    bus.emit("train_step", 1, loss=1.0, step_seconds=0.2)
    assert _value(m, "ckpt_interval_seconds") == 10.0
    assert _value(m, "ckpt_age_limit_seconds") == 3 * 10.0 + 5
    bus.emit("cadence", None, interval_steps=None, interval_seconds=7.0, policy="fixed")
    assert _value(m, "ckpt_age_limit_seconds") == 3 * 7.0 + 5


def test_one_skip_per_skipped_save_not_per_busy_step():
    bus = EventBus()
    m = Metrics(bus)
    bus.emit("cadence", None, interval_steps=10, interval_seconds=5.0)
    # A time cadence: every step after the interval is due while step 10's save persists.
    for step in range(20, 29):
        bus.emit("save_skipped", step, reason="previous save in flight", in_flight_step=10)
    assert _value(m, "ckpt_saves_total", outcome="skipped") == 1
    # Still busy one interval later: a second save could not be made.
    for step in range(30, 33):
        bus.emit("save_skipped", step, reason="previous save in flight", in_flight_step=10)
    assert _value(m, "ckpt_saves_total", outcome="skipped") == 2
    bus.emit("save_staged", 33, stall_seconds=0.1, bytes=1)
    bus.emit("save_skipped", 34, reason="previous save in flight", in_flight_step=33)
    bus.emit("save_skipped", 35, reason="lease lost")
    assert _value(m, "ckpt_saves_total", outcome="skipped") == 4


def test_retries_counted_from_failed_and_committed_saves_once_each():
    bus = EventBus(rank=1)
    m = Metrics(bus, rank=1)
    # The events carry the save's retries so far (cumulative).
    bus.emit("save_failed", 10, outcome="retrying", final=False, retries=2)
    bus.emit("save_failed", 10, outcome="retrying", final=False, retries=5)
    bus.emit("save_failed", 10, outcome="failed", final=True, retries=6)
    assert _value(m, "ckpt_storage_retries_total") == 6
    assert _value(m, "ckpt_saves_total", outcome="failed") == 1
    bus.emit("save_failed", 20, outcome="retrying", final=False, retries=1)
    bus.emit("save_committed", 20, retries=3, persist_seconds=1.0, bytes_per_second=1.0)
    assert _value(m, "ckpt_storage_retries_total") == 9
    bus.emit("save_failed", 30, outcome="abandoned", final=True, retries=0)
    assert _value(m, "ckpt_saves_total", outcome="failed") == 1  # shutdown, not a failure


def test_checkpoint_age_comes_from_the_store_at_start_up(tmp_path):
    root = str(tmp_path / "ckpt")
    api.save({"w": torch.ones(2)}, root, 7)
    api.save({"w": torch.ones(2)}, root, 9)
    created = CheckpointStore(root).latest(check="none").created_unix
    time.sleep(0.05)
    m = Metrics()
    m.observe_store(CheckpointStore(root))
    assert _value(m, "ckpt_last_committed_step") == 9
    assert _value(m, "ckpt_last_commit_timestamp_seconds") == created
    empty = Metrics()
    empty.observe_store(CheckpointStore(str(tmp_path / "none")))  # no checkpoint: unchanged
    assert _value(empty, "ckpt_last_committed_step") == -1
    # A fresh start over damaged checkpoints un-commits them: none is committed any more,
    # and the series says so instead of keeping the step read at start-up.
    assert sorted(s for s, _, exc in CheckpointStore(root).life.uncommit_newer(-1) if exc is None) \
        == [7, 9]
    m.observe_store(CheckpointStore(root))
    assert _value(m, "ckpt_last_committed_step") == -1
    assert _value(m, "ckpt_last_commit_timestamp_seconds") == m.start_time


def test_serve_binds_the_config_default_and_local_rank_ports(monkeypatch):
    assert DEFAULT_HOST == MetricsConfig().host
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_port(9109) == 9112
    assert local_port(0) == 0


def _docs_recipe(rank: int, world_size: int, base: int) -> str:
    """Runs the docs' own-loop snippet as written (only the port number replaced)."""
    import torch.distributed as dist

    text = (ROOT / "docs" / "monitoring.md").read_text()
    snippet = re.search(r"In your own loop.*?```python\n(.*?)```", text, re.S).group(1)
    snippet = snippet.replace("9109", str(base))

    class Manager:
        events = EventBus(rank=rank)

    scope = {"mgr": Manager(), "dist": dist}
    exec(snippet, scope)  # noqa: S102 - the documented recipe, from our own docs
    Manager.events.emit("train_step", 5 + rank, loss=1.0, step_seconds=0.1)
    dist.barrier()  # both ranks serve now
    pages = []
    for r in range(world_size):
        with urllib.request.urlopen(f"http://127.0.0.1:{base + r}/metrics", timeout=5) as f:
            pages.append(f.read().decode())
    dist.barrier()
    scope["metrics"].shutdown()
    return pages[rank]


def test_docs_own_loop_recipe_serves_every_rank():
    base = free_port()
    while True:  # two consecutive free ports
        try:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", base + 1))
            break
        except OSError:
            base = free_port()
    pages = run_ranks(_docs_recipe, 2, base, timeout=120)
    for rank, page in enumerate(pages):
        assert f'train_step{{rank="{rank}"}} {5 + rank}.0' in page, page[:2000]


_HANG_CHILD = """
import sys, time
from ckpt.events import EventBus
from monitoring import Metrics
from trainer.faults import HangWatchdog
bus = EventBus()
m = Metrics(bus)
port = m.serve(0, "127.0.0.1")
print(port, flush=True)
HangWatchdog(0.5, on_hang=lambda idle: bus.emit("failure", 7, failure="hang"),
             exit_code=124, linger_seconds=LINGER).start()
time.sleep(60)
"""


def test_hang_count_is_scrapable_before_the_watchdog_exits():
    """The watchdog keeps the process up ``linger_seconds`` after counting the hang."""
    import subprocess
    import sys

    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _HANG_CHILD.replace("LINGER", "3.0")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    try:
        port = int(proc.stdout.readline())
        deadline = time.monotonic() + 30
        seen = False
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as f:
                    page = f.read().decode()
            except OSError:
                break
            if 'train_failures_total{kind="hang",rank="0"} 1.0' in page:
                seen = True
                break
            time.sleep(0.1)
        assert seen, "the hang count was never served"
        assert proc.wait(timeout=30) == 124
    finally:
        if proc.poll() is None:
            proc.kill()


def test_event_log_is_strict_json_with_non_finite_numbers_as_strings(tmp_path):
    from ckpt.events import JsonlEventLog

    path = tmp_path / "events.jsonl"
    bus = EventBus()
    bus.subscribe(JsonlEventLog(str(path)))
    bus.emit("train_step", 1, loss=math.nan, grad_norm=math.inf, extra={"x": [-math.inf, 1.5]})

    def reject(token):
        raise ValueError(f"non-strict JSON token {token}")

    import json

    (line,) = path.read_text().splitlines()
    ev = json.loads(line, parse_constant=reject)
    assert (ev["loss"], ev["grad_norm"], ev["extra"]) == ("NaN", "Infinity",
                                                          {"x": ["-Infinity", 1.5]})
    assert math.isnan(float(ev["loss"])) and float(ev["extra"]["x"][0]) == -math.inf


def test_local_tier_saves_have_their_own_series_and_never_feed_the_durable_ones(tmp_path):
    from ckpt.job import ManagerOptions, TieredCheckpointManager

    bus = EventBus(rank=0)
    m = Metrics(bus, rank=0)
    assert _value(m, "ckpt_last_committed_step", tier="local") == -1
    state = {"w": torch.zeros(4), "step": 0}
    with TieredCheckpointManager(str(tmp_path / "durable"), str(tmp_path / "local"),
                                 ManagerOptions(busy="wait"), cadence="4", local_cadence="1",
                                 events=bus) as mgr:
        for step in range(1, 6):
            state["w"].add_(1)
            state["step"] = step
            mgr.maybe_save(step, state)
        mgr.wait()
    assert _value(m, "ckpt_saves_total", tier="local", outcome="committed") == 5
    assert _value(m, "ckpt_last_committed_step", tier="local") == 5
    assert _value(m, "ckpt_save_stall_seconds_count", tier="local") == 5
    assert _value(m, "ckpt_saves_total", outcome="committed") == 1  # step 4 only
    assert _value(m, "ckpt_last_committed_step") == 4
    assert _value(m, "ckpt_save_stall_seconds_count") == 1
    assert _value(m, "ckpt_saves_total", tier="local", outcome="failed") == 0
    assert not [name for name, _ in _samples(m) if name.startswith("ckpt_local_")]


def test_local_tier_events_feed_only_the_local_series():
    """Each save event of the local tier (``local_<kind>``) moves its ``tier="local"`` series;
    no durable series and nothing the alerts read moves."""
    bus = EventBus(rank=0)
    m = Metrics(bus, rank=0)
    before = _samples(m, live=False)
    bus.emit("local_save_staged", 3, tier="local", stall_seconds=0.5, bytes=10)
    bus.emit("local_save_committed", 3, tier="local", outcome="committed", retries=4,
             persist_seconds=1.0, bytes_per_second=10.0)
    bus.emit("local_save_failed", 4, tier="local", outcome="failed", final=True, retries=2)
    bus.emit("local_save_skipped", 5, tier="local", reason="previous save in flight")
    bus.emit("local_save_skipped", 6, tier="local", reason="previous save in flight")
    bus.emit("local_lease_lost", None, tier="local", reason="taken over")
    bus.emit("local_retention_failed", 2, tier="local", error="denied")
    after = _samples(m, live=False)
    moved = {key for key in after if after[key] != before.get(key)}
    assert moved and all(dict(labels).get("tier") == "local" for _, labels in moved), moved
    local = dict(tier="local")
    assert _value(m, "ckpt_saves_total", outcome="committed", **local) == 1
    assert _value(m, "ckpt_saves_total", outcome="failed", **local) == 1
    assert _value(m, "ckpt_saves_total", outcome="skipped", **local) == 2  # one per step
    assert _value(m, "ckpt_save_stall_seconds_sum", **local) == 0.5
    assert _value(m, "ckpt_last_committed_step", **local) == 3


def test_background_cpu_of_each_save_by_phase(tmp_path):
    from ckpt.events import SAVE_COST_PHASES
    from ckpt.job import CheckpointManager, ManagerOptions

    bus = EventBus(rank=0)
    m = Metrics(bus, rank=0)
    for phase in SAVE_COST_PHASES:
        assert _value(m, "ckpt_save_cpu_seconds_total", phase=phase) == 0
    state = {"w": torch.randn(256, 256), "step": 0}
    with CheckpointManager(str(tmp_path / "root"), ManagerOptions(busy="wait"), cadence="2",
                           events=bus) as mgr:
        for step in range(1, 5):
            state["step"] = step
            mgr.maybe_save(step, state)
        mgr.wait()
    assert _value(m, "ckpt_save_background_cpu_seconds_count") == 2
    assert _value(m, "ckpt_save_background_cpu_seconds_sum") > 0
    for phase in ("plan", "write", "commit"):
        assert _value(m, "ckpt_save_cpu_seconds_total", phase=phase) > 0, phase


def test_run_end_and_lease_loss_are_series_with_their_time():
    """A run that ended normally and a lost lease are exported with when they happened (0
    before), so the rules can read them after the process left."""
    bus = EventBus()
    m = Metrics(bus)
    assert _value(m, "train_completed_timestamp_seconds") == 0
    assert _value(m, "ckpt_lease_lost_timestamp_seconds") == 0
    bus.emit("run_ended", 10, exit_code=4)
    assert _value(m, "train_completed_timestamp_seconds") == 0  # not a normal end
    bus.emit("lease_lost", 10, reason="taken over")
    lost = _value(m, "ckpt_lease_lost_timestamp_seconds")
    assert abs(lost - time.time()) < 5 and _value(m, "ckpt_lease_lost_total") == 1
    done = Metrics(bus := EventBus())
    bus.emit("run_ended", 12, exit_code=0)
    assert abs(_value(done, "train_completed_timestamp_seconds") - time.time()) < 5


def test_shutdown_lingers_serving_the_last_state():
    bus = EventBus()
    m = Metrics(bus)
    port = m.serve(0, "127.0.0.1")
    bus.emit("run_ended", 3, exit_code=0)
    import threading

    t0 = time.monotonic()
    stopper = threading.Thread(target=m.shutdown, kwargs={"linger_seconds": 1.5})
    stopper.start()
    served = 0.0
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as f:
                assert "train_completed_timestamp_seconds" in f.read().decode()
            served = time.monotonic() - t0
        except OSError:
            break
        time.sleep(0.05)
    stopper.join()
    assert 1.3 <= served < 5


def test_copies_on_the_next_node_feed_their_own_series():
    """``copy_<outcome>`` events (a node's first rank, ``local_copies=2``): the copies
    by outcome, their bytes, the newest copy's lag and step; nothing a tier's series reads."""
    bus = EventBus(rank=0)
    m = Metrics(bus, rank=0)
    before = _samples(m, live=False)
    bus.emit("copy_committed", 4, peer_node=1, bytes=1000, seconds=0.2, lag_seconds=0.5)
    bus.emit("copy_committed", 6, peer_node=1, bytes=3000, seconds=0.4, lag_seconds=0.75)
    bus.emit("copy_failed", 8, node=0, peer_node=1, error="checksum mismatch")
    bus.emit("copy_skipped", 10, reason="a newer local step is queued")
    bus.emit("copy_restored", 6, peer_node=1, bytes=3000, seconds=0.3)
    after = _samples(m, live=False)
    moved = {name for name, labels in after if after[(name, labels)] != before.get((name, labels))}
    assert moved == {"ckpt_peer_copies_total", "ckpt_peer_copied_bytes_total",
                     "ckpt_peer_copy_lag_seconds", "ckpt_peer_copied_step"}, moved
    for outcome, n in (("committed", 2), ("failed", 1), ("skipped", 1), ("restored", 1)):
        assert _value(m, "ckpt_peer_copies_total", outcome=outcome) == n
    assert _value(m, "ckpt_peer_copied_bytes_total") == 4000
    assert _value(m, "ckpt_peer_copy_lag_seconds") == 0.75
    assert _value(m, "ckpt_peer_copied_step") == 6
