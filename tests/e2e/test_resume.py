"""Checkpoints and automatic resume, end to end: SIGKILL a training job, run it again.

A job of 2 ranks (dp2, FSDP2) on the tiny config is SIGKILLed, every process at once as in a
machine failure, at a step drawn from a seed (and once while a checkpoint is being written);
running the very same command again resumes from the newest committed checkpoint and must
end bit for bit where an uninterrupted run ends: the same loss at every step (the last
logged value of each step across both launches; replayed steps must repeat their loss
exactly too) and the same final checkpoint, consolidated, tensor for tensor (parameters,
AdamW moments, scheduler, data position, loss-guard window, RNG streams). The same holds on
a tp2 layout. Resumed on another layout, the job continues from the same state within a
tolerance (see ``test_resume_on_another_layout``).
"""

from __future__ import annotations

import math
import random
import re
import shutil
import signal

import pytest

from ckpt.format import step_dirname
from ckpt.root import CheckpointStore
from tests.e2e._jobs import (
    ABORT_MARK,
    COMMON,
    INTERVAL,
    ROOT,
    STEPS,
    Job,
    all_losses,
    assert_same_checkpoint,
    base_env,
    flat_checkpoint,
    loss_history,
    straight_run,
    trainer_argv,
)

TP2 = ("--parallel.tp=2", "--parallel.dp=1")


def _resumed_step(text: str) -> int | None:
    m = re.search(r"resumed from \S+ step (\d+)", text)
    return int(m.group(1)) if m else None


def _committed(events) -> list[int]:
    return [e["step"] for e in events if e["kind"] == "save_committed"]


def _check_same_as_straight(events, root, straight) -> None:
    ref_root, ref_events = straight
    ref = loss_history(ref_events)
    got = loss_history(events)
    assert sorted(got) == list(range(1, STEPS + 1)), sorted(got)
    assert got == ref, {s: (got[s], ref[s]) for s in ref if got.get(s) != ref[s]}
    # A step run twice (before the kill and again after the resume) has the same loss.
    for step, values in all_losses(events).items():
        assert all(v == ref[step] for v in values), (step, values, ref[step])
    assert_same_checkpoint(ref_root, root, STEPS)


def _kill_and_resume(tmp_path, kill_after_step: int, layout: tuple[str, ...] = ()):
    """Run, SIGKILL everything once ``kill_after_step`` is logged, run the same again."""
    root, jsonl = tmp_path / "ckpt", tmp_path / "events.jsonl"
    argv = trainer_argv(*COMMON, *layout, f"--checkpoint.root={root}",
                        f"--metrics.jsonl_path={jsonl}", nproc=2)
    first = Job(argv, tmp_path, "killed", jsonl)
    # At least one checkpoint must be committed, or there is nothing to resume from.
    first.wait_event(lambda e: e["kind"] == "save_committed", what="the first commit")
    first.wait_step(kill_after_step)
    first.kill_all()
    assert first.proc.returncode == -9, first.tails()
    events_before = list(first.events())
    last_logged = max(e["step"] for e in events_before if e["kind"] == "train_step")
    assert last_logged < STEPS, "the job finished before it could be killed"
    second = Job(argv, tmp_path, "resumed", jsonl).wait_ok()
    assert ABORT_MARK not in second.stderr, second.tails()
    return root, second, events_before, last_logged


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_killed_at_random_step_resumes_bit_for_bit(tmp_path, seed):
    straight = straight_run(COMMON)
    kill_step = random.Random(seed).randint(INTERVAL + 1, STEPS - 2)
    root, second, before, last_logged = _kill_and_resume(tmp_path, kill_step)
    committed_before = _committed(before)
    resumed = _resumed_step(second.stderr)
    assert resumed is not None, second.tails()
    # The newest commit may have landed in the instant between its manifest and its event.
    assert resumed % INTERVAL == 0 and max(committed_before) <= resumed <= last_logged, \
        (resumed, committed_before, last_logged)
    _check_same_as_straight(second.events(), root, straight)


def test_killed_while_saving_resumes_bit_for_bit(tmp_path):
    """Killed with a save staged but not committed (step 14, or 21 if the save of 14 was
    skipped because the one of step 7 was still persisting): resume from step 7."""
    straight = straight_run(COMMON)
    root, jsonl = tmp_path / "ckpt", tmp_path / "events.jsonl"
    overrides = (*COMMON, f"--checkpoint.root={root}", f"--metrics.jsonl_path={jsonl}")
    env = base_env(E2E_SLOW_FROM_STEP=str(INTERVAL + 1), E2E_WRITE_DELAY_SECONDS="30")
    first = Job(trainer_argv(*overrides, nproc=2, script=ROOT / "tests/e2e/_slow_storage.py"),
                tmp_path, "killed", jsonl, env=env)
    staged = first.wait_event(lambda e: e["kind"] == "save_staged" and e["step"] > INTERVAL,
                              what="a slow save staged")["step"]
    first.wait_step(staged + 2)  # training goes on while the save persists
    first.kill_all()
    assert _committed(first.events()) == [INTERVAL]
    step_dir = root / f"step_{staged:09d}"
    assert list(step_dir.glob("pending-*.json")) and not (step_dir / "manifest.json").exists()

    second = Job(trainer_argv(*overrides, nproc=2), tmp_path, "resumed", jsonl).wait_ok()
    assert _resumed_step(second.stderr) == INTERVAL, second.tails()
    assert re.search(rf"removed \d+ leftover file\(s\) of aborted saves at step {staged}\b",
                     second.stderr), second.tails()
    assert ABORT_MARK not in second.stderr
    _check_same_as_straight(second.events(), root, straight)
    assert (step_dir / "manifest.json").exists()  # saved again, properly, by the resumed run


def test_preempted_job_checkpoints_and_resumes_bit_for_bit(tmp_path):
    """SIGTERM to torchrun, as a scheduler preempting the job: the agent passes it to every
    worker, which agree, checkpoint the step they are at and leave with 75; the same command
    resumes from exactly that step."""
    straight = straight_run(COMMON)
    root, jsonl = tmp_path / "ckpt", tmp_path / "events.jsonl"
    argv = trainer_argv(*COMMON, f"--checkpoint.root={root}", f"--metrics.jsonl_path={jsonl}",
                        nproc=2)
    first = Job(argv, tmp_path, "preempted", jsonl)
    first.wait_step(INTERVAL + 3)
    first.proc.send_signal(signal.SIGTERM)
    first.wait(timeout=60)  # torchrun itself reports the signal (SignalException, exit 1)
    events = first.events()
    last = max(e["step"] for e in events if e["kind"] == "train_step")
    assert last < STEPS, last
    assert _committed(events)[-1] == last, (_committed(events), last)
    assert [e["step"] for e in events if e.get("failure") == "preempted"] == [last]
    assert first.stderr.count(f"preemption signal: saving step {last} and exiting") == 2
    assert ABORT_MARK not in first.stderr
    second = Job(argv, tmp_path, "resumed", jsonl).wait_ok()
    assert _resumed_step(second.stderr) == last, second.tails()
    _check_same_as_straight(second.events(), root, straight)


def test_tp2_killed_resumes_bit_for_bit(tmp_path):
    straight = straight_run((*COMMON, *TP2))
    root, second, _, _ = _kill_and_resume(tmp_path, 17, TP2)
    assert _resumed_step(second.stderr) == 14, second.tails()
    _check_same_as_straight(second.events(), root, straight)


@pytest.mark.parametrize("layout", ["one-process", "tp2"])
def test_resume_on_another_layout(tmp_path, layout):
    """Saved on dp2 at step 14, resumed by one process (no torchrun) or on tp2: the same
    state, then within tolerance of the dp2 run.

    Loading reshards bit for bit: the step-14 checkpoint is what dp2 wrote, and the loss of
    step 15, computed from the loaded parameters on the same global batch, matches to float32
    rounding. Training on is not bit for bit: dp2 averages two half-batch gradients with an
    all-reduce, one process takes the mean over the whole batch, tp2 splits the matmuls'
    inner sums, so sums run in another order and differ in the last bit or two (float32
    epsilon is 1.2e-7). AdamW normalises each update by sqrt(v), so those differences do
    not shrink with the gradient, but over 16 steps at lr <= 3e-3 they stay at that level
    (measured: losses within 1.2e-7 relative, parameters within 6e-8 absolute). The bounds,
    1e-6 for step 15 and 1e-5 after, leave a 10-100x margin, while a wrong resume (lost
    optimizer moments, a wrong data position, a reset schedule) moves losses by 1e-3 or more.
    """
    ref_root, ref_events = straight_run(COMMON)
    ref = loss_history(ref_events)
    # Step 14, or the newest before it: on a loaded machine the straight run may skip a
    # save while the one before it still persists.
    saved = max(s for s in CheckpointStore(str(ref_root)).committed_steps() if s <= 14)
    root, jsonl = tmp_path / "ckpt", tmp_path / "events.jsonl"
    root.mkdir()
    folder = step_dirname(saved)
    shutil.copytree(ref_root / folder, root / folder)
    nproc, extra = (None, ()) if layout == "one-process" else (2, TP2)
    job = Job(trainer_argv(*COMMON, *extra, f"--checkpoint.root={root}",
                           f"--metrics.jsonl_path={jsonl}", nproc=nproc),
              tmp_path, layout, jsonl).wait_ok()
    assert "resharded" in job.stderr and _resumed_step(job.stderr) == saved, job.tails()
    assert ABORT_MARK not in job.stderr
    assert_same_checkpoint(ref_root, root, saved)  # the checkpoint it loaded is untouched
    got = loss_history(job.events())
    assert sorted(got) == list(range(saved + 1, STEPS + 1))
    first = saved + 1
    assert math.isclose(got[first], ref[first], rel_tol=1e-6), (got[first], ref[first])
    for step in got:
        assert math.isclose(got[step], ref[step], rel_tol=1e-5), (step, got[step], ref[step])
    a, b = flat_checkpoint(ref_root, STEPS), flat_checkpoint(root, STEPS)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a if k.startswith("app.model."))
    assert worst < 1e-5, worst
    assert b["trainer.step"] == STEPS
    assert b["data.next_batch"] == a["data.next_batch"] == STEPS


def test_checkpointing_does_not_change_the_trajectory(tmp_path):
    """The same losses, bit for bit, with checkpoints every 2 steps and with none (one
    process, in-process trainers). Saving and resuming can only be exact if saving itself
    leaves the run alone (e.g. it must not initialise the optimizer state differently)."""
    import torch

    from trainer.config import load_config
    from trainer.distributed import DistEnv
    from trainer.train import Trainer

    def losses(*overrides):
        cfg = load_config(str(ROOT / "configs" / "tiny.toml"), ["--training.steps=8", *overrides])
        trainer = Trainer(cfg, DistEnv(0, 1, 0, torch.device("cpu"), None, 0))
        assert trainer.fit() == 0
        return trainer.losses

    plain = losses()
    saved = losses(f"--checkpoint.root={tmp_path / 'ckpt'}", "--checkpoint.interval=2")
    assert len(plain) == 8 and saved == plain
