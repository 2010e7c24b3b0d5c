"""Metrics scraped by a real Prometheus server; alert rules and dashboard queries checked by it.

Beside the exporter, Prometheus scrapes a recorded dcgm-exporter exposition
(``fixtures/dcgm_exporter.prom``: two H100s of one host) served from loopback, as an
operator runs dcgm-exporter beside the job. The exporter's rank is given that host's first
GPU (a recorded NVML reading: no GPU here), so the rules' joins of dcgm-exporter's series
with the rank's (on the GPU's UUID) and every dashboard panel that reads them return data.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from ckpt.events import EventBus
from monitoring import Metrics
from monitoring.hardware import GpuReading
from tests.dist import free_port
from tests.monitoring.test_rules import alert_names, dashboard_exprs, recorded_names

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "monitoring" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "monitoring" / "grafana" / "dashboard.json"
DCGM = Path(__file__).parent / "fixtures" / "dcgm_exporter.prom"
DCGM_GPU = {"Hostname": "gpu-node-0", "gpu": "0",  # the fixture's first GPU
            "UUID": "GPU-4f1a9c2e-7b3d-4e8a-9c61-2d5e8f0a1b37",
            "modelName": "NVIDIA H100 80GB HBM3"}


class RecordedGpu:
    """A GPU source (``monitoring.hardware.GpuSource``) replaying one NVML reading of the
    fixture's first GPU."""

    identity = DCGM_GPU

    def read(self) -> GpuReading:
        return GpuReading(temperature_celsius=64.0, power_watts=612.3, utilization_ratio=0.97,
                          memory_used_bytes=71459 * 2**20)


class _Exposition(http.server.BaseHTTPRequestHandler):
    body = DCGM.read_bytes()

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):  # quiet
        pass


def _need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{binary} is not installed; scripts/test.sh installs Debian's "
                        "'prometheus' as root")
        pytest.skip(f"{binary} not installed (sudo apt-get install prometheus)")
    return path


def _query(port: int, expr: str) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


@pytest.fixture
def prometheus(tmp_path):
    """A Prometheus server on loopback scraping one exporter every second."""
    binary = _need("prometheus")
    bus = EventBus(rank=0)
    metrics = Metrics(bus, rank=0, gpu=RecordedGpu())
    exporter_port = metrics.serve(0, "127.0.0.1")
    dcgm = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Exposition)
    threading.Thread(target=dcgm.serve_forever, daemon=True).start()
    prom_port = free_port()
    rules = tmp_path / "alerts.yml"
    shutil.copy(ALERTS, rules)
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files: ['{rules}']\n"
        "scrape_configs:\n  - job_name: train\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{exporter_port}']\n"
        "  - job_name: dcgm\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{dcgm.server_address[1]}']\n")
    proc = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/-/ready", timeout=1)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("prometheus did not start: "
                                       + proc.stderr.read().decode()[-2000:])
                time.sleep(0.2)
        yield bus, prom_port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        metrics.shutdown()
        dcgm.shutdown()
        dcgm.server_close()


def _wait_value(port: int, expr: str, want: float, timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        result = _query(port, expr)["data"]["result"]
        if result:
            last = float(result[0]["value"][1])
            if last == want:
                return last
        time.sleep(0.5)
    raise AssertionError(f"{expr} = {last}, expected {want}")


def test_prometheus_scrapes_checkpoint_and_training_metrics(prometheus):
    bus, port = prometheus
    bus.emit("train_step", 41, loss=2.5, grad_norm=1.0, tokens_per_second=1000.0,
             step_seconds=0.1)
    bus.emit("save_staged", 40, stall_seconds=0.02, bytes=1 << 20, first=True)
    bus.emit("save_committed", 40, persist_seconds=0.5, total_seconds=0.52, bytes=1 << 20,
             bytes_per_second=2.0 * (1 << 20), retries=2)
    bus.emit("save_skipped", 42, reason="previous save in flight")
    bus.emit("failure", 43, failure="nan")
    _wait_value(port, 'ckpt_last_committed_step{job="train",tier="durable"}', 40)
    _wait_value(port, 'ckpt_last_committed_step{job="train",tier="local"}', -1)
    _wait_value(port, 'ckpt_saves_total{tier="durable",outcome="committed"}', 1)
    _wait_value(port, 'ckpt_saves_total{tier="durable",outcome="skipped"}', 1)
    _wait_value(port, "ckpt_storage_retries_total", 2)
    _wait_value(port, "train_step", 41)
    _wait_value(port, 'train_failures_total{kind="nan"}', 1)
    age = float(_query(port, 'time() - ckpt_last_commit_timestamp_seconds{tier="durable"}')
                ["data"]["result"][0]["value"][1])
    assert 0 <= age < 60


def _alerts(port: int) -> dict[str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/alerts", timeout=5) as r:
        return {a["labels"]["alertname"]: a["state"] for a in json.load(r)["data"]["alerts"]}


def _wait_alert(port: int, name: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _alerts(port).get(name)
        if state in ("pending", "firing"):
            return state
        time.sleep(0.5)
    raise AssertionError(f"{name} did not fire within {timeout}s: {_alerts(port)}")


def test_every_dashboard_query_returns_data_from_a_fresh_exporter(prometheus):
    """Every series exists from start-up: no panel is empty before the first event."""
    _, port = prometheus
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules", timeout=5) as r:
        groups = json.load(r)["data"]["groups"]
    names = {rule["name"] for g in groups for rule in g["rules"]}
    assert set(alert_names()) | recorded_names() == names
    _wait_value(port, "count(up == 1)", 2)  # the exporter and dcgm-exporter
    _wait_value(port, 'count(train_rank:dcgm_gpu_temperature_celsius{job="train"})', 1)
    time.sleep(3)  # a few scrapes, so that rate() has two samples
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    for expr in exprs:
        expr = expr.replace("$__rate_interval", "1m").replace("$job", ".*")
        out = _query(port, expr)
        assert out["status"] == "success", expr
        assert out["data"]["result"], f"no data: {expr}"
    assert not _alerts(port), "a fresh exporter must not page"


def test_dcgm_exporter_series_join_the_rank_of_their_gpu(prometheus):
    """dcgm-exporter's series of the rank's GPU carry the rank's labels (job, instance,
    rank) and dcgm-exporter's names of the GPU; its other GPU, which no rank uses, joins
    nothing; the exporter's own NVML series agree with the recorded reading."""
    _, port = prometheus
    temp = 'train_rank:dcgm_gpu_temperature_celsius{job="train"}'
    _wait_value(port, f"count({temp})", 1)
    (sample,) = _query(port, temp)["data"]["result"]
    labels = sample["metric"]
    assert float(sample["value"][1]) == 64.0  # the fixture's GPU 0, not GPU 1's 83
    assert labels["rank"] == "0" and labels["job"] == "train"
    assert {k: labels[k] for k in DCGM_GPU} == DCGM_GPU
    for name, want in (("train_rank:dcgm_power_watts", 612.348),
                       ("train_rank:dcgm_fb_used_bytes", 71459 * 2**20),
                       ("train_rank:dcgm_fb_total_bytes", (71459 + 9186) * 2**20),
                       ("train_rank:dcgm_nvlink_bytes_per_second", 118734529536 + 118802857984),
                       ("train_rank:dcgm_pcie_bytes_per_second", 1123456789 + 2234567890)):
        _wait_value(port, f'{name}{{job="train",rank="0"}}', want)
    _wait_value(port, 'train_gpu_known{job="train"}', 1)
    _wait_value(port, 'train_gpu_temperature_celsius{job="train"}', 64.0)
    _wait_value(port, 'count(DCGM_FI_DEV_GPU_TEMP{job="dcgm"})', 2)


def test_a_single_event_fires_its_alert(prometheus):
    """Counters start at 0, so one failed save, one lost lease, one NaN step page."""
    bus, port = prometheus
    _wait_value(port, 'ckpt_saves_total{tier="durable",outcome="failed"}', 0)
    bus.emit("save_failed", 10, outcome="failed", final=True, retries=2)
    bus.emit("lease_lost", None, reason="taken over")
    bus.emit("failure", 11, failure="nan")
    for name in ("CheckpointSaveFailures", "CheckpointLeaseLost", "TrainingLossNotFinite"):
        _wait_alert(port, name)


def test_local_tier_events_are_the_local_series_and_page_nothing(prometheus):
    """The local tier's failed and skipped saves and long stalls land in the same series
    with ``tier="local"``; no checkpoint alert reads them."""
    bus, port = prometheus
    _wait_value(port, 'ckpt_saves_total{tier="local",outcome="failed"}', 0)
    for step in range(1, 6):
        bus.emit("local_save_staged", step, tier="local", stall_seconds=30.0, bytes=1)
        bus.emit("local_save_failed", step, tier="local", outcome="failed", final=True)
        bus.emit("local_save_skipped", step, tier="local", reason="previous save in flight")
    bus.emit("local_save_committed", 7, tier="local", outcome="committed")
    _wait_value(port, 'ckpt_saves_total{tier="local",outcome="failed"}', 5)
    _wait_value(port, 'ckpt_saves_total{tier="local",outcome="skipped"}', 5)
    _wait_value(port, 'ckpt_last_committed_step{tier="local"}', 7)
    _wait_value(port, 'ckpt_save_stall_seconds_count{tier="local"}', 5)
    _wait_value(port, 'ckpt_saves_total{tier="durable",outcome="failed"}', 0)
    _wait_value(port, 'ckpt_last_committed_step{tier="durable"}', -1)
    _wait_value(port, 'count(ckpt_saves_total)', 6)  # 3 outcomes x 2 tiers, no twin series
    time.sleep(5)  # several rule evaluations
    assert not _alerts(port), _alerts(port)
