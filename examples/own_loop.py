"""Sharded checkpoints and resume-from-latest in your own training loop (DDP here).

Run: torchrun --standalone --nproc-per-node 2 --max-restarts 3 examples/own_loop.py /tmp/ckpt

``ckpt.init_distributed()`` stands where ``dist.init_process_group("gloo")`` would: the same
group, with a key space of its own per torchrun attempt, so that a restart after a failure
finds its peers (and not the dead attempt's addresses) and resumes.
"""
import sys

import torch
import torch.distributed as dist

import ckpt
from ckpt import CheckpointManager, ModelState, RNGState


def train(root: str, steps: int = 30) -> None:
    ckpt.init_distributed("gloo")                     # not dist.init_process_group: restarts
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

    # --- the checkpointing part: these lines are all it takes ---
    state = {"app": ModelState(model, optim), "rng": RNGState(), "progress": {"step": 0}}
    mgr = CheckpointManager(root, cadence="10", busy="wait")  # every 10 steps; or "auto", "5m"
    resumed = mgr.load_latest(state)                  # newest checkpoint that verifies
    start, metadata = (resumed.step if resumed else 0), {}
    for step in range(start + 1, steps + 1):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward(); optim.step(); optim.zero_grad()
        state["progress"]["step"] = step
        metadata = {"loss": loss.item()}                # `ckpt list` shows it
        mgr.maybe_save(step, state, user_metadata=metadata)
    mgr.save(steps, state, block=True, force=True, user_metadata=metadata)  # the final state
    mgr.close()
    # ------------------------------------------------------------
    dist.destroy_process_group()


if __name__ == "__main__":
    train(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30)
