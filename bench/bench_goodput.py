"""Goodput against its ground truth: a job SIGKILLed at known times, its exported breakdown
against the one computed from its raw event log.

    python bench/bench_goodput.py --kill-at 30 70 --end-at 120

Trains the tiny config on 2 CPU workers (FSDP over gloo, loopback) under ``torchrun
--max-restarts``, checkpointing every ``--interval`` steps, each rank serving its metrics.
At each ``--kill-at`` second after the launch (once the job trains again after the previous
kill) rank 1 is SIGKILLed; torchrun restarts the job, which resumes from its newest
checkpoint. At ``--end-at`` rank 0's ``/metrics`` is read: its ``train_goodput_*``
breakdown (continued across the restarts in the root's ``_history.json``) is compared with
the ground truth that ``bench/_goodput.py`` computes from rank 0's raw event log and the
kill times, category by category, as shares of each side's wall time. Exit status 1 when a
share differs by more than 2 points.

A program, not a test (tests/monitoring/test_alerts_e2e.py runs it as a job of its shared
Prometheus): the command and a result are in docs/monitoring.md, "Goodput".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for p in (HERE, REPO):
    if p not in sys.path:
        sys.path.insert(0, p)

from _goodput import TOLERANCE_POINTS, compare, exported, read_events, table, truth  # noqa: E402

from trainer.ft.local import worker_pids  # noqa: E402

TINY = os.path.join(REPO, "configs", "tiny.toml")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "MASTER_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                "GROUP_RANK", "ROLE_"))}
    env["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def port_pair() -> int:
    """A port free on 127.0.0.1 with the next one free too (rank 1 serves on port + 1)."""
    while True:
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def run(work: Path, kill_at: list[float], end_at: float, interval: int, port: int,
        before_end: Callable[[], None] | None = None) -> dict:
    """One job: launch, the kills, the reading at ``end_at`` (after ``before_end()``, if
    given, returns: the job trains on meanwhile); the truth and the export."""
    jsonl = work / "events.jsonl"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node=2", f"--max-restarts={len(kill_at)}", "--monitor-interval=0.5",
            "-m", "trainer", "--config", TINY, "--training.steps=100000000",
            "--training.log_every=1000", f"--checkpoint.root={work / 'ckpt'}",
            f"--checkpoint.interval={interval}", "--checkpoint.keep_last=2",
            f"--metrics.jsonl_path={jsonl}", f"--metrics.port={port}",
            "--metrics.host=127.0.0.1", "--fault.hang_timeout_seconds=120"]
    log = open(work / "job.log", "w")
    launch = time.time()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                            start_new_session=True, cwd=REPO)
    kills: list[float] = []

    def trains_since(t: float) -> bool:
        return any(e["kind"] == "train_step" and e["time"] > t for e in read_events(jsonl))

    def wait_until(t: float, then_training_since: float) -> None:
        while time.time() < t or not trains_since(then_training_since):
            if proc.poll() is not None:
                raise RuntimeError(f"the job exited ({proc.returncode}); see {work / 'job.log'}")
            if time.time() > t + 300:
                raise RuntimeError(f"the job did not train again; see {work / 'job.log'}")
            time.sleep(0.1)

    try:
        for at in kill_at:
            wait_until(launch + at, kills[-1] if kills else 0.0)
            pids = worker_pids(proc.pid)
            os.kill(pids[1], signal.SIGKILL)
            kills.append(time.time())
        wait_until(launch + end_at, kills[-1] if kills else 0.0)
        if before_end is not None:
            before_end()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            t0 = time.time()
            page = r.read().decode()
        end = t0
    finally:
        workers = list(worker_pids(proc.pid).values())
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for pid in workers:  # in sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
    want = truth(read_events(jsonl), launch_unix=launch, kills=kills, end_unix=end)
    got = exported(page)
    return {"launch_unix": launch, "kills_unix": kills, "end_unix": end, "truth": want,
            "exported": got, "rows": compare(want, got)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kill-at", type=float, nargs="+", default=[30.0, 70.0],
                    help="seconds after the launch to SIGKILL rank 1 (each once the job "
                         "trains again)")
    ap.add_argument("--end-at", type=float, default=120.0,
                    help="seconds after the launch to read the exported breakdown")
    ap.add_argument("--interval", type=int, default=150, help="checkpoint every N steps")
    ap.add_argument("--port", type=int, default=0, help="rank 0's metrics port (rank 1: +1; "
                    "0: a free one)")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--dir", default=None, help="work folder (default: a temp folder)")
    opts = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="goodput-", dir=opts.dir))
    try:
        result = run(work, opts.kill_at, opts.end_at, opts.interval, opts.port or port_pair())
    finally:
        if opts.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    launch = result["launch_unix"]
    kills = ", ".join(f"{k - launch:.1f}" for k in result["kills_unix"])
    print(f"{len(result['kills_unix'])} kills at {kills} s; read at "
          f"{result['end_unix'] - launch:.1f} s")
    print(table(result["rows"]))
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=1))
    worst = max(abs(r["difference"]) for r in result["rows"])
    print(f"largest difference: {worst:.2f} points (tolerance {TOLERANCE_POINTS:g})")
    return 0 if worst <= TOLERANCE_POINTS else 1


if __name__ == "__main__":
    sys.exit(main())
