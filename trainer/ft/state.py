"""What a replica group holds and a rejoining group receives: this rank's share of it.

Rank k of a healthy group sends rank k of the group behind everything that makes the two
the same replica at a step boundary, as local tensors (this rank's shards: every group has
the same layout, so the shards line up) and JSON-like values:

=================  ====================================================================
key                what
=================  ====================================================================
``model``          parameters and buffers, by full-model name (``to_local()`` of DTensors)
``optim``          each parameter's optimizer state (AdamW: step, exp_avg, exp_avg_sq)
``param_groups``   each optimizer's learning rates (``lr``, ``initial_lr``)
``sched``          each LR scheduler's ``state_dict()``
``rng``            torch's CPU (and CUDA) generator and Python's ``random``
``trainer``        the trainer's counters (``TrainerState``: loss guard window, skips)
=================  ====================================================================

The data position and the step are not here: torchft sends its own counters with it
(``step``, ``batches_committed``), from which the trainer derives both.

Loading copies into the live tensors (no new parameters, so optimizers and FSDP keep their
references); a tensor whose shape or dtype differs from the live one is an error naming it:
the groups were started with different layouts or models.

:meth:`ReplicaState.digests` hashes the same content, for checking that replicas are
bit-identical.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Iterator, Sequence

import torch

__all__ = ["ReplicaState", "ReplicaMismatchError"]


class ReplicaMismatchError(ValueError):
    """A received state does not fit this replica (different layout, model or optimizer)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class ReplicaState:
    """One rank's share of a replica: ``model`` (a ``trainer.parallelize.ParallelModel``),
    its ``optimizers`` and ``schedulers`` (one per model part) and ``counters`` (an object
    with ``state_dict``/``load_state_dict`` of JSON-like values)."""

    def __init__(self, model, optimizers: Sequence[torch.optim.Optimizer],
                 schedulers: Sequence[Any], counters: Any):
        self.model, self.optimizers = model, list(optimizers)
        self.schedulers, self.counters = list(schedulers), counters

    # -- what there is ---------------------------------------------------------------------
    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for part in self.model.model_parts:
            yield from part.named_parameters()
            yield from part.named_buffers()

    def _optim_states(self) -> Iterator[tuple[str, dict[str, Any]]]:
        for part, optim in zip(self.model.model_parts, self.optimizers):
            for name, p in part.named_parameters():
                if p in optim.state:
                    yield name, optim.state[p]

    @staticmethod
    def _lrs(optim: torch.optim.Optimizer) -> list[dict[str, float]]:
        return [{k: float(g[k]) for k in ("lr", "initial_lr") if k in g}
                for g in optim.param_groups]

    # -- sending and receiving -------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's share, referencing the live tensors (not copies)."""
        rng: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return {
            "model": {name: _local(t.detach()) for name, t in self._tensors()},
            "optim": {name: {k: (_local(v.detach()) if isinstance(v, torch.Tensor) else v)
                             for k, v in st.items()} for name, st in self._optim_states()},
            "param_groups": [self._lrs(o) for o in self.optimizers],
            "sched": [s.state_dict() for s in self.schedulers],
            "rng": rng,
            "trainer": self.counters.state_dict(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Copy a peer's share into this replica, in place. Raises
        :class:`ReplicaMismatchError` before changing anything when it does not fit."""
        live = dict(self._tensors())
        live_optim = dict(self._optim_states())
        self._check(sd, live, live_optim)
        with torch.no_grad():
            for name, t in live.items():
                _local(t).copy_(sd["model"][name])
            for name, st in live_optim.items():
                for k, v in sd["optim"][name].items():
                    if isinstance(st[k], torch.Tensor):
                        _local(st[k]).copy_(v)
                    else:
                        st[k] = v
        for optim, lrs in zip(self.optimizers, sd["param_groups"]):
            for group, values in zip(optim.param_groups, lrs):
                group.update(values)
        for sched, state in zip(self.schedulers, sd["sched"]):
            sched.load_state_dict(state)
        rng = sd["rng"]
        torch.set_rng_state(rng["cpu"])
        py = rng["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        self.counters.load_state_dict(sd["trainer"])

    def _check(self, sd: Any, live: dict[str, torch.Tensor],
               live_optim: dict[str, dict[str, Any]]) -> None:
        if not isinstance(sd, dict) or not {"model", "optim", "param_groups", "sched", "rng",
                                            "trainer"} <= set(sd):
            raise ReplicaMismatchError("the peer's state is not a replica state")
        if set(sd["model"]) != set(live) or set(sd["optim"]) != set(live_optim):
            diff = sorted(set(sd["model"]) ^ set(live))[:5] or \
                sorted(set(sd["optim"]) ^ set(live_optim))[:5]
            raise ReplicaMismatchError(f"the peer's replica has other parameters ({diff}): "
                                       f"start every replica group with the same model")
        pairs = [(name, _local(t), sd["model"][name]) for name, t in live.items()]
        for name, st in live_optim.items():
            got = sd["optim"][name]
            if set(got) != set(st):
                raise ReplicaMismatchError(f"optimizer state of {name}: keys {sorted(got)} "
                                           f"!= {sorted(st)}")
            pairs += [(f"{name}.{k}", _local(v), got[k]) for k, v in st.items()
                      if isinstance(v, torch.Tensor)]
        for name, mine, theirs in pairs:
            if not isinstance(theirs, torch.Tensor) or theirs.shape != mine.shape \
                    or theirs.dtype != mine.dtype:
                shape = getattr(theirs, "shape", type(theirs).__name__)
                raise ReplicaMismatchError(
                    f"{name}: the peer sends {shape} {getattr(theirs, 'dtype', '')}, this "
                    f"replica holds {tuple(mine.shape)} {mine.dtype}: start every replica "
                    f"group with the same layout ([parallel]) and model")
        if len(sd["param_groups"]) != len(self.optimizers) or \
                len(sd["sched"]) != len(self.schedulers):
            raise ReplicaMismatchError("the peer has a different number of model parts")

    # -- comparing replicas ----------------------------------------------------------------
    def digests(self) -> dict[str, str]:
        """SHA-256 (hex, 16 chars) of this rank's share, per part: ``model``, ``optim`` (with
        learning rates and schedulers), ``rng`` and ``trainer``. Equal digests on rank k of
        two groups mean bit-identical replicas."""
        sd = self.state_dict()
        out = {}
        for key, parts in (("model", ("model",)), ("optim", ("optim", "param_groups", "sched")),
                           ("rng", ("rng",)), ("trainer", ("trainer",))):
            h = hashlib.sha256()
            for part in parts:
                _hash_into(h, sd[part])
            out[key] = h.hexdigest()[:16]
        return out


def _hash_into(h: "hashlib._Hash", value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        h.update(b"{")
        for k in sorted(value):
            h.update(repr(k).encode())
            _hash_into(h, value[k])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for v in value:
            _hash_into(h, v)
        h.update(b"]")
    else:
        h.update(repr(value).encode())
