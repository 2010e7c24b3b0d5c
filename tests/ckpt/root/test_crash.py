"""Crash safety: SIGKILL a saving process anywhere; what remains is step 1 or a whole step 2.

A child process (tests/ckpt/root/_crash_child.py, 1 or 2 ranks) saves step 1, then starts saving
step 2 and is killed: after a random delay (several seeds), or by itself at a precise point
(right before the manifest commit, half-way through a data file, after the commit but before
the pending marker is removed). Then ``load_latest`` and ``CheckpointStore.latest`` must agree
on step 1 intact or step 2 complete, the loaded values must equal what was saved at that
step, and the life-cycle must recognise the killed save's leftovers by its marker.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import ckpt
from ckpt.root import INCOMPLETE, CheckpointStore, Lifecycle, acquire_lease, release_lease
from ckpt.storage import Storage
from tests.ckpt.root import _crash_child as child
from tests.ckpt._helpers import assert_same
from tests.dist import free_port

REPO = Path(__file__).resolve().parents[3]
STEP2 = "step_000000002"


class _Children:
    """The rank processes of one child job, with their stderr kept for failure messages."""

    def __init__(self, tmp_path: Path, world: int, env: dict[str, str]):
        self.root = str(tmp_path / "root")
        self.logs = [tmp_path / f"rank{r}.err" for r in range(world)]
        port = str(free_port())
        pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        self.procs = []
        self._lines: dict[int, queue.Queue[str]] = {}
        for rank in range(world):
            full_env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_PORT=port,
                            OMP_NUM_THREADS="1", PYTHONPATH=pythonpath, **env)
            with open(self.logs[rank], "w") as err:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tests.ckpt.root._crash_child", self.root], cwd=REPO,
                    env=full_env, stdout=subprocess.PIPE, stderr=err, text=True))

    def stderr(self) -> str:
        return "\n".join(f"--- rank {r} stderr ---\n{p.read_text()[-3000:]}"
                         for r, p in enumerate(self.logs))

    def _reader(self, rank: int) -> "queue.Queue[str]":
        if rank not in self._lines:
            lines: queue.Queue[str] = queue.Queue()
            stream = self.procs[rank].stdout

            def pump():
                for line in stream:
                    lines.put(line)
                lines.put("")  # end of output
            threading.Thread(target=pump, daemon=True).start()
            self._lines[rank] = lines
        return self._lines[rank]

    def wait_for(self, prefix: str, rank: int = 0, timeout: float = 60.0) -> str:
        """The next stdout line of ``rank`` that starts with ``prefix``."""
        lines = self._reader(rank)
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"rank {rank} did not print {prefix!r} in {timeout}s\n"
                                     f"{self.stderr()}") from None
            if not line:
                raise AssertionError(f"rank {rank} exited (code {self.procs[rank].wait()}) "
                                     f"before printing {prefix!r}\n{self.stderr()}")
            if line.startswith(prefix):
                return line.strip()

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait(timeout=30)
            p.stdout.close()


def _check_recovery(root: str, world: int) -> int:
    """Assert that the root holds step 1 intact or step 2 complete; return which one."""
    store = CheckpointStore(root)
    latest = store.latest(check="full")
    assert latest is not None and latest.step in (1, 2), latest
    state = child.empty_state(range(world))
    manifest = ckpt.load_latest(state, root)
    assert manifest is not None and manifest.step == latest.step
    assert_same(child.state_for(manifest.step, range(world)), state, f"step {manifest.step}")

    step2 = os.path.join(root, STEP2)
    leftovers = sorted(os.listdir(step2)) if os.path.isdir(step2) else []
    committed2 = "manifest.json" in leftovers
    assert committed2 == (manifest.step == 2), leftovers
    # A marker's temporary file (killed between its write and its rename) is not a marker.
    markers = [n for n in leftovers if n.startswith("pending-") and ".tmp-" not in n]
    aborted = dict(Lifecycle(Storage(root)).leftovers())
    marker = None
    if markers:
        try:
            marker = json.loads(Path(step2, markers[0]).read_bytes())
        except ValueError:
            marker = None  # killed while writing the marker itself: no data can follow it
    if not committed2 and any(n.endswith(".bin") for n in leftovers):
        # The marker is written (and synced) before any data file.
        assert marker is not None, leftovers
    if not committed2 and marker is not None:
        assert marker["step"] == 2 and markers[0] == f"pending-{marker['save_id']}.json"
        assert marker["lease_generation"] >= 1 and marker["owner"], marker
        assert sorted(aborted) == [2], (aborted, leftovers)
        assert store.info(2).status == INCOMPLETE
        assert store.info(2).owner == marker["owner"]
    elif committed2:
        # At most the committed attempt's stale marker is left; its data is referenced.
        assert all(n.startswith("pending-") for n in aborted.get(2, [])), aborted
    # Step 1 is never harmed by a crash during step 2.
    assert 1 not in aborted
    store.verify(1)
    return manifest.step


def _resume_and_save_step2(root: str, world: int) -> None:
    """A restarted job saves step 2 again beside the leftovers; it loads back exactly, and
    a cleanup by the next lease holder removes only the dead attempt's files."""
    ckpt.save(child.state_for(2, range(world)), root, 2)  # the dead holder's lease: taken
    store = CheckpointStore(root)
    store.verify(2)
    life = acquire_lease(Storage(root))
    try:
        life.cleanup()
    finally:
        release_lease(life)
    assert Lifecycle(Storage(root)).leftovers() == []
    store.verify(2)
    state = child.empty_state(range(world))
    assert ckpt.load_latest(state, root).step == 2
    assert_same(child.state_for(2, range(world)), state, "re-saved step 2")


@pytest.mark.parametrize("seed,world", [(s, 1) for s in range(6)] + [(6, 2), (7, 2)])
def test_sigkill_at_random_point(tmp_path, seed, world):
    rng = random.Random(seed)
    # Step 1's save takes about as long as step 2's will: each rank kills itself somewhere
    # in that window (or just after step 2 completed).
    job = _Children(tmp_path, world, {"CRASH_SLOW_SECONDS": "0.03",
                                      "CRASH_AFTER_FRACTION": f"{rng.uniform(0.0, 1.2):.3f}"})
    try:
        codes = [p.wait(timeout=90) for p in job.procs]
        # A rank may also fail on its dead peer before its own kill: any end but success.
        assert -signal.SIGKILL in codes and 0 not in codes, f"exit codes {codes}\n{job.stderr()}"
    finally:
        job.kill_all()
    step = _check_recovery(job.root, world)
    step2 = os.path.join(job.root, STEP2)
    leftovers = os.listdir(step2) if os.path.isdir(step2) else []
    print(f"seed {seed}: latest step {step}; step-2 folder holds "
          f"{sum(n.endswith('.bin') for n in leftovers)} data file(s)"
          f"{', a marker' if any(n.startswith('pending-') for n in leftovers) else ''}"
          f"{', manifest.json' if 'manifest.json' in leftovers else ''}")


@pytest.mark.parametrize("point,world,crash_rank,expected_step", [
    ("before_commit", 1, None, 1),
    ("mid_write", 1, None, 1),
    ("after_commit", 1, None, 2),
    ("mid_write", 2, 1, 1),      # a non-coordinator dies while its peers finish writing
    ("before_commit", 2, 0, 1),  # the coordinator dies with every data file written
])
def test_sigkill_at_precise_point(tmp_path, point, world, crash_rank, expected_step):
    env = {"CRASH_AT": point}
    if crash_rank is not None:
        env["CRASH_RANK"] = str(crash_rank)
    job = _Children(tmp_path, world, env)
    victim = crash_rank or 0
    try:
        job.wait_for("SAVING 2", rank=victim)
        code = job.procs[victim].wait(timeout=60)
        assert code == -signal.SIGKILL, f"exit code {code}\n{job.stderr()}"
        time.sleep(0.5)  # let surviving ranks run into the dead peer
    finally:
        job.kill_all()
    leftovers = sorted(os.listdir(os.path.join(job.root, STEP2)))
    if point == "mid_write":
        # A half-written data file is on disk, and no manifest.
        assert any(n.endswith(".bin") for n in leftovers) and "manifest.json" not in leftovers
    if point == "before_commit":
        assert "manifest.json" not in leftovers
        assert any(n.startswith("pending-") for n in leftovers)
    if point == "after_commit":
        # Committed, and the stale marker does not make it look aborted.
        assert "manifest.json" in leftovers
        assert any(n.startswith("pending-") for n in leftovers)
    assert _check_recovery(job.root, world) == expected_step
    if expected_step == 1:
        _resume_and_save_step2(job.root, world)
