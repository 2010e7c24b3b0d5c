"""Rank bodies for the parallel-equivalence tests (module-level so spawn can pickle them)."""

from __future__ import annotations

import gc
import multiprocessing.queues
import os

import torch

from trainer.config import ModelConfig, ParallelConfig
from trainer.mesh import build_mesh, dp_mesh
from trainer.parallelize import build_parallel_model

__all__ = ["MODEL", "MOE", "MODELS", "GLOBAL_BATCH", "SEQ_LEN", "STEPS", "SEED", "layout", "make_batches", "train",
           "rank_train", "rank_train_layouts"]

MODEL = ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, ffn_dim=64, max_seq_len=16)
# The tiny mixture of experts: blocks 1 and 3 route to 4 experts, top-2, plus a shared one.
MOE = ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, ffn_dim=64, max_seq_len=16,
                  n_experts=4, experts_per_token=2, moe_every=2, n_shared_experts=1,
                  moe_ffn_dim=32)
MODELS = {"dense": MODEL, "moe": MOE}
GLOBAL_BATCH = 8
SEQ_LEN = 16
STEPS = 20
SEED = 1234
MAX_NORM = 1.0


def layout(model: ModelConfig = MODEL, **kwargs) -> ParallelConfig:
    """The layout for ``kwargs`` (dp defaults to dp_replicate * dp_shard, or 1; not the
    config's -1), checked against ``model`` and the test batch the way ``Config.resolved``
    checks a job's."""
    dp = kwargs.get("dp_replicate", 1) * kwargs.get("dp_shard", 1)
    par = ParallelConfig(**{"dp": dp, **kwargs})
    par = par.resolved(par.world_size)
    par.check(model, global_batch_size=GLOBAL_BATCH, seq_len=SEQ_LEN)
    return par


def make_batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed data: (inputs, targets) of shape (GLOBAL_BATCH, SEQ_LEN) per step, from a seed.

    Targets are a fixed function of the inputs (next token = (3 x + 1) mod vocab) so the
    loss actually falls and a layout that trains wrongly would drift visibly.
    """
    gen = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(steps):
        x = torch.randint(0, MODEL.vocab_size, (GLOBAL_BATCH, SEQ_LEN), generator=gen)
        out.append((x, (3 * x + 1) % MODEL.vocab_size))
    return out


def train(
    pm, dp_rank: int, dp: int, accum: int = 1, check_state_keys: bool = False, steps: int = STEPS
) -> dict:
    """Train ``steps`` AdamW steps on this dp rank's slice; return per-step loss and grad norm.

    With ``accum > 1`` the local slice is fed as ``accum`` gradient-accumulation calls
    (dp reduction only on the last), which must give the same step as one call.
    """
    optims = [
        torch.optim.AdamW(part.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        for part in pm.model_parts
    ]
    local = GLOBAL_BATCH // dp
    losses, norms = [], []
    for x, y in make_batches(steps):
        x, y = x[dp_rank * local : (dp_rank + 1) * local], y[dp_rank * local : (dp_rank + 1) * local]
        for o in optims:
            o.zero_grad()
        if accum == 1:
            losses.append(pm.train_step(x, y))
        else:
            call_losses = [
                pm.forward_backward(xa, ya, num_accum_steps=accum, sync_grads=i == accum - 1)
                for i, (xa, ya) in enumerate(zip(x.chunk(accum), y.chunk(accum)))
            ]
            losses.append(sum(call_losses) / accum)
        norms.append(pm.clip_grad_norm_(MAX_NORM))
        for o in optims:
            o.step()
    result = {"losses": losses, "norms": norms}
    if check_state_keys:
        result["model_keys"] = sorted(pm.model_state_dict())
        result["optim_keys"] = sorted(pm.optimizer_state_dict(optims))
        result["_optims"] = optims  # popped by rank_train, not sent back
    return result


def _local(value):
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def check_state_dict_roundtrip(pm, optims, par, mesh) -> None:
    """Load ``pm``'s model and optimizer state into a freshly built model (another seed) and
    check every local shard is equal afterwards."""
    fresh = build_parallel_model(pm.model_cfg, par, mesh, SEED + 1)
    fresh_optims = [torch.optim.AdamW(p.parameters(), lr=1e-2, foreach=False) for p in fresh.model_parts]
    # AdamW state is created lazily: one zero-gradient step creates it so it can be loaded into.
    for p in fresh.parameters():
        p.grad = torch.zeros_like(p)
    for o in fresh_optims:
        o.step()
    fresh.load_model_state_dict(pm.model_state_dict())
    fresh.load_optimizer_state_dict(fresh_optims, pm.optimizer_state_dict(optims))
    for want, got in (
        (pm.model_state_dict(), fresh.model_state_dict()),
        (pm.optimizer_state_dict(optims), fresh.optimizer_state_dict(fresh_optims)),
    ):
        assert want.keys() == got.keys()
        for key in want:
            a, b = _local(want[key]), _local(got[key])
            same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
            assert same, f"state {key} differs after load"


def _flush_result_queue_at_exit() -> None:
    """Work around a race in ``tests/dist.py``: its worker ``queue.put``s the result and then
    calls ``os._exit``, which can kill the queue's feeder thread before the result reaches
    the parent (seen here: every rank finished, the parent waited for the timeout). Close
    and join every multiprocessing queue first. Harmless once dist.py does it itself.
    """
    original = os._exit

    def exit_after_flush(code: int) -> None:
        for obj in gc.get_objects():
            if type(obj) is multiprocessing.queues.Queue:
                try:
                    obj.close()
                    obj.join_thread()
                except Exception:
                    pass
        original(code)

    os._exit = exit_after_flush


def rank_train(rank: int, world_size: int, par_kwargs: dict, accum: int = 1,
               check_keys: bool = False, model: str = "dense"):
    """Body run on each rank by ``tests.dist.run_ranks``: build the layout of ``MODELS[model]``,
    train, report."""
    _flush_result_queue_at_exit()
    cfg = MODELS[model]
    par = layout(cfg, **par_kwargs)
    mesh = build_mesh(par, "cpu")
    pm = build_parallel_model(cfg, par, mesh, SEED)
    result = train(pm, dp_mesh(mesh).get_local_rank(), par.dp, accum, check_keys)
    if check_keys:
        check_state_dict_roundtrip(pm, result.pop("_optims"), par, mesh)
    return result


def rank_train_layouts(rank: int, world_size: int, runs: list[tuple[str, dict, bool, int]]):
    """Body run on each rank: for each ``(model name, par kwargs, check_keys, steps)`` build
    its mesh on the one process group, train and report (one launch, several layouts)."""
    _flush_result_queue_at_exit()
    out = []
    for model, par_kwargs, check_keys, steps in runs:
        cfg = MODELS[model]
        par = layout(cfg, **par_kwargs)
        mesh = build_mesh(par, "cpu")
        pm = build_parallel_model(cfg, par, mesh, SEED)
        result = train(pm, dp_mesh(mesh).get_local_rank(), par.dp, 1, check_keys, steps)
        if check_keys:
            check_state_dict_roundtrip(pm, result.pop("_optims"), par, mesh)
        out.append(result)
    return out
