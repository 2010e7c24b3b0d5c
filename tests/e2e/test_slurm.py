"""The Slurm recipes against a real Slurm: preemption, the time limit's warning, requeue.

One cluster for the module (``tests/e2e/_slurm.py``: munged, slurmctld and slurmd on this
host, one node with 2 CPUs). Each test submits a recipe of ``scripts/slurm/`` as
docs/trainer.md ("Slurm") shows, sized for 2 CPU ranks: the tiny config's 30 steps (a
checkpoint every 7), each step paced so that Slurm's event lands mid-run. The job is
stopped once, by ``scancel --signal=TERM`` or by the warning ahead of a 1-minute time limit
(``--signal=B:USR1@45``): the ranks save the step they are at, exit 75, the batch script
requeues the job, and the next run resumes from that step. The job ends COMPLETED with the
same loss at every step and the same final checkpoint, bit for bit, as an uninterrupted run;
the emergency save verifies; the lease record (its job, run id and attempt), ``ckpt
history`` and the metrics targets name the Slurm job and its restart count. With a stand-in
for the trainer: a cancelled job stays cancelled, a failed one failed. Without Slurm: ranks started with srun's variables only form
the job, and one signalled while it starts saves at its first step.
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ckpt.cli import main as ckpt_main
from tests.e2e._jobs import (
    ABORT_MARK,
    COMMON,
    INTERVAL,
    ROOT,
    STEPS,
    TINY,
    Job,
    all_losses,
    assert_same_checkpoint,
    base_env,
    free_port,
    loss_history,
    straight_run,
)
from tests.e2e._slurm import TIME_LIMIT_PERIOD, SlurmCluster, SlurmJobRun, missing, read_events

ONE_NODE = ROOT / "scripts" / "slurm" / "train.sbatch"
MULTINODE = ROOT / "scripts" / "slurm" / "train_multinode.sbatch"
# The recipes ask for 8 GPUs per node; here: 2 CPU ranks on the one node.
CPU = ("--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0")
FAILED = ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
          "DEADLINE", "PREEMPTED")


@pytest.fixture(scope="module")
def slurm():
    reason = missing()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster().start()
    yield cluster
    cluster.cleanup()


def _env(root: Path, **extra: str) -> dict[str, str]:
    """The environment the recipe is submitted with (sbatch passes it on to the job)."""
    return base_env(CKPT_ROOT=str(root), CONFIG=str(TINY), PYTHON=sys.executable,
                    MASTER_PORT=str(free_port()), **extra)


def _submit(slurm: SlurmCluster, recipe: Path, tmp_path: Path, pace: float,
            sbatch: tuple[str, ...], **env: str) -> SlurmJobRun:
    jsonl = tmp_path / "events.jsonl"
    return slurm.submit(recipe, *COMMON, f"--metrics.jsonl_path={jsonl}",
                        f"--fault.inject_step_delay_seconds={pace:.3f}",
                        "--metrics.linger_seconds=0",  # with METRICS_PORT: no wait at the end
                        sbatch=(*CPU, *sbatch), env=_env(tmp_path / "ckpt", **env), cwd=ROOT,
                        output=tmp_path / "job.out")


def _wait_event(job: SlurmJobRun, jsonl: Path, pred, timeout: float = 90.0,
                what: str = "event") -> None:
    deadline = time.monotonic() + timeout
    while not any(pred(e) for e in read_events(jsonl)):
        if time.monotonic() > deadline or job.state in FAILED:
            raise AssertionError(f"no {what} within {timeout:.0f}s\n{job.tail()}")
        time.sleep(0.05)


def _wait_step(job: SlurmJobRun, jsonl: Path, step: int) -> None:
    _wait_event(job, jsonl, lambda e: e["kind"] == "train_step" and e["step"] >= step,
                what=f"train_step {step}")


def _wait_completed(job: SlurmJobRun, timeout: float) -> dict[str, str]:
    info = job.wait_state(("COMPLETED", *FAILED), timeout)
    assert info["JobState"] == "COMPLETED", f"job {job.job_id}: {info['JobState']}\n{job.tail()}"
    return info


def _check_resumed_bit_for_bit(job: SlurmJobRun, tmp_path: Path) -> None:
    """The first run saved where it stopped, the second resumed there, and the job ended as
    the straight run ends; the emergency save verifies."""
    root, events = tmp_path / "ckpt", read_events(tmp_path / "events.jsonl")
    text = job.text()
    saved = [e["step"] for e in events if e["kind"] == "failure" and e["failure"] == "preempted"]
    committed = [e["step"] for e in events if e["kind"] == "save_committed"]
    resumed = [e["step"] for e in events if e["kind"] == "resumed"]
    assert len(saved) == 1 and saved[0] < STEPS and resumed == saved, (saved, resumed,
                                                                        job.tail())
    assert set(saved) <= set(committed) and committed[-1] == STEPS, (saved, committed)
    assert text.count("saved on") == len(saved) and "launch: finished" in text, job.tail()
    assert ABORT_MARK not in text, job.tail()
    ref_root, ref_events = straight_run(COMMON)
    ref, got = loss_history(ref_events), loss_history(events)
    assert got == ref, {s: (got.get(s), ref[s]) for s in ref if got.get(s) != ref[s]}
    for step, values in all_losses(events).items():  # replayed steps: never, none lost
        assert values == [ref[step]], (step, values)
    assert_same_checkpoint(ref_root, root, STEPS)
    assert ckpt_main(["verify", str(root), "--step", str(saved[0])]) == 0


def test_time_limit_warning_saves_requeues_and_resumes_bit_for_bit(slurm, tmp_path):
    """``--time=1 --signal=B:USR1@45``: slurmctld tests time limits in rounds 30 s apart and
    warns at the first round that finds the job within 45 + 30 s of its end: here the first
    round after the job starts, at least 15 s after the submission (the ranks are running by
    then; a warning during their start-up is kept for their first step). Paced, the 30
    steps would end just after that round. The requeued run would be warned at its first
    round as well (each run of a job gets --time anew, and that run would save and requeue
    again); to end after one cut, the test gives it 10 minutes while it is pending."""
    check = slurm.next_time_limit_check()
    if check - time.time() < 15:
        time.sleep(max(0.0, check - time.time()) + 1.0)
        check += TIME_LIMIT_PERIOD
    pace = (check - time.time() + 2.0) / STEPS
    job = _submit(slurm, ONE_NODE, tmp_path, pace, ("--time=1", "--signal=B:USR1@45"),
                  GRACE="45")
    deadline = time.monotonic() + 90
    while job.info().get("Restarts") == "0":
        assert time.monotonic() < deadline and job.state not in ("COMPLETED", *FAILED), \
            f"no requeue after the time limit's warning\n{job.tail()}"
        time.sleep(0.1)
    slurm.command("scontrol", "update", f"JobId={job.job_id}", "TimeLimit=10")
    info = _wait_completed(job, timeout=120)
    assert info["Restarts"] == "1", job.tail()
    text = job.text()
    assert "launch: USR1 received" in text, job.tail()
    assert "longer than the preemption grace" not in text  # 45 s: saves take far less
    _check_resumed_bit_for_bit(job, tmp_path)


def test_preempted_by_scancel_saves_requeues_and_resumes_bit_for_bit(slurm, tmp_path, capsys):
    """``scancel --signal=TERM JOB`` mid-run (as a preemption's TERM reaches the ranks):
    through the many-node recipe on one node, with metrics; the lease record, ``ckpt
    history`` and the metrics targets' labels name the job and its restart count. The grace
    given (GRACE, 1 ms) is shorter than any save: one line says so when the first save
    commits, and the requeued run says it again as it starts, before it resumes."""
    port, sd = free_port(), tmp_path / "targets"
    sd.mkdir()
    jsonl, root = tmp_path / "events.jsonl", tmp_path / "ckpt"
    job = _submit(slurm, MULTINODE, tmp_path, 0.1, ("--nodes=1",), GRACE="0.001",
                  METRICS_PORT=str(port), METRICS_SD_DIR=str(sd))
    targets_file = sd / f"slurm-{job.job_id}.json"
    _wait_step(job, jsonl, 3)
    [group] = json.loads(targets_file.read_text())
    assert group["labels"] == {"slurm_job_id": job.job_id, "slurm_restart_count": "0"}
    assert group["targets"] == [f"{slurm.node}:{port}", f"{slurm.node}:{port + 1}"]
    for target in group["targets"]:  # every rank serves its metrics at its target
        with urllib.request.urlopen(f"http://127.0.0.1:{target.rsplit(':', 1)[1]}/metrics",
                                    timeout=10) as r:
            assert b"ckpt_saves_total" in r.read()
    _wait_step(job, jsonl, 2 * INTERVAL - 3)  # mid-run, between two periodic saves
    _wait_event(job, jsonl, lambda e: e["kind"] == "save_committed")  # the first, of step 7
    slurm.command("scancel", "--signal=TERM", job.job_id)
    labels = set()
    while job.state not in ("COMPLETED", *FAILED):  # the requeued run's targets
        try:  # written at a run's start (renamed into place), removed at its end
            labels.add(json.loads(targets_file.read_text())[0]["labels"]["slurm_restart_count"])
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    info = _wait_completed(job, timeout=120)
    assert info["Restarts"] == "1", job.tail()
    assert labels == {"1"} or labels == {"0", "1"}, labels
    assert not targets_file.exists()  # gone with the job
    _check_resumed_bit_for_bit(job, tmp_path)
    lease = json.loads((root / "_lease.json").read_text())
    assert lease["job"] == f"slurm-{job.job_id}-restart-1" and lease["released"], lease
    # The run and its attempt, by which a requeued run takes over a lease left held.
    assert (lease["run_id"], lease["attempt"]) == (f"slurm-{job.job_id}@ckpt-tests", 1), lease
    text = job.text()
    warning = f"the save of step {INTERVAL} took"
    assert text.count("longer than the preemption grace") == 2, job.tail()
    second_run = text.index(f"launch: job {job.job_id} run 2")
    assert second_run < text.index(warning, second_run) < text.index("resumed from"), job.tail()
    capsys.readouterr()
    assert ckpt_main(["history", str(root)]) == 0
    history = capsys.readouterr().out
    for run in (0, 1):
        assert f"job slurm-{job.job_id}-restart-{run}" in history, history


# -- launch.sh's decisions, with a stand-in for the trainer ---------------------------------------
_RANK = r"""
import os, signal, sys, time
code = int(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))  # as the trainer: save, then 75
print("rank", os.environ["SLURM_PROCID"], "running", flush=True)
time.sleep(60 if code < 0 else 0)
sys.exit(max(code, 0))
"""


def _stand_in(slurm: SlurmCluster, tmp_path: Path, name: str, code: int) -> SlurmJobRun:
    script = tmp_path / f"{name}.sbatch"
    script.write_text("#!/usr/bin/env bash\n#SBATCH --requeue\n#SBATCH --open-mode=append\n"
                      f"exec bash {ROOT}/scripts/slurm/launch.sh 30 {sys.executable} "
                      f"-c '{_RANK}' {code}\n")
    return slurm.submit(script, sbatch=("--ntasks=2",), output=tmp_path / f"{name}.out")


def test_a_cancelled_or_failed_job_is_not_requeued(slurm, tmp_path):
    """``scancel JOB`` cancels: the ranks get TERM and exit 75 as on a preemption, but the
    batch script sees Slurm ending the job and does not requeue it. A failure that a restart
    cannot fix (exit 2, bad config) ends the job FAILED with that code."""
    job = _stand_in(slurm, tmp_path, "cancelled", -1)
    job.wait_state(("RUNNING",), 30)
    deadline = time.monotonic() + 30
    while job.text().count("running") < 2:
        assert time.monotonic() < deadline, job.tail()
        time.sleep(0.05)
    slurm.command("scancel", job.job_id)
    info = job.wait_state(("CANCELLED", "COMPLETED", "FAILED", "PENDING"), 30)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", (info, job.tail())
    time.sleep(2)  # a requeue would show by now
    assert job.info()["JobState"] == "CANCELLED", job.tail()
    assert "exited 75, but Slurm is ending the job" in job.text(), job.tail()

    job = _stand_in(slurm, tmp_path, "config", 2)
    info = job.wait_state(("FAILED", "COMPLETED"), 30)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "2:0", "0"), \
        job.tail()
    assert "the step failed with 2; not requeued" in job.text(), job.tail()


# -- without Slurm: what srun's tasks get, the grace check --------------------------------------
def _task_env(rank: int, port: int, job_id: str = "4242") -> dict[str, str]:
    """The environment srun gives task ``rank`` of a 2-task step on this host (Slurm's
    variables only: torch's come from trainer.slurm), and the batch script's MASTER_PORT."""
    return base_env(SLURM_JOB_ID=job_id, SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="2",
                    SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODEID="0",
                    SLURM_STEP_NODELIST="localhost", SLURM_JOB_NODELIST="localhost",
                    MASTER_PORT=str(port))


def test_srun_tasks_answer_a_signal_that_comes_during_start_up(tmp_path):
    """Two ``python -m trainer`` processes with srun's variables form the job (rank 0 serves
    the rendezvous). Rank 0 is signalled while it waits there for rank 1, long before the
    loop: it keeps the signal, and at the first step boundary both ranks save that step and
    exit 75; the lease names the Slurm job."""
    root, jsonl, port = tmp_path / "ckpt", tmp_path / "events.jsonl", free_port()
    argv = [sys.executable, "-m", "trainer", "--config", str(TINY), *COMMON,
            f"--checkpoint.root={root}", f"--metrics.jsonl_path={jsonl}"]
    rank0 = Job(argv, tmp_path, "rank0", jsonl, env=_task_env(0, port))
    deadline = time.monotonic() + 120
    while True:  # rank 0 listens: it is in the rendezvous, past reading its config
        assert rank0.proc.poll() is None and time.monotonic() < deadline, rank0.tails()
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.05)
    rank0.proc.send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    rank1 = Job(argv, tmp_path, "rank1", env=_task_env(1, port))
    assert rank0.wait(120) == 75, rank0.tails()
    assert rank1.wait(60) == 75, rank1.tails()
    assert "received SIGUSR1" in rank0.stderr and \
        "preemption signal: saving step 1 and exiting" in rank0.stderr, rank0.tails()
    events = rank0.events()
    assert [e["step"] for e in events if e["kind"] == "save_committed"] == [1], events
    lease = json.loads((root / "_lease.json").read_text())
    assert lease["job"] == "slurm-4242-restart-0" and lease["released"], lease
    assert (lease["run_id"], lease["attempt"]) == ("slurm-4242", 0), lease
