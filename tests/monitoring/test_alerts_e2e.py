"""The shipped alert rules in a real Prometheus (1 s scrape) against real 2-rank trainer
runs with induced faults; every dashboard query returns data.

Three jobs run at once under one Prometheus, each its own scrape job with one target per
rank (``metrics.port + LOCAL_RANK``):

- ``nanhang``: the loss of one step is made NaN (``fault.inject_nan_step``) ->
  ``TrainingLossNotFinite``; then rank 1 is frozen with SIGSTOP -> ``TrainingStalled`` on
  rank 0 within its stall threshold and ``TrainingJobDown`` (pending) for rank 1.
- ``storage``: a finished run's newest checkpoint is corrupted, then the job resumes ->
  ``CheckpointLoadFellBack``; its checkpoint root is made unwritable (a symlink re-pointed at
  a file, as when a mount goes away) -> ``CheckpointSaveFailures`` and, 3 intervals plus the
  slack after the last commit, ``CheckpointTooOld``; then the job is killed ->
  ``TrainingJobDown`` (pending).
- ``done``: 3 short one-process runs in a row on one metrics port, each ending normally
  (exit 0, its completion served ``metrics.linger_seconds``; a run may end before its first
  scrape), then a 4th that trains on: 4 start times in a minute or two, and no
  ``TrainingRestartLoop``, which counts process starts less normal ends.
- ``hw``: DDP over 2 ranks, the trainer wrapped by ``tests/monitoring/_faulty_rank.py``:
  rank 1's link throttled (its all-reduces complete late on its side) ->
  ``CommBandwidthLow`` for rank 1 alone; rank 0 allocates memory and keeps it, at a pace
  that fills what its host has left within the hour -> ``MemoryHeadroomLow``
  (``memory="host"``, pending).

The ``nanhang`` job's hang watchdog (15 s) then catches rank 0 waiting for the frozen rank:
it counts the hang, keeps serving ``metrics.linger_seconds`` and exits ->
``TrainingFailures{kind="hang"}``.

A second test runs three more jobs under another Prometheus, two with the trainer wrapped by
``tests/e2e/_faulty_storage.py``:

- ``faults``: every data-file write fails 4 times with ECONNRESET before it succeeds (4
  counted retries per save and rank) -> ``CheckpointStorageRetries`` on each rank; every
  staging copy is 5.5 s slower -> ``CheckpointStallHigh`` (pending); saves due every second
  while the slow, retried one persists -> ``CheckpointSavesSkipped``; checkpoints cannot be
  deleted, ``keep_last=1`` -> ``CheckpointRetentionFailing``; then another job takes the
  write lease over -> ``CheckpointLeaseLost`` (the trainer exits 4 after serving its
  metrics ``metrics.linger_seconds``, 8 s here, so the loss is scraped first).
- ``loop``: every worker dies 3 s after its metrics endpoint is up, under torchrun with 3
  restarts -> ``TrainingRestartLoop`` on each rank.
- ``goodput``: ``bench/bench_goodput.py``'s job, rank 1 SIGKILLed twice at known times
  (torchrun restarts it, it resumes from its newest checkpoint): its exported breakdown
  agrees with the one computed from its raw event log within 2 points per category, and
  the lost time -> ``GoodputBelowTarget`` (pending).

The ``goodput`` job takes minutes (its rule pages once the job's first start-up is under a
tenth of its wall time): it and its Prometheus start before the first test's jobs (a module
fixture), whose minutes it overlaps.

When every job is stopped -> ``TrainingJobAbsent`` (pending).

A third test runs fault-tolerant replica groups (``trainer.ft``: a lighthouse and two groups
of one rank, their metrics ports one scrape job): one group's worker is SIGKILLed and not
restarted, the other trains on alone -> ``ReplicaQuorumBelowMinimum`` (pending); then the
lighthouse is SIGKILLed -> ``ReplicaLighthouseUnreachable`` (pending).

Every alert of the shipped file is brought to pending or firing. Rules are the shipped file
unchanged: thresholds come from the exporter's gauges, set small
through the metrics config keys; ``for:`` durations are met by "pending".

Jobs that train on while the tests wait for something else are paced (``PACED``: each step
sleeps a little), so that they leave the 2 cores to the start-ups being waited for.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.dist import free_port
from tests.e2e._jobs import TINY, Job, base_env, trainer_argv
from tests.monitoring.test_rules import dashboard_exprs

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "monitoring" / "prometheus" / "alerts.yml"
SCRAPE = 1.0
# Small, job-derived thresholds through the config (docs/monitoring.md, "Tuning").
STALL_MIN = 5.0
AGE_SLACK = 3.0
INTERVAL = 2.0  # checkpoint.interval of the storage job, seconds
HANG = 15.0  # the nanhang job's hang watchdog: it exits then, after the metrics linger
# Each step of a job that trains on sleeps this long (fault.inject_step_delay_seconds): the
# alerts here wait on time, not on steps, and a paced job leaves the CPU to the others.
PACED = "--fault.inject_step_delay_seconds=0.05"
ALERT_SLACK = 10.0  # scrape + evaluation + query latency on a loaded 2-core machine


def _port_pair() -> int:
    while True:
        base = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue


def _get(port: int, path: str, **params: str) -> dict:
    url = f"http://127.0.0.1:{port}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


class Prom:
    def __init__(self, tmp: Path, jobs: dict[str, int]):
        binary = shutil.which("prometheus")
        if binary is None:
            if os.environ.get("CI"):
                pytest.fail("prometheus is not installed; scripts/test.sh installs it as root")
            pytest.skip("prometheus not installed (sudo apt-get install prometheus)")
        self.port = free_port()
        scrape = "".join(
            f"  - job_name: {name}\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{base}', '127.0.0.1:{base + 1}']\n"
            for name, base in jobs.items())
        (tmp / "prometheus.yml").write_text(
            f"global:\n  scrape_interval: {SCRAPE:g}s\n  evaluation_interval: {SCRAPE:g}s\n"
            f"rule_files: ['{ALERTS}']\nscrape_configs:\n{scrape}")
        self.log = open(tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("prometheus did not start: "
                                       + (tmp / "prometheus.log").read_text()[-2000:])
                time.sleep(0.2)

    def query(self, expr: str) -> list[dict]:
        out = _get(self.port, "/api/v1/query", query=expr)
        assert out["status"] == "success", (expr, out)
        return out["data"]["result"]

    def alerts(self) -> list[dict]:
        return _get(self.port, "/api/v1/alerts")["data"]["alerts"]

    def wait_alert(self, name: str, within: float, **labels: str) -> float:
        """Seconds until alert ``name`` with ``labels`` is pending or firing."""
        t0 = time.monotonic()
        seen: list = []
        while time.monotonic() - t0 < within:
            seen = self.alerts()
            for a in seen:
                if a["labels"]["alertname"] == name and a["state"] in ("pending", "firing") \
                        and all(a["labels"].get(k) == v for k, v in labels.items()):
                    return time.monotonic() - t0
            time.sleep(0.25)
        raise AssertionError(f"{name} {labels} not pending/firing within {within:.0f}s; "
                             f"alerts: {[(a['labels'], a['state']) for a in seen]}")

    def wait_query(self, expr: str, within: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + within
        while True:
            result = self.query(expr)
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.25)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _metrics_args(base: int) -> list[str]:
    return [f"--metrics.port={base}", "--metrics.host=127.0.0.1",
            f"--metrics.stall_min_seconds={STALL_MIN}", f"--metrics.age_slack_seconds={AGE_SLACK}"]


def _committed_since(job: Job, since: int) -> dict:
    return job.wait_event(lambda e: e["kind"] == "save_committed", 120, "a commit", since=since)


class _RunsInARow(threading.Thread):
    """Launches ``argvs`` one after another, each but the last waited for and required to
    exit 0, the last left running; every launch goes into ``jobs`` (the test's cleanup
    list). :meth:`result` joins it, raises what a launch raised and returns the last
    launch; :meth:`stop` starts no further launch."""

    def __init__(self, argvs: list[list[str]], log_dir: Path, name: str, jobs: list[Job]):
        super().__init__(name=name, daemon=True)
        self.argvs, self.log_dir, self.jobs = argvs, log_dir, jobs
        self.launched: list[Job] = []  # its own (the shared list holds other jobs too)
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            for i, argv in enumerate(self.argvs):
                if self._halt.is_set():
                    return
                job = Job(argv, self.log_dir, f"{self.name}-{i}")
                self.jobs.append(job)
                self.launched.append(job)
                if i < len(self.argvs) - 1:
                    job.wait_ok(timeout=180)
        except BaseException as exc:  # noqa: BLE001 - re-raised by result()
            self.error = exc

    def stop(self) -> None:
        self._halt.set()

    def result(self, timeout: float) -> Job:
        self.join(timeout)
        assert not self.is_alive(), f"{self.name}: runs still going after {timeout:.0f}s"
        if self.error is not None:
            raise self.error
        return self.launched[-1]


def _leak_rate() -> float | None:
    """Bytes a second that fill what this host has left within 15 minutes (a 4x margin on
    the alert's hour, for the flat time the alert's 2-minute window still holds); None
    when that is more than a test should allocate (a host with much memory free)."""
    from monitoring.hardware import host_memory

    used, limit = host_memory()
    rate = 4 * (limit - used) / 3600
    return rate if rate <= 64e6 else None


def _dashboard_needs_dcgm(expr: str) -> bool:
    """Panels that join dcgm-exporter's series: test_prometheus.py serves a recorded
    exposition and a GPU identity for them; a CPU trainer has no GPU to join."""
    return "train_rank:dcgm_" in expr or "DCGM_" in expr


def test_every_fault_brings_its_alert(tmp_path, goodput_prom):
    # (goodput_prom: the next test's goodput job starts first and runs beside this test.)
    nan_base, storage_base, done_base = _port_pair(), _port_pair(), _port_pair()
    hw_base = _port_pair()
    prom = Prom(tmp_path, {"nanhang": nan_base, "storage": storage_base, "done": done_base,
                           "hw": hw_base})
    jobs: list[Job] = []
    leak = _leak_rate()
    # Job 3: 3 runs that end normally, then a 4th that trains on (no save due).
    done = _RunsInARow(
        [trainer_argv(f"--training.steps={steps}", f"--checkpoint.interval={steps}",
                      f"--checkpoint.root={tmp_path / f'done-ckpt-{i}'}",
                      f"--metrics.port={done_base}", "--metrics.host=127.0.0.1",
                      f"--metrics.linger_seconds={3 * SCRAPE:g}", PACED)
         for i, steps in enumerate([3, 3, 3, 1000000])], tmp_path, "done", jobs)
    try:
        done.start()
        # Job 4: rank 1's link throttled; rank 0 leaks memory 20 s after its metrics are up.
        hw = Job(trainer_argv("--training.steps=1000000", "--parallel.dp_mode=ddp",
                              f"--checkpoint.root={tmp_path / 'hw-ckpt'}",
                              *_metrics_args(hw_base), nproc=2, script=FAULTY_RANK),
                 tmp_path, "hw", env=base_env(
                     E2E_THROTTLE_RANK="1", E2E_THROTTLE_BYTES_PER_SECOND=str(THROTTLE),
                     **({} if leak is None else dict(
                         E2E_LEAK_RANK="0", E2E_LEAK_BYTES_PER_SECOND=str(leak),
                         E2E_LEAK_AFTER_SECONDS="20", E2E_LEAK_MAX_BYTES=str(int(leak * 90))))))
        jobs.append(hw)
        # Job 1 trains on, metrics on; its loss at step 60 becomes NaN.
        a_jsonl = tmp_path / "a.jsonl"
        a = Job(trainer_argv("--training.steps=1000000", "--fault.inject_nan_step=60",
                             f"--fault.hang_timeout_seconds={HANG:g}", PACED,
                             *_metrics_args(nan_base),
                             f"--metrics.jsonl_path={a_jsonl}", nproc=2),
                tmp_path, "nanhang", a_jsonl)
        jobs.append(a)
        # Job 2, first run: checkpoints 5, 10 and the final 12, under a root reached
        # through a symlink (re-pointed later to make it unwritable).
        real, link = tmp_path / "ckpt-real", tmp_path / "ckpt"
        real.mkdir()
        link.symlink_to(real)
        first = Job(trainer_argv("--training.steps=12", "--checkpoint.interval=5",
                                 "--checkpoint.keep_last=0", f"--checkpoint.root={link}",
                                 nproc=2), tmp_path, "storage-first")
        jobs.append(first)
        first.wait_ok(timeout=180)
        newest = sorted((real / "step_000000012").glob("*.bin"),
                        key=lambda p: -p.stat().st_size)[0]
        raw = bytearray(newest.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        newest.write_bytes(bytes(raw))

        # Job 2 resumes past the corrupt checkpoint, saving every 2 s (it starts up while
        # the hw job's alerts are waited for).
        b_jsonl = tmp_path / "b.jsonl"
        b = Job(trainer_argv("--training.steps=1000000", f"--checkpoint.interval={INTERVAL:g}s",
                             f"--checkpoint.root={link}", *_metrics_args(storage_base),
                             f"--metrics.jsonl_path={b_jsonl}", PACED, nproc=2),
                tmp_path, "storage", b_jsonl)
        jobs.append(b)

        # The throttled link: rank 1's all-reduce bandwidth, not rank 0's, far below the
        # job's median (pending: the rule's for: is 5 minutes).
        prom.wait_alert("CommBandwidthLow", 120, job="hw", rank="1", kind="all_reduce")
        assert not [a for a in prom.alerts() if a["labels"]["alertname"] == "CommBandwidthLow"
                    and a["labels"].get("rank") != "1"], prom.alerts()
        # The growing allocation: rank 0's host memory runs out within the hour at its pace.
        if leak is not None:
            prom.wait_alert("MemoryHeadroomLow", 180, job="hw", rank="0", memory="host")
        else:
            warnings.warn("MemoryHeadroomLow not brought: this host has too much memory free "
                          "for a test to fill a share of it within the hour")
        hw.kill_all()

        # NaN loss: the alert follows the bad step within a few scrapes.
        a.wait_event(lambda e: e["kind"] == "failure" and e["failure"] == "nan", 180, "NaN")
        prom.wait_alert("TrainingLossNotFinite", ALERT_SLACK, job="nanhang")

        # Corrupt newest checkpoint: the resume falls back, the alert fires.
        b.wait_event(lambda e: e["kind"] == "load_fallback", 180, "a load fallback")
        b.wait_event(lambda e: e["kind"] == "resumed" and e["step"] == 10, 60, "resume at 10")
        prom.wait_alert("CheckpointLoadFellBack", ALERT_SLACK + 5, job="storage")
        _committed_since(b, b.last_index + 1)

        # Every dashboard query returns data, per-rank panels for both ranks.
        time.sleep(3 * SCRAPE)
        for expr in dashboard_exprs():
            if _dashboard_needs_dcgm(expr):
                continue
            expr = expr.replace("$__rate_interval", "1m").replace("$job", ".*")
            assert prom.wait_query(expr, 10), f"no data: {expr}"
        for job in ("nanhang", "storage"):
            ranks = {r["metric"]["rank"] for r in prom.query(f'train_step{{job="{job}"}}')}
            assert ranks == {"0", "1"}, (job, ranks)
        ranks = {r["metric"]["rank"] for r in prom.query(
            'ckpt_save_bytes_per_second{job="storage"} > 0')}
        assert ranks == {"0", "1"}, "persist throughput of every rank"
        # Measured collectives: FSDP's all-gathers and reduce-scatters on every rank.
        seen = {(r["metric"]["rank"], r["metric"]["kind"]) for r in prom.wait_query(
            'rate(train_comm_seconds_total{job="storage"}[1m]) > 0', 60)}
        assert seen == {(r, k) for r in ("0", "1") for k in ("all_gather", "reduce_scatter")}

        # Hang: freeze rank 1; rank 0 waits in its next collective.
        threshold, typical = (float(prom.query(f'{name}{{job="nanhang",rank="0"}}')[0]["value"][1])
                              for name in ("train_stall_threshold_seconds",
                                           "train_step_seconds_typical"))
        # The floor, or 20 typical steps on a loaded machine (one scrape may lie between), at
        # most half the hang watchdog's limit.
        assert threshold in (STALL_MIN, HANG / 2) or \
            threshold == pytest.approx(20 * typical, rel=0.3), (threshold, typical)
        a.signal_rank(1, signal.SIGSTOP)
        waited = prom.wait_alert("TrainingStalled", threshold + ALERT_SLACK, job="nanhang",
                                 rank="0")
        assert waited >= threshold - 2 * SCRAPE, f"stalled alert after {waited:.1f}s only"
        prom.wait_alert("TrainingJobDown", ALERT_SLACK, job="nanhang",
                        instance=f"127.0.0.1:{nan_base + 1}")
        # The hang watchdog of rank 0 counts the hang, lingers one scrape long and exits.
        prom.wait_alert("TrainingFailures", HANG + ALERT_SLACK, job="nanhang", rank="0",
                        kind="hang")

        # Unwritable root: the link now points at a file; saves fail, the checkpoint ages.
        last = _committed_since(b, b.last_index + 1)
        blocker = tmp_path / "not-a-directory"
        blocker.write_text("")
        tmp_link = tmp_path / "ckpt.new"
        tmp_link.symlink_to(blocker)
        os.replace(tmp_link, link)
        prom.wait_alert("CheckpointSaveFailures", 60, job="storage")
        limit = float(prom.query('max(ckpt_age_limit_seconds{job="storage"})')[0]["value"][1])
        assert limit == 3 * INTERVAL + AGE_SLACK
        newest = float(prom.query(
            'max(ckpt_last_commit_timestamp_seconds{job="storage",tier="durable"})')
            [0]["value"][1])
        assert newest >= last["time"] - 1e-3
        age_now = time.time() - newest
        prom.wait_alert("CheckpointTooOld", max(0.0, limit - age_now) + ALERT_SLACK,
                        job="storage")

        # A killed job: both targets stop answering.
        b.kill_all()
        for r in (0, 1):
            prom.wait_alert("TrainingJobDown", ALERT_SLACK, job="storage",
                            instance=f"127.0.0.1:{storage_base + r}")

        # 3 runs in a row on one port ended normally, then a 4th starts: 4 start times,
        # no restart loop.
        fourth = done.result(timeout=300)
        assert prom.wait_query('changes(train_process_start_timestamp_seconds{job="done"}'
                               '[30m]) == 3', 120), "4 start times of the done job not scraped"
        # Each end seen is a rise of the completion time (the first run's is not when its
        # first scrape came after its end).
        ends = 'changes({0}[30m]) - resets({0}[30m])'.format(
            'train_completed_timestamp_seconds{job="done"}')
        assert prom.wait_query(f"{ends} >= 2", 10), prom.query(ends)
        assert fourth.proc.poll() is None, fourth.tails()
        time.sleep(3 * SCRAPE)  # rule evaluations after the 4th start was scraped
        looping = [alert["labels"] for alert in prom.alerts()
                   if alert["labels"]["alertname"] == "TrainingRestartLoop"]
        assert not looping, f"normal ends counted as restarts: {looping}"
        fourth.kill_all()
    finally:
        done.stop()
        for job in jobs:
            job.kill_all()
        prom.stop()


FAULTY = ROOT / "tests" / "e2e" / "_faulty_storage.py"
FAULTY_RANK = ROOT / "tests" / "monitoring" / "_faulty_rank.py"
THROTTLE = 2e6  # bytes per second of rank 1's link in the hw job
STAGE_DELAY = 5.5  # seconds added to every staging copy: p90 stall above the 5 s of the rule
TRANSIENT_FAILS = 4  # failed attempts of every data-file write (RetryPolicy allows 4 retries)
# Every alert of the shipped file and the test above that brings it.
BROUGHT = {
    "test_every_fault_brings_its_alert": {
        "TrainingLossNotFinite", "TrainingStalled", "TrainingJobDown", "TrainingFailures",
        "CheckpointLoadFellBack", "CheckpointSaveFailures", "CheckpointTooOld",
        "CommBandwidthLow", "MemoryHeadroomLow"},
    "test_checkpoint_faults_bring_their_alerts": {
        "CheckpointStorageRetries", "CheckpointStallHigh", "CheckpointSavesSkipped",
        "CheckpointRetentionFailing", "CheckpointLeaseLost", "TrainingRestartLoop",
        "TrainingJobAbsent", "GoodputBelowTarget"},
    "test_replica_group_faults_bring_their_alerts": {
        "ReplicaQuorumBelowMinimum", "ReplicaLighthouseUnreachable"},
}


# Alerts no fault here can bring (they need a GPU): alerts_test.yml fires them.
RULE_TESTS_ONLY = {"GpuTemperatureHigh"}


def test_every_shipped_alert_has_a_fault():
    import yaml
    shipped = {r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"]
               for r in g["rules"] if "alert" in r}
    assert set().union(*BROUGHT.values()) | RULE_TESTS_ONLY == shipped


@pytest.fixture(scope="module")
def goodput_prom(tmp_path_factory):
    """The Prometheus of test_checkpoint_faults_bring_their_alerts (scrape jobs ``faults``,
    ``loop``, ``goodput``: ``.ports``) and its goodput job, started with the module's first
    Prometheus test, whose minutes it overlaps: its lost time pages only once its first
    start-up is under a tenth of its wall time (the rule's guard). It starts up alone (the
    test's jobs would lengthen that start-up); ``.goodput()`` joins it and returns
    bench_goodput's result."""
    from bench._goodput import read_events
    from bench.bench_goodput import run as run_goodput

    tmp = tmp_path_factory.mktemp("goodput")
    ports = {"faults": _port_pair(), "loop": _port_pair(), "goodput": _port_pair()}
    prom = Prom(tmp, ports)
    goodput: dict = {}

    def goodput_job() -> None:
        # Rank 1 killed twice; before the breakdown is read, its lost time pages.
        try:
            goodput["result"] = run_goodput(
                tmp / "goodput", kill_at=[30.0, 70.0], end_at=110.0, interval=150,
                port=ports["goodput"],
                before_end=lambda: prom.wait_alert("GoodputBelowTarget", 240, job="goodput"))
        except BaseException as exc:  # noqa: BLE001 - re-raised by .goodput()
            goodput["error"] = exc

    def goodput_result() -> dict:
        thread.join(timeout=600)
        assert not thread.is_alive(), "the goodput job did not end"
        if "error" in goodput:
            raise goodput["error"]
        return goodput["result"]

    (tmp / "goodput").mkdir()
    thread = threading.Thread(target=goodput_job, name="goodput", daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + 180
        while not any(e["kind"] == "train_step"
                      for e in read_events(tmp / "goodput" / "events.jsonl")):
            assert thread.is_alive() and time.monotonic() < deadline, \
                f"the goodput job did not train within 180 s: {goodput}"
            time.sleep(0.2)
        yield SimpleNamespace(prom=prom, ports=ports, goodput=goodput_result)
    finally:
        prom.stop()  # a goodput job still waiting for its alert fails, and is killed
        thread.join(timeout=60)


def test_checkpoint_faults_bring_their_alerts(tmp_path, goodput_prom):
    """Flaky, slow storage that cannot delete, then a lease takeover; a worker in a restart
    loop; the goodput job killed twice (started before: ``goodput_prom``); at last no trainer
    at all."""
    from bench._goodput import TOLERANCE_POINTS
    from bench._goodput import table as goodput_table

    prom = goodput_prom.prom
    faults_base, loop_base = goodput_prom.ports["faults"], goodput_prom.ports["loop"]
    jobs: list[Job] = []
    try:
        # Every data-file write fails 4 times with a dropped connection before it succeeds
        # (4 retries per save and rank, ~3 s of backoff), staging is 5.5 s slow, old
        # checkpoints cannot be deleted; saves are due every second.
        steal = tmp_path / "steal-now"
        f_jsonl = tmp_path / "faults.jsonl"
        f = Job(trainer_argv("--training.steps=1000000", "--checkpoint.interval=1s",
                             "--checkpoint.keep_last=1",
                             f"--checkpoint.root={tmp_path / 'faults-ckpt'}",
                             *_metrics_args(faults_base), f"--metrics.jsonl_path={f_jsonl}",
                             "--metrics.linger_seconds=8", PACED, nproc=2, script=FAULTY),
                tmp_path, "faults", f_jsonl,
                env=base_env(E2E_TRANSIENT_FAILS=str(TRANSIENT_FAILS),
                             E2E_DELETE_FAILS="1", E2E_STAGE_DELAY_SECONDS=str(STAGE_DELAY),
                             E2E_STEAL_LEASE_WHEN=str(steal)))
        jobs.append(f)
        # Every worker dies 3 s after its metrics endpoint is up; torchrun restarts the group
        # 3 times: 4 start times per rank.
        loop = Job(trainer_argv("--training.steps=1000000",
                                f"--checkpoint.root={tmp_path / 'loop-ckpt'}",
                                *_metrics_args(loop_base), nproc=2, max_restarts=3,
                                script=FAULTY),
                   tmp_path, "loop", env=base_env(E2E_CRASH_AFTER_SECONDS="3"))
        jobs.append(loop)

        for r in (0, 1):
            prom.wait_alert("TrainingRestartLoop", 180, job="loop", rank=str(r))
        assert loop.wait(120) != 0

        f.wait_event(lambda e: e["kind"] == "retention_failed", 180, "a failed deletion")
        prom.wait_alert("CheckpointRetentionFailing", ALERT_SLACK, job="faults")
        for r in (0, 1):
            prom.wait_alert("CheckpointStorageRetries", 120, job="faults", rank=str(r))
        prom.wait_alert("CheckpointStallHigh", 60, job="faults")
        prom.wait_alert("CheckpointSavesSkipped", 120, job="faults")

        # Another job takes the root's write lease over: this one stops saving, exits 4.
        steal.write_text("")
        f.wait_event(lambda e: e["kind"] == "lease_lost", 120, "the lease lost")
        prom.wait_alert("CheckpointLeaseLost", ALERT_SLACK, job="faults")
        f.wait(120)
        assert "took over the write lease" in f.stderr, f.tails()

        # The goodput job's exported breakdown against its raw event log's.
        goodput = goodput_prom.goodput()
        rows = goodput["rows"]
        off = [r for r in rows if abs(r["difference"]) > TOLERANCE_POINTS]
        assert not off, f"goodput off by more than {TOLERANCE_POINTS} points:\n" \
            f"{goodput_table(rows)}\n{json.dumps(goodput, indent=1)}"
        shares = {r["category"]: r["truth_points"] for r in rows}
        assert shares["restart"] > 5 and shares["recomputed"] > 1, rows  # the kills cost

        # No trainer left: nothing exports its metrics.
        for job in jobs:
            job.kill_all()
        prom.wait_alert("TrainingJobAbsent", ALERT_SLACK + 5)
    finally:
        for job in jobs:
            job.kill_all()


def test_replica_group_faults_bring_their_alerts(tmp_path):
    """A replica group that dies for good, then the lighthouse."""
    if not os.environ.get("CI"):
        pytest.importorskip("torchft")  # the 'ft' extra; CI installs it
    from trainer.ft.local import LocalReplicaGroups

    base = _port_pair()
    prom = Prom(tmp_path, {"ft": base})
    job = LocalReplicaGroups(
        ["--config", str(TINY), "--training.steps=1000000",
         "--fault.inject_step_delay_seconds=0.05", "--fault.hang_timeout_seconds=60",
         "--fault_tolerance.heartbeat_timeout_seconds=1",
         "--fault_tolerance.join_timeout_seconds=1", "--fault_tolerance.timeout_seconds=10",
         "--metrics.host=127.0.0.1", f"--metrics.stall_min_seconds={STALL_MIN}"],
        groups=2, out=tmp_path / "ft", max_restarts=0, port=free_port(), env=base_env(),
        group_args=lambda g: [f"--metrics.port={base + g}"])
    try:
        job.start()
        prom.wait_query('count(train_ft_quorum_size{job="ft"} == 2) == 2', 180)
        # Both groups in the quorum: no replica alert left, not even pending (the quorum
        # was 1 while the second group joined, which may have set one pending).
        deadline = time.monotonic() + 60
        while pending := [a for a in prom.alerts()
                          if a["labels"]["alertname"].startswith("Replica")]:
            assert time.monotonic() < deadline, pending
            time.sleep(1)
        job.kill_worker(1)  # no restarts: the group is gone, group 0 trains alone
        prom.wait_alert("ReplicaQuorumBelowMinimum", 60, job="ft")
        os.killpg(job.lighthouse.pid, signal.SIGKILL)
        prom.wait_alert("ReplicaLighthouseUnreachable", 60, job="ft",
                        instance=f"127.0.0.1:{base}")
    finally:
        job.stop()
        prom.stop()
