"""Adapters that make models and optimizers checkpointable under any parallel layout.

``ModelState(model, optimizer)`` wraps ``torch.distributed.checkpoint.state_dict``'s
``get_state_dict``/``set_state_dict``: keys are parameter names (FQNs), not optimizer
integer ids, and DDP/FSDP2/tensor-parallel wrappers are seen through, so a checkpoint saved
under one layout loads under another.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

__all__ = ["ModelState", "RNGState"]


class ModelState:
    """State of one model (or a list of pipeline-stage modules) and its optimizer(s)."""

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module],
                 optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
                 *, strict: bool = True):
        self.model = model
        self.optimizer = optimizer
        self.options = StateDictOptions(strict=strict)

    def _optims(self):
        if self.optimizer is None:
            return []
        return self.optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self._optims(), options=self.options)
        out = {"model": model_sd}
        if self.optimizer is not None:
            out["optim"] = optim_sd
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self._optims(), model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict.get("optim", {}), options=self.options)


class RNGState:
    """Per-rank random number generator state: torch (CPU and CUDA) and Python's ``random``.

    Stored under the rank's own key so that every rank restores its own streams.
    """

    def __init__(self, rank: int | None = None):
        if rank is None:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank

    def state_dict(self) -> dict[str, Any]:
        import random

        state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return {f"rank{self.rank}": state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        import random

        state = state_dict[f"rank{self.rank}"]
        torch.set_rng_state(state["cpu"])
        py = state["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
