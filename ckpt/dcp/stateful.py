"""Adapters that make models and optimizers checkpointable under any parallel layout.

``ModelState(model, optimizer)`` wraps ``torch.distributed.checkpoint.state_dict``'s
``get_state_dict``/``set_state_dict``: keys are parameter names (FQNs), not optimizer
integer ids, and DDP/FSDP2/tensor-parallel wrappers are seen through, so a checkpoint saved
under one layout loads under another. The optimizer's param groups and step counters are
saved once per group (:mod:`ckpt.dcp.optim_state`), and checkpoints written with them once
per parameter still load.

Per-rank state (RNG streams, a rank's own counters) goes under a per-rank key,
:func:`rank_key`: a key several ranks share is saved once, as a replica (see
docs/store.md, "Per-rank state"). ``RNGState`` does this for the RNGs; ``PerRankState``
does it for any object.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from ckpt.dcp.optim_state import pack_optimizer_state, unpack_optimizer_state

__all__ = ["ModelState", "RNGState", "PerRankState", "rank_key", "init_optimizer_state"]


def _default_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def rank_key(rank: int | None = None) -> str:
    """The sub-key that holds rank ``rank``'s own state: ``f"rank{rank}"`` (default: this
    process's global rank, 0 without a process group)."""
    return f"rank{_default_rank() if rank is None else int(rank)}"


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
        optims = self._optims()
        for optim in (optims if isinstance(optims, (list, tuple)) else [optims]):
            init_optimizer_state(optim)  # else DCP's own init counts a step (see below)
        model_sd, optim_sd = get_state_dict(self.model, optims, options=self.options)
        out = {"model": model_sd}
        if self.optimizer is not None:
            out["optim"] = pack_optimizer_state(optim_sd)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        optim_sd = unpack_optimizer_state(state_dict.get("optim", {}))
        set_state_dict(self.model, self._optims(), model_state_dict=state_dict["model"],
                       optim_state_dict=optim_sd, options=self.options)


class RNGState:
    """Per-rank random number generator state: torch (CPU and CUDA) and Python's ``random``.

    Stored under the rank's own key (:func:`rank_key`) so that every rank restores its own
    streams; it loads only where the same global ranks exist (the same world size).

    The CUDA stream (of the current device) is part of the state wherever CUDA is available,
    whether or not anything has used CUDA yet (reading it initialises CUDA), so a job saves
    and expects the same keys before and after its first CUDA operation. Between hosts:

    - saved with CUDA, loaded without (a GPU checkpoint inspected or exported on a CPU
      host): ``rankN.cuda`` is a checkpoint key the state does not ask for, so a strict
      load refuses it (``StateMismatchError``); ``strict=False`` or ``ignore_keys=("rng.",)``
      restores the CPU and Python streams and leaves the CUDA one out (there is none here).
    - saved without CUDA, loaded with it: ``rankN.cuda`` is missing from the checkpoint, so
      a strict load refuses it; ``strict=False`` restores the CPU and Python streams and
      leaves this host's CUDA stream as it is.

    ``load_state_dict`` given a CUDA state where CUDA is not available raises
    ``ValueError`` rather than drop it silently.
    """

    def __init__(self, rank: int | None = None):
        self.rank = _default_rank() if rank is None else rank

    def state_dict(self) -> dict[str, Any]:
        import random

        state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return {rank_key(self.rank): state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        import random

        state = state_dict[rank_key(self.rank)]
        if "cuda" in state and not torch.cuda.is_available():
            raise ValueError(f"{rank_key(self.rank)} holds a CUDA RNG state but CUDA is not "
                             f"available here; load without it (strict=False, or "
                             f"ignore_keys=('rng.',) for the trainer's RNG state)")
        torch.set_rng_state(state["cpu"])
        py = state["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"])


class PerRankState:
    """Any ``state_dict()``/``load_state_dict()`` object whose state differs by rank (a
    generator, a rank's own sampler or counters), stored under :func:`rank_key` so that
    every rank saves and gets back its own.

    ``state["sampler"] = PerRankState(sampler)`` saves ``sampler.rank{r}.*`` on rank ``r``.
    Like ``RNGState`` it loads only where the same ranks exist.
    """

    def __init__(self, obj: Any, rank: int | None = None):
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"PerRankState wraps an object with state_dict() and "
                            f"load_state_dict(), got {type(obj).__name__}")
        self.obj = obj
        self.rank = _default_rank() if rank is None else rank

    def state_dict(self) -> dict[str, Any]:
        return {rank_key(self.rank): self.obj.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = rank_key(self.rank)
        if key not in state_dict:
            raise KeyError(f"no state for {key} (saved: {', '.join(sorted(state_dict))}); "
                           f"per-rank state loads only on the ranks that saved it")
        self.obj.load_state_dict(state_dict[key])


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state now, exactly as its first step would, counting no step.

    ``torch.distributed.checkpoint``'s ``get_state_dict`` initialises the state of an
    optimizer that has none by taking a step with zero gradients and lr 0, which leaves
    AdamW's step counter at 1 before training starts: its bias correction is then one step
    behind, and a run with checkpoints (whose first ``prepare``/``load`` triggers that) would
    train differently from the same run without. Here the same zero step is taken (no
    parameter moves: lr 0 scales both the update and the decoupled weight decay; the moments
    stay zero) and the counters are put back to 0, the state a fresh AdamW creates.
    """
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if optimizer.state or any(p.grad is not None for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0
