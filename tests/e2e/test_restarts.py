"""Automatic recovery under ``torchrun --max-restarts``: a dead or hung rank, many times.

With gloo, torchrun restarts used to be flaky (PLATFORM.md: 10 of 20 recovered): restarted
workers read the dead attempt's addresses from the shared rendezvous store. The trainer
keys every attempt apart (``trainer.distributed``: a PrefixStore per restart count), so
these tests run torchrun with its defaults (no ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``) and
recover every time:

* one job whose workers are SIGKILLed four times, each shortly after a checkpoint (rank 1,
  rank 0, rank 1, rank 0): it resumes after each kill, exits 0, and ends bit for bit where an
  uninterrupted run ends (losses and final checkpoint). ``E2E_RESTART_RUNS=N`` repeats it N
  times (a soak test);
* one job with a rank that stops making progress (SIGSTOP): the other rank's hang watchdog
  dumps its stacks and exits 124, torchrun restarts the group (it SIGKILLs the stopped
  process after its shutdown grace: 5 s here, ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s by
  default), and the job resumes and finishes, again bit for bit.
"""

from __future__ import annotations

import os
import re
import signal

import pytest

from tests.e2e._jobs import (
    ABORT_MARK,
    COMMON,
    STEPS,
    Job,
    all_losses,
    assert_same_checkpoint,
    base_env,
    loss_history,
    straight_run,
    trainer_argv,
)

NUM_KILLS = 4
RESTART_RUNS = int(os.environ.get("E2E_RESTART_RUNS", "1"))


def _check_same_as_straight(events, root) -> None:
    ref_root, ref_events = straight_run(COMMON)
    ref = loss_history(ref_events)
    got = loss_history(events)
    assert got == ref, {s: (got.get(s), ref[s]) for s in ref if got.get(s) != ref[s]}
    for step, values in all_losses(events).items():
        assert all(v == ref[step] for v in values), (step, values, ref[step])
    assert_same_checkpoint(ref_root, root, STEPS)


def _resumed_steps(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"resumed from \S+ step (\d+)", text)]


@pytest.mark.parametrize("run", range(RESTART_RUNS))
def test_killed_worker_restarts_and_resumes_every_time(tmp_path, run):
    straight_run(COMMON)  # the reference, outside this job's timing
    root, jsonl = tmp_path / "ckpt", tmp_path / "events.jsonl"
    # Checkpoints every 5 steps (the reference saves every 7: the cadence does not change
    # the trajectory), so four kills each land after a commit well before the end.
    job = Job(trainer_argv(*COMMON, "--checkpoint.interval=5", f"--checkpoint.root={root}",
                           f"--metrics.jsonl_path={jsonl}", nproc=2,
                           max_restarts=NUM_KILLS + 1),
              tmp_path, "restarts", jsonl)
    kills = []
    try:
        seen = 0  # events before this index belong to attempts already killed
        workers = job.wait_workers(2)
        for i in range(NUM_KILLS):
            committed = job.wait_event(lambda e: e["kind"] == "save_committed"
                                       and e["step"] < STEPS, since=seen,
                                       what=f"a commit before kill {i + 1}")
            job.wait_step(committed["step"] + 1, since=job.last_index)
            rank = (i + 1) % 2
            pid = job.signal_rank(rank, signal.SIGKILL)
            kills.append((committed["step"], rank, pid))
            resumed = job.wait_event(lambda e: e["kind"] == "resumed", since=job.last_index,
                                     what=f"resume after kill {i + 1}")
            seen = job.last_index + 1
            assert resumed["step"] >= committed["step"], (resumed, committed)
            workers = job.wait_workers(2, exclude=workers.values())
        job.wait_ok(timeout=120)
    finally:
        if job.proc.poll() is None:
            job.kill_all()
    out = job.stdout + job.stderr
    assert ABORT_MARK not in out, job.tails()
    assert len(_resumed_steps(out)) == NUM_KILLS, (kills, _resumed_steps(out), job.tails())
    resumed_events = [e["step"] for e in job.events() if e["kind"] == "resumed"]
    assert len(resumed_events) == NUM_KILLS, resumed_events
    _check_same_as_straight(job.events(), root)


@pytest.mark.slow
def test_hung_rank_is_detected_and_the_job_resumes(tmp_path):
    straight_run(COMMON)
    root, jsonl = tmp_path / "ckpt", tmp_path / "events.jsonl"
    job = Job(trainer_argv(*COMMON, f"--checkpoint.root={root}", f"--metrics.jsonl_path={jsonl}",
                           "--fault.hang_timeout_seconds=15", nproc=2, max_restarts=2),
              tmp_path, "hang", jsonl, env=base_env(TORCH_ELASTIC_SHUTDOWN_TIMEOUT="5"))
    stopped = None
    try:
        committed = job.wait_event(lambda e: e["kind"] == "save_committed" and e["step"] == 14,
                                   what="commit of step 14")
        job.wait_step(committed["step"] + 1)
        stopped = job.signal_rank(1, signal.SIGSTOP)  # alive, holds its sockets, does nothing
        resumed = job.wait_event(lambda e: e["kind"] == "resumed", timeout=150,
                                 what="resume after the hang")
        assert resumed["step"] == 14
        job.wait_ok(timeout=120)
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if job.proc.poll() is None:
            job.kill_all()
    out = job.stdout + job.stderr
    assert "watchdog: no training progress" in out, job.tails()
    hangs = [e["step"] for e in job.events() if e["kind"] == "failure"
             and e.get("failure") == "hang"]
    assert len(hangs) == 1 and hangs[0] > 14, (hangs, job.tails())
    assert "most recent call first" in out, job.tails()  # the stacks of every thread
    assert "exitcode: 124" in out or "exit code: 124" in out, job.tails()
    assert not os.path.exists(f"/proc/{stopped}") or "Z" in open(f"/proc/{stopped}/stat").read()
    assert _resumed_steps(out) == [14], job.tails()
    assert ABORT_MARK not in out
    _check_same_as_straight(job.events(), root)
