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
            out["optim"] = pack_optimizer_state(optim_sd, params=model_sd)
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
    """Create the optimizer's state now, as its own first step would, changing nothing else.

    ``torch.distributed.checkpoint``'s ``get_state_dict``/``set_state_dict`` initialise an
    optimizer without state by stepping it with zero gradients and lr 0: a step that counts
    (AdamW's bias correction is then one step behind), runs the optimizer's step hooks and,
    where weight decay enters the gradient (Adam, SGD with momentum, RMSprop, Adagrad ...),
    moves the moments. A job that checkpoints would train differently from the same job
    without. ``ModelState.state_dict`` (every save and load through it) and the trainer
    call this first, so that DCP finds the state made and never steps.

    Contract, for an optimizer that has no state yet (one that has some is left as it is):
    every parameter that requires a gradient gets the state its optimizer's first step
    expects to find, with the values that step's lazy initialisation gives it (moments
    zero, ``step`` 0, Adagrad's sum ``initial_accumulator_value``, NAdam's ``mu_product``
    and ASGD's ``mu`` 1, Rprop's step sizes and ASGD's ``eta`` the group's lr now); state
    the first step makes from the gradient itself is left out (SGD's momentum buffer, which
    starts as the first gradient: its parameter's state is empty, as is that of an
    optimizer that keeps none, SGD without momentum). Nothing else changes: no parameter,
    gradient, hyperparameter, step hook or LR-scheduler counter is touched. Every step then
    does exactly what it would have done without this call, bit for bit, and so after a
    save and a resume (``tests/ckpt/dcp/test_optim_trajectory.py`` checks every optimizer
    of ``torch.optim``).

    How: the optimizer's own step (hooks left out) creates each parameter's state on a
    stand-in, a zero tensor like the parameter with a zero gradient, one parameter at a
    time (memory: two copies of the largest parameter); the state then goes to the
    parameter with its values reset as above. For an optimizer outside ``torch.optim`` the
    values are those its step with zero gradients leaves, step counters 0 (exact for
    moments of the gradient). ``LBFGS`` is refused (``ValueError``): its state (one, on its
    first parameter, with lists of tensors) does not go through DCP's optimizer state
    dicts at all.
    """
    if optimizer.state:
        return
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("LBFGS keeps one state for all its parameters, with lists of tensors, "
                         "which torch.distributed.checkpoint's optimizer state dicts do not "
                         "take; checkpoint its parameters (the model) without it")
    step = type(optimizer).step
    if getattr(step, "hooked", False):  # torch's wrapper that runs the step hooks
        step = step.__wrapped__
    groups = optimizer.param_groups
    sparse = isinstance(optimizer, torch.optim.SparseAdam)
    initial = _initial_values(optimizer)
    try:
        for group in groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                stand_in = torch.zeros_like(p)
                grad = torch.zeros_like(p)
                stand_in.grad = grad.to_sparse() if sparse else grad
                optimizer.param_groups = [{**group, "params": [stand_in]}]
                step(optimizer)
                state = optimizer.state.pop(stand_in, None) or {}
                for key in [k for k in state if initial.get(k) is _FROM_GRADIENT]:
                    del state[key]
                for key, value in state.items():
                    state[key] = _reset(key, value, initial.get(key), optimizer, group, p)
                # Even empty: DCP steps an optimizer whose state is empty.
                optimizer.state[p] = state
    except BaseException:
        optimizer.state.clear()  # all or nothing: it had none
        raise
    finally:
        optimizer.param_groups = groups


def _lr(_: Any, group: dict, p: torch.Tensor) -> Any:
    lr = group["lr"]
    lr = lr.item() if isinstance(lr, torch.Tensor) else lr
    return complex(lr, lr) if p.is_complex() else lr


def _accumulator(optimizer: Any, _: dict, p: torch.Tensor) -> Any:
    value = optimizer.defaults["initial_accumulator_value"]  # as Adagrad reads it
    return complex(value, value) if p.is_complex() else value


# State the first step makes from the gradient itself (left out: the step makes it).
_FROM_GRADIENT = object()
# The values torch's optimizers give their state at the first step (besides ``step``: 0);
# a key not listed keeps what the stand-in's step left. Found along the optimizer's MRO.
_INITIAL: dict[type, dict[str, Any]] = {
    torch.optim.SGD: {"momentum_buffer": _FROM_GRADIENT},
    torch.optim.Adam: {"exp_avg": 0, "exp_avg_sq": 0, "max_exp_avg_sq": 0},
    torch.optim.AdamW: {"exp_avg": 0, "exp_avg_sq": 0, "max_exp_avg_sq": 0},
    torch.optim.Adamax: {"exp_avg": 0, "exp_inf": 0},
    torch.optim.NAdam: {"exp_avg": 0, "exp_avg_sq": 0, "mu_product": 1},
    torch.optim.RAdam: {"exp_avg": 0, "exp_avg_sq": 0},
    torch.optim.Adagrad: {"sum": _accumulator},
    torch.optim.Adadelta: {"square_avg": 0, "acc_delta": 0},
    torch.optim.RMSprop: {"square_avg": 0, "momentum_buffer": 0, "grad_avg": 0},
    torch.optim.Rprop: {"prev": 0, "step_size": _lr},
    torch.optim.ASGD: {"eta": _lr, "mu": 1, "ax": 0},
    torch.optim.SparseAdam: {"exp_avg": 0, "exp_avg_sq": 0},
    torch.optim.Adafactor: {"row_var": 0, "col_var": 0, "variance": 0},
    torch.optim.Muon: {"momentum_buffer": 0},
}


def _initial_values(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return next((_INITIAL[cls] for cls in type(optimizer).__mro__ if cls in _INITIAL), {})


def _reset(key: str, value: Any, initial: Any, optimizer: Any, group: dict,
           p: torch.Tensor) -> Any:
    """``value`` (a state entry the stand-in's step made) set to its initial value."""
    if key == "step":
        initial = 0
    elif initial is None or not isinstance(value, torch.Tensor):
        return value
    if callable(initial):
        initial = initial(optimizer, group, p)
    if not isinstance(value, torch.Tensor):
        return type(value)(initial)
    with torch.no_grad():
        return value.zero_() if initial == 0 else value.fill_(initial)
