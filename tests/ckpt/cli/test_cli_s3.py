"""The ``ckpt`` command against S3 that throttles or does not answer.

Throttling (503 SlowDown) is waited out for a bounded time (``--retry-for``, default 2m), as
a job's saves wait it out, and reported as throttling when it lasts longer; an endpoint that
does not answer is announced while the command waits for it, not after its timeouts.
Requests go over real HTTP to moto's server, through the fault-injecting proxy of
tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import queue
import random
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import ckpt
from ckpt.cli import main as cli_main
from ckpt.root import CheckpointStore, acquire_lease, release_lease
from ckpt.storage import Storage
from tests.ckpt.cli.test_cli import REPO

pytestmark = pytest.mark.timeout(300)


def cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _throttle(proxy, burst: int, fraction: float, seed: int) -> None:
    """Answer the next ``burst`` requests 503 SlowDown, then ``fraction`` of them (drawn
    from a generator of the test's own)."""
    draw, first = random.Random(seed), len(proxy.requests) + burst
    proxy.fault = lambda req: "503" if req.index < first or draw.random() < fraction else None


def test_operator_commands_wait_out_throttling(s3_server, s3_root, s3_proxy, capsys):
    url, direct = s3_root.url, ["--endpoint-url", s3_server.endpoint_url]
    for step in (10, 20, 30):
        ckpt.save({"w": torch.full((64,), float(step))}, url, step,
                  storage_options=s3_root.storage_options)
    assert cli(capsys, "rollback", url, "--step", 10, *direct)[0] == 0
    versions = json.loads(cli(capsys, "list", url, "--all", "--json", *direct)[1])
    rolled = {r["step"]: r["id"] for r in versions if r["status"] == "rolled-back"}
    storage = Storage(url, s3_root.storage_options)
    life = acquire_lease(storage, ttl_seconds=30, job_name="crashed")
    try:
        life.begin(40, "abcdef123456")  # an aborted save's leftovers, for gc
    finally:
        release_lease(life)

    # 30% of the requests refused; the first command's first 6 too: more than 5 attempts.
    proxied = ["--endpoint-url", s3_proxy.endpoint_url]
    for seed, argv in enumerate([["restore", url, "--id", rolled[20]], ["gc", url, "--yes"],
                                 ["gc", url, "--rolled-back", "--yes"]]):
        before = s3_proxy.num_injected
        _throttle(s3_proxy, 6 if seed == 0 else 0, 0.3, seed)
        rc, out, err = cli(capsys, *argv, *proxied)
        assert rc == 0, (argv, out, err)
        assert s3_proxy.num_injected - before > 5, argv
        # Said while it waits: throttled, retrying; a few lines, not one per retry.
        assert "throttled" in err and "retry" in err and len(err.splitlines()) < 12, err
    s3_proxy.fault = lambda req: None
    store = CheckpointStore(url, s3_root.storage_options)
    assert store.committed_steps() == [10, 20] and store.life.leftovers() == []
    assert [e.status for e in store.life.entries(30)] == []  # rolled back, then removed


def test_throttling_past_the_deadline_is_reported_as_throttling(s3_server, s3_root, s3_proxy,
                                                                capsys):
    ckpt.save({"w": torch.ones(4)}, s3_root.url, 1, storage_options=s3_root.storage_options)
    s3_proxy.fault = lambda req: "503"
    t0 = time.monotonic()
    rc, out, err = cli(capsys, "list", s3_root.url, "--endpoint-url", s3_proxy.endpoint_url,
                       "--retry-for", "3s")
    elapsed = time.monotonic() - t0
    last = err.splitlines()[-1]
    assert rc == 2 and out == "" and 3 <= elapsed < 20, (rc, elapsed, err)
    assert last.startswith("ckpt list: storage throttled: gave up after ") and " over 3s" in last
    assert f"{s3_proxy.endpoint_url} kept answering 503 SlowDown" in last
    assert "unreachable" not in err and "Check the endpoint" not in last


@pytest.fixture
def silent_endpoint():
    """An HTTP endpoint that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for s in [server, *held]:
        s.close()


def test_an_endpoint_that_does_not_answer_is_announced_while_waiting(silent_endpoint):
    """Its first failure comes only after a read timeout (15 s); before that, the command
    says what it is waiting for (2 s into the request)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt.cli", "list", "s3://some-bucket/run1", "--endpoint-url",
         silent_endpoint], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stderr], daemon=True).start()
    try:
        first = lines.get(timeout=120)  # start-up is slow on a loaded machine
    finally:
        proc.kill()
        proc.communicate()
    assert first.startswith(f"ckpt list: no answer yet from {silent_endpoint} for "
                            f"s3://some-bucket/run1; still trying"), first
