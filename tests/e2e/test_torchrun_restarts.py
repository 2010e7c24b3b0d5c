"""``torchrun --max-restarts`` recovers a job by itself: the library in a user's own loop and
the trainer, under ``--standalone``, c10d rendezvous on loopback and a fixed ``--master-port``.

Each launch runs its program through ``_kill_once.py``: in the first attempt rank 1, in the
second rank 0 waits for a checkpoint to commit and SIGKILLs itself; torchrun restarts both
workers, which must form their groups again (the job's and the CheckpointManager's), resume
from exactly that checkpoint and finish with exit 0 and a final checkpoint. No environment variable helps
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` is removed): restarted workers share the dead attempt's
rendezvous store, and only ``ckpt.init_distributed``'s per-attempt key space keeps them from
reading its addresses (PLATFORM.md: 10 of 20 plain restarts recovered). Every job restarts
twice, under each rendezvous; ``E2E_RESTART_LOOPS=N`` launches N jobs of each in a row (a
soak test: restarts used to fail one time in two).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt.root import CheckpointStore
from tests.dist import free_port
from tests.e2e._jobs import COMMON, ROOT, TINY, base_env
from trainer.ft.local import worker_pids

KILL_ONCE = ROOT / "tests" / "e2e" / "_kill_once.py"
EXAMPLE = ROOT / "examples" / "own_loop.py"
LOOPS = max(1, int(os.environ.get("E2E_RESTART_LOOPS", "1")))


def _free_port() -> int:
    return free_port()


def _wait_or_kill(proc: subprocess.Popen, timeout: float) -> int | None:
    """``proc``'s exit status, or None after SIGKILLing it and its workers when it is still
    running after ``timeout`` seconds. torchrun starts every worker in a session of its own, so
    killing the agent's process group would leave them running: they are found by their parent
    first."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in worker_pids(proc.pid).values():
            try:
                os.killpg(pid, signal.SIGKILL)  # the worker's session: it and its children
            except ProcessLookupError:
                pass
        os.killpg(proc.pid, signal.SIGKILL)  # the agent's session
        proc.wait()
        return None


def _launcher(rdzv: str, run: int) -> list[str]:
    if rdzv == "standalone":
        return ["--standalone"]
    if rdzv == "c10d":
        return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
                "--rdzv-id", f"restart-test-{os.getpid()}-{run}", "--nnodes", "1"]
    assert rdzv == "static"
    return ["--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "--nnodes", "1"]


def _run_killed(program: list[str], rdzv: str, run: int, log_dir: Path, *,
                plan: list[tuple[int, int]], timeout: float = 180.0) -> str:
    """One torchrun job (2 workers) whose attempt i loses rank ``plan[i][1]`` at step
    ``plan[i][0]`` (after a commit); asserts that every restart resumed from the checkpoint
    committed before its kill and that the job finished. Returns its output."""
    argv = [sys.executable, "-m", "torch.distributed.run", *_launcher(rdzv, run),
            "--nproc-per-node", "2", "--max-restarts", str(len(plan)),
            "--monitor-interval", "0.5", str(KILL_ONCE), *program]
    env = base_env(KILL_PLAN=",".join(f"{step}:{rank}" for step, rank in plan))
    with open(log_dir / f"{rdzv}-{run}.out", "w+") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        rc = _wait_or_kill(proc, timeout)
        out.seek(0)
        text = out.read()
    where = f"{rdzv} run {run}: {' '.join(argv[3:])}\n{text[-6000:]}"
    assert rc == 0, f"exit {rc} (None: still running after {timeout:.0f}s)\n{where}"
    for attempt, (_, rank) in enumerate(plan):
        killed = re.findall(rf"rank {rank} attempt {attempt} killed at step \d+, committed (\d+)",
                            text)
        assert len(killed) == 1 and int(killed[0]) > 0, (attempt, killed, where)
        resumed = sorted(re.findall(rf"rank (\d) attempt {attempt + 1} resumed (\d+)", text))
        assert resumed == [("0", killed[0]), ("1", killed[0])], (attempt, resumed, where)
    assert f"attempt {len(plan) + 1}" not in text, where
    assert "connectFullMesh" not in text, where
    return text


def _final_step(root: Path) -> int:
    return max(CheckpointStore(str(root)).steps())


@pytest.mark.parametrize("rdzv", ["standalone", "c10d", "static"])
def test_own_loop_recovers_from_killed_workers(tmp_path, rdzv):
    """examples/own_loop.py as written (ckpt.init_distributed, DDP, async saves every 10
    steps): rank 1 dies in the first attempt, rank 0 in the second; both resumes land on the
    checkpoint committed before the kill, and the job finishes."""
    for run in range(LOOPS):
        root = tmp_path / f"ckpt{run}"
        _run_killed([str(EXAMPLE), str(root), "30"], rdzv, run, tmp_path,
                    plan=[(12, 1), (22, 0)])
        assert _final_step(root) == 30


@pytest.mark.parametrize("rdzv", ["standalone", "c10d"])
def test_trainer_recovers_from_killed_workers(tmp_path, rdzv):
    for run in range(LOOPS):
        root = tmp_path / f"ckpt{run}"
        program = ["-m", "trainer", "--config", str(TINY), *COMMON, "--checkpoint.interval=5",
                   f"--checkpoint.root={root}"]
        text = _run_killed(program, rdzv, run, tmp_path, plan=[(8, 1), (18, 0)])
        assert len(re.findall(r"resumed from \S+ step \d+", text)) == 2, text[-3000:]
        assert _final_step(root) == 30


def test_plain_init_process_group_under_restarts_is_warned_about(tmp_path):
    """A job that starts its group with dist.init_process_group is told, on its first attempt,
    that its restarts can fail, and what to call instead."""
    script = tmp_path / "plain.py"
    script.write_text(
        "import sys, torch.distributed as dist\n"
        "from ckpt import CheckpointManager, ManagerOptions\n"
        "dist.init_process_group('gloo')\n"
        "CheckpointManager(sys.argv[1], ManagerOptions(use_lease=False)).close()\n"
        "dist.destroy_process_group()\n")
    with open(tmp_path / "plain.err", "w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", "--max-restarts", "1", str(script), str(tmp_path / "ckpt")],
            cwd=ROOT, env=base_env(), stdout=subprocess.DEVNULL, stderr=err,
            stdin=subprocess.DEVNULL, start_new_session=True)
        rc = _wait_or_kill(proc, 120)
        err.seek(0)
        stderr = err.read()
    assert rc == 0, f"exit {rc} (None: still running after 120s)\n{stderr[-3000:]}"
    assert stderr.count("Call ckpt.init_distributed() instead") == 2, stderr[-3000:]
