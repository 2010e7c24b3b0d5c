"""``python -m trainer`` as a user runs it: one process, no torchrun.

It trains and logs, checkpoints at the last step, says how it starts (fresh, resumed, which
step, falling back past a corrupt checkpoint), rejects bad config with exit code 2 naming
the key, checkpoints and exits 75 on SIGTERM, exits 1 when the loss guard stops it, and
never aborts at exit ("terminate called"). Exit codes are those of trainer.distributed.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys

import pytest

from tests.e2e._jobs import (
    ABORT_MARK,
    ROOT,
    TINY,
    Job,
    assert_same_checkpoint,
    base_env,
    loss_history,
    trainer_argv,
)
from trainer.distributed import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED

STEPS = 120
ARGS = (f"--training.steps={STEPS}", "--checkpoint.interval=50", "--checkpoint.keep_last=0")
LOG_LINE = re.compile(r"step\s+(\d+) \| loss ([\d.]+) \| grad norm ([\d.]+) \| (\d+) tok/s \| "
                      r"([\d.]+)s/step")


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "trainer", *args], cwd=ROOT, env=base_env(),
                         capture_output=True, text=True, timeout=timeout)
    assert ABORT_MARK not in out.stderr, out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One finished run of STEPS steps: (root, its events, its job). Tests copy the root."""
    d = tmp_path_factory.mktemp("cli-trained")
    root, jsonl = d / "ckpt", d / "events.jsonl"
    job = Job(trainer_argv(*ARGS, f"--checkpoint.root={root}", f"--metrics.jsonl_path={jsonl}"),
              d, "trained", jsonl).wait_ok()
    assert ABORT_MARK not in job.stderr, job.tails()
    return root, job.events(), job


def _copy(root, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(root, dst)
    (dst / "_lease.json").unlink(missing_ok=True)
    return dst


def test_trains_logs_and_checkpoints_the_last_step(trained):
    root, events, job = trained
    err = job.stderr
    assert re.search(r"no checkpoint under \S+: starting fresh", err), job.tails()
    rows = [(int(s), float(loss), float(gn), int(tps), float(dt))
            for s, loss, gn, tps, dt in LOG_LINE.findall(err)]
    assert [r[0] for r in rows] == [1] + list(range(10, STEPS + 1, 10)), job.tails()
    for step, loss, grad_norm, tokens_per_second, step_seconds in rows:
        assert loss > 0 and grad_norm > 0 and tokens_per_second > 0 and step_seconds > 0
    losses = loss_history(events)
    assert sorted(losses) == list(range(1, STEPS + 1))
    first, last = losses[1], sum(losses[s] for s in range(STEPS - 9, STEPS + 1)) / 10
    # ln(256) = 5.55 at the start; the synthetic chain's entropy floor is ~1.5 nats.
    assert first > 5.0 and last < first - 2.5, (first, last)
    for e in events:
        if e["kind"] == "train_step":
            assert e["tokens_per_second"] > 0 and e["step_seconds"] > 0 and e["grad_norm"] > 0
    committed = [e["step"] for e in events if e["kind"] == "save_committed"]
    assert committed == [50, 100, STEPS]
    assert (root / f"step_{STEPS:09d}" / "manifest.json").exists()


def test_load_step_resumes_that_step(trained, tmp_path):
    root, events, _ = trained
    root = _copy(root, tmp_path)
    jsonl = tmp_path / "events.jsonl"
    job = Job(trainer_argv(*ARGS, f"--checkpoint.root={root}", f"--metrics.jsonl_path={jsonl}",
                           "--checkpoint.load_step", "50"), tmp_path, "load-step", jsonl).wait_ok()
    assert re.search(r"resumed from \S+ step 50\b", job.stderr), job.tails()
    assert ABORT_MARK not in job.stderr
    # The newer checkpoints are un-committed (reversibly) and written again by this run.
    assert "un-committed checkpoint step 100" in job.stderr
    assert "un-committed checkpoint step 120" in job.stderr
    # Saving 100 again wrote a new version beside the rolled-back one, which stays intact.
    assert len(list((root / "step_000000100").glob("rolled-back-*.json"))) == 1
    from ckpt.root import CheckpointStore

    versions = CheckpointStore(root).entries(100)
    assert sorted(v.status for v in versions) == ["committed", "rolled-back"]
    for v in versions:
        assert CheckpointStore(root).life.find(v.id).manifest is not None
    got = loss_history(job.events())
    assert sorted(got) == list(range(51, STEPS + 1))
    ref = loss_history(events)
    assert all(got[s] == ref[s] for s in got)  # one process: deterministic, bit for bit
    assert [e["step"] for e in job.events() if e["kind"] == "save_committed"] == [100, STEPS]
    assert_same_checkpoint(trained[0], root, STEPS)


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(trained, tmp_path):
    root, events, _ = trained
    root = _copy(root, tmp_path)
    data = sorted((root / f"step_{STEPS:09d}").glob("*.bin"), key=lambda p: -p.stat().st_size)[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    jsonl = tmp_path / "events.jsonl"
    job = Job(trainer_argv(*ARGS, f"--checkpoint.root={root}", f"--metrics.jsonl_path={jsonl}"),
              tmp_path, "fallback", jsonl).wait_ok()
    err = job.stderr
    assert ABORT_MARK not in err
    assert re.search(rf"checkpoint step {STEPS} .*falling back", err), job.tails()
    assert data.name in err  # the warning names the corrupt file
    assert re.search(r"resumed from \S+ step 100\b", err), job.tails()
    assert any(e["kind"] == "load_fallback" for e in job.events())
    # It trains 101..120 again and the step-120 checkpoint it writes is a good one.
    assert sorted(loss_history(job.events())) == list(range(101, STEPS + 1))
    assert_same_checkpoint(trained[0], root, STEPS)


def test_sigterm_checkpoints_the_current_step_and_exits_75(tmp_path):
    root, jsonl = tmp_path / "ckpt", tmp_path / "events.jsonl"
    job = Job(trainer_argv("--training.steps=5000", "--checkpoint.interval=1000",
                           f"--checkpoint.root={root}", f"--metrics.jsonl_path={jsonl}"),
              tmp_path, "preempted", jsonl)
    job.wait_step(20)
    job.proc.send_signal(signal.SIGTERM)
    job.wait_ok(code=EXIT_PREEMPTED, timeout=60)
    last = max(e["step"] for e in job.events() if e["kind"] == "train_step")
    assert last < 5000
    committed = [e["step"] for e in job.events() if e["kind"] == "save_committed"]
    assert committed == [last], (committed, last)
    assert f"preemption signal: saving step {last} and exiting" in job.stderr, job.tails()
    manifest = json.loads((root / f"step_{last:09d}" / "manifest.json").read_text())
    assert manifest["step"] == last
    assert ABORT_MARK not in job.stderr


@pytest.mark.parametrize("args, key", [
    (("--training.stepz=5",), "training.stepz"),
    (("--training.lr=fast",), "training.lr"),
    (("--parallel.dp=2",), "parallel.dp"),  # checked against the world size (1) at start
])
def test_bad_config_exits_2_naming_the_key(args, key):
    out = _run("--config", str(TINY), *args)
    assert out.returncode == EXIT_CONFIG, (out.returncode, out.stderr[-2000:])
    assert key in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]


def test_diverging_loss_with_policy_stop_exits_1():
    out = _run("--config", str(TINY), "--training.steps=30", "--training.lr=100",
               "--fault.nan_policy=stop")
    assert out.returncode == EXIT_FAILED, (out.returncode, out.stderr[-2000:])
    assert "stopping (fault.nan_policy=stop" in out.stderr


def test_help_and_plan_help():
    out = _run("--help")
    assert out.returncode == EXIT_OK and "--training.steps" in out.stdout, out
    out = _run("plan", "--help")
    assert out.returncode == EXIT_OK, out.stderr
    assert "usage: python -m trainer plan" in out.stdout
