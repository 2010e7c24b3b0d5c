"""In-process trainers for checkpoint tests: a ``Trainer`` of configs/tiny.toml on one rank
of a ``run_ranks`` group (or alone), and its whole model and optimizer state as bytes."""

from __future__ import annotations

import torch

from tests.e2e._jobs import TINY
from trainer.config import load_config
from trainer.distributed import DistEnv
from trainer.train import Trainer

__all__ = ["COMMON", "trainer_for", "full_state", "assert_same_state"]

COMMON = ("--training.log_every=1", "--checkpoint.interval=2", "--checkpoint.async_save=false",
          "--checkpoint.keep_last=0", "--training.warmup_steps=1", "--training.global_batch_size=8")


def trainer_for(rank: int, world: int, root: str, steps: int, layout: tuple[str, ...]):
    """This rank's ``Trainer`` of configs/tiny.toml with :data:`COMMON`, checkpointing under
    ``root``, for ``steps`` steps, with ``layout``'s extra overrides."""
    cfg = load_config(str(TINY), [*COMMON, f"--checkpoint.root={root}",
                                  f"--training.steps={steps}", *layout])
    backend = "gloo" if world > 1 else None
    return Trainer(cfg, DistEnv(rank, world, rank, torch.device("cpu"), backend, 0))


def full_state(trainer) -> dict[str, tuple[str, list[int], bytes]]:
    """Model and optimizer state as full tensors' raw bytes, by key (collective on DTensors:
    every rank calls it, same order)."""
    state = {**{f"model.{k}": v for k, v in trainer.model.model_state_dict().items()},
             **{f"optim.{k}": v for k, v in
                trainer.model.optimizer_state_dict(trainer.optimizers).items()}}
    out = {}
    for key in sorted(state):
        v = state[key]
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            out[key] = (str(t.dtype), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            out[key] = (type(v).__name__, [], repr(v).encode())
    return out


def assert_same_state(want: dict, got: dict, where: str) -> None:
    assert want.keys() == got.keys(), where
    differ = [k for k in want if want[k] != got[k]]
    assert not differ, f"{where}: {len(differ)} values differ, e.g. {differ[:3]}"
