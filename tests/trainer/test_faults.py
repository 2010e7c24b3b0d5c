"""Failure detectors (trainer.faults) and what the training loop does with a bad loss.

The detectors are tested alone; the NaN policies (``skip``, ``rollback``, ``stop``) on a real
single-process :class:`trainer.train.Trainer` (no process group) whose ``train_step`` is
wrapped to return NaN for chosen global batches.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from trainer.config import load_config
from trainer.distributed import EXIT_FAILED, EXIT_HANG, EXIT_OK, DistEnv
from trainer.faults import HangWatchdog, LossGuard, Preemption, StragglerDetector
from trainer.train import Trainer, TrainingStopped, run

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"
NAN = float("nan")


# -- LossGuard ---------------------------------------------------------------------------------
def test_loss_guard_flags_non_finite_loss_and_grad_norm():
    guard = LossGuard(spike_factor=10.0, window=3)
    assert guard.check(5.0, 1.0) is None
    assert guard.check(NAN, 1.0) == "nan"
    assert guard.check(math.inf) == "nan"
    assert guard.check(-math.inf) == "nan"
    assert guard.check(5.0, math.inf) == "nan"  # a finite loss with overflowing gradients
    assert guard.check(5.0, NAN) == "nan"
    assert list(guard.window) == [5.0]  # bad values are never recorded


def test_loss_guard_spike_needs_a_full_window():
    guard = LossGuard(spike_factor=3.0, window=4)
    for loss in (1.0, 1.0, 1.0):
        assert guard.check(loss) is None
    assert guard.check(100.0) is None  # window not full yet: no reference to compare with
    guard = LossGuard(spike_factor=3.0, window=4)
    for loss in (2.0, 2.0, 2.0, 2.0):
        assert guard.check(loss) is None
    assert guard.check(6.1) == "spike"  # > 3 x mean(2.0)
    assert guard.check(5.9) is None     # within the factor: recorded
    assert list(guard.window) == [2.0, 2.0, 2.0, 5.9]


def test_loss_guard_window_slides_and_spike_detection_can_be_off():
    guard = LossGuard(spike_factor=2.0, window=2)
    for loss in (1.0, 1.0, 1.9, 2.8):  # the mean follows a rising loss
        assert guard.check(loss) is None
    assert list(guard.window) == [1.9, 2.8]
    assert guard.check(4.8) == "spike"  # > 2 x 2.35
    assert guard.check(4.6) is None and guard.check(100.0) == "spike"
    off = LossGuard(spike_factor=0.0, window=2)
    for loss in (1.0, 1.0, 1e6):
        assert off.check(loss) is None
    assert off.check(NAN) == "nan"  # non-finite is always bad


def test_loss_guard_state_round_trip():
    guard = LossGuard(spike_factor=3.0, window=3)
    for loss in (1.0, 2.0, 3.0, 4.0):
        guard.check(loss)
    other = LossGuard(spike_factor=3.0, window=3)
    other.load_state_dict(guard.state_dict())
    assert list(other.window) == [2.0, 3.0, 4.0]
    assert other.check(9.5) == guard.check(9.5) == "spike"  # > 3 x mean 3.0
    assert other.check(8.5) is None and guard.check(8.5) is None
    assert list(other.window) == list(guard.window) == [3.0, 4.0, 8.5]


# -- StragglerDetector ---------------------------------------------------------------------------
def test_straggler_detector():
    det = StragglerDetector(factor=2.0)
    assert det.find([0.10, 0.11, 0.09, 0.35]) == [3]
    assert det.find([0.10, 0.50, 0.10, 0.45]) == [1, 3]
    assert det.find([0.10, 0.25]) == [1]        # 2 ranks: the slow one against the fast one
    assert det.find([0.10, 0.19, 0.10]) == []  # within the factor
    assert det.find([0.5]) == []               # one rank has no peers
    assert det.find([0.0, 0.0]) == []
    assert StragglerDetector(factor=0).find([0.1, 10.0, 0.1]) == []


# -- Preemption --------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_flag_records_the_signal_and_uninstalls(sig):
    before = signal.getsignal(sig)
    flag = Preemption().install()
    try:
        assert flag.received is None
        os.kill(os.getpid(), sig)
        assert flag.received == sig
    finally:
        flag.uninstall()
    assert signal.getsignal(sig) == before


# -- HangWatchdog --------------------------------------------------------------------------------
def _python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_hang_watchdog_exits_124_and_dumps_every_thread():
    out = _python("""
        import time
        from trainer.faults import HangWatchdog
        wd = HangWatchdog(1.0, on_hang=lambda idle: print("on_hang", idle > 1.0, flush=True))
        wd.start()
        def stuck_in_a_collective():
            time.sleep(60)
        stuck_in_a_collective()
        print("not reached")
    """)
    assert out.returncode == EXIT_HANG == 124, (out.returncode, out.stderr)
    assert "watchdog: no training progress" in out.stderr
    assert out.stderr.count("most recent call first") >= 2  # the watchdog's and main's
    assert "stuck_in_a_collective" in out.stderr  # the main thread's stack shows where it hung
    assert "on_hang True" in out.stdout and "not reached" not in out.stdout


def test_hang_watchdog_stays_quiet_while_steps_complete():
    out = _python("""
        import time
        from trainer.faults import HangWatchdog
        wd = HangWatchdog(0.8).start()
        wd.grace_seconds = 1.0                 # the first step may take longer
        time.sleep(1.2)
        for _ in range(12):                    # 2.4 s of steps, each well within the limit
            wd.progress()
            time.sleep(0.2)
        wd.stop()
        time.sleep(1.2)                        # stopped: no more checks
        print("done")
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done" and "watchdog" not in out.stderr


def test_hang_watchdog_off_when_timeout_is_zero():
    wd = HangWatchdog(0.0).start()
    assert wd._thread is None
    wd.stop()


# -- NaN policies of the loop ----------------------------------------------------------------------
def _trainer(tmp_path, *overrides: str, interval: int = 5) -> Trainer:
    cfg = load_config(str(TINY), ["--training.steps=12", "--training.log_every=1",
                                  f"--checkpoint.root={tmp_path / 'ckpt'}",
                                  f"--checkpoint.interval={interval}",
                                  "--checkpoint.async_save=false", *overrides])
    return Trainer(cfg, DistEnv(0, 1, 0, torch.device("cpu"), None, 0))


@pytest.fixture
def nan_at(monkeypatch):
    """``nan_at(batches)``: train_step returns a NaN loss for those global batch indices."""
    def install(bad):
        real = Trainer.train_step
        calls = []

        def train_step(self):
            batch = self.loader.global_batch_index
            loss, grad_norm = real(self)
            calls.append(batch)
            assert len(calls) < 200, "runaway loop"
            return (NAN, grad_norm) if bad(batch) else (loss, grad_norm)

        monkeypatch.setattr(Trainer, "train_step", train_step)
        return calls
    return install


def _steps(trainer: Trainer, kind: str = "train_step") -> list[tuple[int, float]]:
    return [(e.step, e.fields.get("loss")) for e in trainer.events.recent if e.kind == kind]


def _adam_steps(trainer: Trainer) -> int:
    state = trainer.optimizers[0].state
    return int(next(iter(state.values()))["step"])


def test_nan_policy_skip_drops_the_update_and_goes_on(tmp_path, nan_at):
    nan_at(lambda b: b == 7)  # step 8
    trainer = _trainer(tmp_path, "--fault.nan_policy=skip")
    assert trainer.fit() == EXIT_OK
    assert trainer.step == 12 and trainer.loader.global_batch_index == 12
    steps = _steps(trainer)
    assert [s for s, _ in steps] == list(range(1, 13))
    assert math.isnan(dict(steps)[8])
    failures = [(e.step, e.fields["failure"]) for e in trainer.events.recent
                if e.kind == "failure"]
    assert failures == [(8, "nan")]
    assert _adam_steps(trainer) == 11          # no optimizer update for the bad step
    assert trainer.schedulers[0].last_epoch == 11
    assert trainer.num_skipped_steps == 0      # reset by the next good step
    assert all(math.isfinite(x) for x in trainer.guard.window)


def test_nan_policy_skip_stops_after_max_skips_consecutive(tmp_path, nan_at):
    calls = nan_at(lambda b: b >= 3)
    cfg = load_config(str(TINY), ["--training.steps=12", "--fault.nan_policy=skip",
                                  "--fault.max_skips=3"])
    assert run(cfg, DistEnv(0, 1, 0, torch.device("cpu"), None, 0)) == EXIT_FAILED
    assert calls == [0, 1, 2, 3, 4, 5, 6]  # the 4th bad step in a row stops it


def test_nan_policy_stop_raises_at_the_first_bad_step(tmp_path, nan_at):
    nan_at(lambda b: b == 6)
    trainer = _trainer(tmp_path, "--fault.nan_policy=stop")
    with pytest.raises(TrainingStopped, match=r"step 7: nan loss nan; stopping"):
        trainer.fit()
    assert trainer.step == 7
    # The run ended cleanly: its last periodic checkpoint is committed, the lease released.
    assert (tmp_path / "ckpt" / "step_000000005" / "manifest.json").exists()
    lease = json.loads((tmp_path / "ckpt" / "_lease.json").read_text())
    assert lease["released"] is True


def test_nan_policy_rollback_reloads_and_skips_the_bad_batch(tmp_path, nan_at):
    nan_at(lambda b: b == 7)  # step 8; the last checkpoint is step 5
    trainer = _trainer(tmp_path, "--fault.nan_policy=rollback")
    assert trainer.fit() == EXIT_OK
    steps = [s for s, _ in _steps(trainer)]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8, 6, 7, 8, 9, 10, 11, 12]
    # Batches 0..7, then 8..14 for steps 6..12: the bad batch 7 is not seen again.
    assert trainer.loader.global_batch_index == 15
    assert _adam_steps(trainer) == 12 and trainer.schedulers[0].last_epoch == 12
    assert trainer.num_skipped_steps == 0


def test_nan_policy_rollback_gives_up_after_max_skips(tmp_path, nan_at):
    """A loss that is bad after every rollback must not roll back forever."""
    calls = nan_at(lambda b: b >= 7)
    trainer = _trainer(tmp_path, "--fault.nan_policy=rollback", "--fault.max_skips=2")
    with pytest.raises(TrainingStopped, match="3 bad steps"):
        trainer.fit()
    # Bad at step 8 (batch 7), rolled back to step 5; bad at step 6 (batch 8), rolled back
    # again; bad at step 6 (batch 9): the third bad step in a row exceeds max_skips=2.
    assert calls == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
