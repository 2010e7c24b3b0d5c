"""Resuming with a changed config: the logged diff, which LR schedule continues, and what a
trainer's checkpoint tells ``ckpt list`` / ``ckpt show`` (one process, in-process trainers).

Every run uses ``training.lr_decay_steps=8`` so that the schedule's horizon does not move
with ``training.steps`` (4, then 8).
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from ckpt.cli import main as cli_main
from tests.e2e._jobs import TINY
from trainer.config import TrainingConfig, load_config
from trainer.distributed import DistEnv
from trainer.train import Trainer

pytestmark = pytest.mark.timeout(180)

COMMON = ("--training.warmup_steps=2", "--training.lr_decay_steps=8", "--training.min_lr=1e-4",
          "--training.log_every=1", "--checkpoint.interval=4", "--checkpoint.async_save=false",
          "--checkpoint.keep_last=0")


def _trainer(root, steps: int, lr: float, *extra: str) -> Trainer:
    cfg = load_config(str(TINY), [*COMMON, f"--training.steps={steps}", f"--training.lr={lr}",
                                  f"--checkpoint.root={root}", *extra])
    return Trainer(cfg, DistEnv(0, 1, 0, torch.device("cpu"), None, 0))


def _lrs(trainer: Trainer) -> dict[int, float]:
    return {e.step: e.fields["lr"] for e in trainer.events.recent if e.kind == "train_step"}


def _schedule(lr: float) -> TrainingConfig:
    return TrainingConfig(steps=8, lr=lr, min_lr=1e-4, warmup_steps=2, lr_decay_steps=8)


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """A root with the checkpoint of step 4 of a run at lr 1e-2, and that run's losses."""
    root = tmp_path_factory.mktemp("resume_cfg") / "ckpt"
    first = _trainer(root, 4, 1e-2)
    assert first.fit() == 0
    return root, first


def _copy(four_steps, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(four_steps[0], root)
    return root


def test_final_save_records_loss_and_config(four_steps, capsys):
    root, first = four_steps
    capsys.readouterr()
    assert cli_main(["list", str(root)]) == 0
    rows = {ln.split()[0]: ln.split() for ln in capsys.readouterr().out.splitlines()[1:]}
    assert list(rows) == ["4"]                        # the final save (steps == interval)
    assert rows["4"][7] == f"{first.losses[-1][1]:.4g}"  # its loss, not "-"
    assert cli_main(["show", str(root), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["config_fingerprint"] == first.fingerprint
    assert info["user_metadata"]["config"]["training"]["lr"] == 1e-2
    assert info["user_metadata"]["loss"] == first.losses[-1][1]


def test_changed_lr_without_override_keeps_the_checkpoints_schedule(four_steps, tmp_path,
                                                                     caplog):
    root = _copy(four_steps, tmp_path)
    caplog.set_level(logging.INFO, logger="trainer")
    resumed = _trainer(root, 8, 1e-3)
    assert resumed.fit() == 0
    blocks = [r.getMessage() for r in caplog.records if "config changes" in r.getMessage()]
    assert len(blocks) == 1, blocks                     # one block
    block = blocks[0]
    assert "training.lr: 0.01 -> 0.001" in block and "training.steps: 4 -> 8" in block
    assert "training.override_schedule_on_resume=true" in block
    assert "schedule continues" in block
    lrs = _lrs(resumed)
    assert list(lrs) == [5, 6, 7, 8]
    old = _schedule(1e-2)
    for step, lr in lrs.items():
        assert lr == pytest.approx(old.lr_at(step), rel=1e-9), step


def test_changed_lr_with_override_applies_from_the_resumed_step(four_steps, tmp_path, caplog):
    root = _copy(four_steps, tmp_path)
    new = _schedule(1e-3)
    overrides = ("--training.override_schedule_on_resume=true",)
    # The LR of the first resumed step is already the new schedule's.
    probe = _trainer(root, 8, 1e-3, *overrides)
    assert probe.resume() == 4
    for o in probe.optimizers:
        assert [g["lr"] for g in o.param_groups] == \
            [pytest.approx(new.lr_at(4), rel=1e-9)] * len(o.param_groups)
    probe.manager.close()
    caplog.set_level(logging.INFO, logger="trainer")
    resumed = _trainer(root, 8, 1e-3, *overrides)
    assert resumed.fit() == 0
    block = "\n".join(r.getMessage() for r in caplog.records
                      if "config changes" in r.getMessage())
    assert "training.lr: 0.01 -> 0.001" in block and "applies from step 4" in block
    lrs = _lrs(resumed)
    assert list(lrs) == [5, 6, 7, 8]
    for step, lr in lrs.items():
        assert lr == pytest.approx(new.lr_at(step), rel=1e-9), step
    # The next resume sees no schedule change: the run's own config was stored.
    caplog.clear()
    again = _trainer(root, 8, 1e-3, *overrides)
    assert again.fit() == 0
    assert not any("training.lr:" in r.getMessage() for r in caplog.records)
