"""A resume that falls back past a damaged checkpoint: rank 0 un-commits it, and no rank
reads the store before that is done (2 gloo ranks, in-process trainers).

Before, rank 1 went on while rank 0 was still un-committing, so its metrics read the damaged
step as the newest committed one (rank 0 exported 2, rank 1 exported 4). Rank 0's un-commit
is slowed here so that a rank that does not wait for it reads the store first every time.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch

from tests.dist import free_port, run_ranks

pytestmark = pytest.mark.timeout(300)

_COMMON = ("--training.log_every=1", "--checkpoint.interval=2", "--checkpoint.async_save=false",
           "--checkpoint.keep_last=0", "--training.warmup_steps=1", "--training.steps=4",
           "--training.global_batch_size=8", "--fault.handle_preemption=false",
           "--metrics.host=127.0.0.1")
UNCOMMIT_DELAY = 3.0


def _trainer(rank: int, world: int, root: str, *extra: str):
    from tests.e2e._jobs import TINY
    from trainer.config import load_config
    from trainer.distributed import DistEnv
    from trainer.train import Trainer

    cfg = load_config(str(TINY), [*_COMMON, f"--checkpoint.root={root}", *extra])
    return Trainer(cfg, DistEnv(rank, world, rank, torch.device("cpu"), "gloo", 0))


def _fallback_job(rank: int, world: int, root: str, metrics_port: int) -> dict:
    import torch.distributed as dist

    from ckpt.format import step_dirname
    from ckpt.root import Lifecycle
    from monitoring import Metrics
    from tests.ckpt._helpers import flip_byte

    assert _trainer(rank, world, root).fit() == 0  # checkpoints 2 and 4
    dist.barrier()
    if rank == 0:
        folder = os.path.join(root, step_dirname(4))
        for name in os.listdir(folder):
            if name.endswith(".bin"):
                flip_byte(os.path.join(folder, name), 0)
        slow = Lifecycle.uncommit_newer

        def uncommit_slowly(self, step):
            time.sleep(UNCOMMIT_DELAY)
            return slow(self, step)
        Lifecycle.uncommit_newer = uncommit_slowly
    dist.barrier()
    newest: list[float] = []
    observe = Metrics.observe_store

    def observe_and_record(self, store):
        observe(self, store)
        newest.append(self.registry.get_sample_value(
            "ckpt_last_committed_step", {"rank": self.rank, "tier": "durable"}))
    Metrics.observe_store = observe_and_record
    trainer = _trainer(rank, world, root, f"--metrics.port={metrics_port}",
                       "--metrics.linger_seconds=0")
    resumed: list[int] = []
    trainer.events.subscribe(lambda e: resumed.append(e.step) if e.kind == "resumed" else None)
    code = trainer.fit()
    return {"code": code, "resumed": resumed, "newest": newest}


def _port_pair() -> int:
    while True:
        base = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue


def test_every_rank_reads_the_store_after_the_fallback_uncommit(tmp_path):
    results = run_ranks(_fallback_job, 2, str(tmp_path / "ckpt"), _port_pair(), timeout=240)
    for rank, r in enumerate(results):
        assert r["code"] == 0 and r["resumed"] == [2], (rank, r)
        # At start-up the newest committed step is the damaged 4; once the resume settled
        # the store, every rank says 2.
        assert r["newest"] == [4.0, 2.0], (rank, r)
