"""What a trainer says last is served for at least one scrape interval (15 s) before it
leaves: its normal end (``train_completed_timestamp_seconds``), and a lost lease
(``ckpt_lease_lost_timestamp_seconds``, then exit 4). Real one-process trainer runs,
their endpoint polled four times a second; the rules that read these series are checked at
a 15 s scrape interval by ``monitoring/prometheus/alerts_test.yml`` (test_rules.py).
"""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

from tests.dist import free_port
from tests.e2e._jobs import ROOT, Job, base_env, trainer_argv

pytestmark = pytest.mark.slow

SCRAPE_INTERVAL = 15.0  # the example prometheus.yml's, and metrics.linger_seconds' default
POLL = 0.25
FAULTY = ROOT / "tests" / "e2e" / "_faulty_storage.py"


def _served_after(job: Job, port: int, series: str, timeout: float) -> float:
    """Seconds the endpoint served ``series`` > 0 (first poll that saw it to the last poll
    that answered), while ``job`` runs."""
    pattern = re.compile(rf"^{series}\{{rank=\"0\"\}} (\S+)$", re.M)
    first = last = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as f:
                page = f.read().decode()
        except OSError:
            if first is not None or job.proc.poll() is not None:
                break
            time.sleep(POLL)
            continue
        m = pattern.search(page)
        if m and float(m.group(1)) > 0:
            now = time.monotonic()
            first = now if first is None else first
            last = now
        time.sleep(POLL)
    assert first is not None, f"{series} never served above 0\n{job.tails()}"
    return last - first


@pytest.mark.parametrize("case", ["completed", "lease_lost"])
def test_last_state_is_served_one_scrape_interval(tmp_path, case):
    port = free_port()
    args = ["--checkpoint.interval=2", "--checkpoint.async_save=false",
            f"--checkpoint.root={tmp_path / 'ckpt'}", f"--metrics.port={port}",
            "--metrics.host=127.0.0.1"]
    if case == "completed":
        job = Job(trainer_argv(*args, "--training.steps=6"), tmp_path, case)
        series, code = "train_completed_timestamp_seconds", 0
    else:
        job = Job(trainer_argv(*args, "--training.steps=100000", script=FAULTY), tmp_path, case,
                  env=base_env(E2E_STEAL_LEASE_AT_STEP="4"))
        series, code = "ckpt_lease_lost_timestamp_seconds", 4
    try:
        served = _served_after(job, port, series, timeout=180)
        assert job.wait(60) == code, job.tails()
    finally:
        job.kill_all()
    assert served >= SCRAPE_INTERVAL - 2 * POLL, f"{series} served {served:.1f}s only"
