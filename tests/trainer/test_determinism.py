"""``training.deterministic`` takes effect at the trainer's start-up, before CUDA could start,
and can be turned off; the process group gets the config's (ordered) timeout.

On CPU only the flags can be checked, not what they change in the GPU's kernels
(docs/trainer.md, "What has run on a GPU"). tests/conftest.py restores the process-wide
flags after each test.
"""

from __future__ import annotations

import os

import pytest
import torch

import trainer.__main__ as main_mod
from tests.e2e._jobs import TINY
from trainer.config import load_config
from trainer.distributed import DistEnv
from trainer.train import Trainer


def _flags() -> dict:
    return {"algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}


ON = {"algorithms": True, "cudnn_deterministic": True, "cudnn_benchmark": False,
      "cublas": ":4096:8"}


@pytest.fixture
def loose(monkeypatch):
    """The process as torch starts it, with cuDNN's benchmark on (as a user's code may)."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False
    torch.backends.cudnn.benchmark = True


def _trainer(*overrides: str) -> Trainer:
    cfg = load_config(str(TINY), ["--training.steps=1", *overrides])
    return Trainer(cfg, DistEnv(0, 1, 0, torch.device("cpu"), None, 0))


def test_default_is_deterministic():
    assert load_config(str(TINY), []).training.deterministic is True
    assert load_config(None, []).training.deterministic is True


def test_trainer_turns_deterministic_kernels_on(loose):
    _trainer()
    assert _flags() == ON


def test_it_can_be_turned_off(loose):
    _trainer("--training.deterministic=false")
    assert _flags() == {"algorithms": False, "cudnn_deterministic": False,
                        "cudnn_benchmark": True, "cublas": None}
    torch.use_deterministic_algorithms(True)  # as a previous Trainer in this process left it
    _trainer("--training.deterministic=false")
    assert torch.are_deterministic_algorithms_enabled() is False


def test_a_cublas_setting_of_the_user_is_kept(loose, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # deterministic too, less memory
    _trainer()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_main_sets_them_before_the_process_group_starts(loose, monkeypatch, tmp_path):
    """``python -m trainer``: the flags are set before init_distributed, which starts CUDA
    (``torch.cuda.set_device``), and the group gets the config's ordered timeout."""
    seen: dict = {}

    def fake_init(device, *, timeout_seconds):
        seen.update(_flags(), timeout_seconds=timeout_seconds, device=device)
        return DistEnv(0, 1, 0, torch.device("cpu"), None, 0)

    def fake_shutdown(env, code, **kwargs):
        seen["exit"] = code
        raise SystemExit(code)

    monkeypatch.setattr(main_mod, "init_distributed", fake_init)
    monkeypatch.setattr(main_mod, "shutdown", fake_shutdown)
    monkeypatch.setattr(main_mod, "run", lambda cfg, env, *handlers: 0)
    with pytest.raises(SystemExit):
        main_mod.main(["--config", str(TINY), "--fault.hang_timeout_seconds=200"])
    assert {k: seen[k] for k in ON} == ON
    assert seen["timeout_seconds"] == 200 + 3600 + 60 and seen["exit"] == 0
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")  # a fresh process
    with pytest.raises(SystemExit):
        main_mod.main(["--config", str(TINY), "--training.deterministic=false"])
    assert seen["algorithms"] is False and seen["cublas"] is None
