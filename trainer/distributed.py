"""Process-group setup and teardown under torchrun (or a single plain process).

Restarts: with ``torchrun --max-restarts``, restarted gloo workers can read the dead
attempt's addresses from the shared rendezvous store and hang or fail in
``connectFullMesh``. The group is therefore started by ``ckpt.ranks.init_distributed``, which
gives every attempt its own key space (``ckpt.ranks.torchrun`` explains).

Exit: a gloo worker thread releasing a tensor while Python finalises can abort the process
(``terminate called without an active exception``). ``shutdown`` barriers, destroys the
group, flushes and leaves with ``os._exit`` so the exit code is the one we meant.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

import ckpt

__all__ = ["DistEnv", "init_distributed", "shutdown", "EXIT_OK", "EXIT_FAILED", "EXIT_CONFIG",
           "EXIT_PREEMPTED", "EXIT_HANG", "EXIT_NOT_CHECKPOINTED", "EXIT_LEASE_LOST"]

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1        # training failed (e.g. loss diverged and policy says stop)
EXIT_CONFIG = 2        # bad config or input; restarting will not help
EXIT_NOT_CHECKPOINTED = 3  # trained to the end, but the final save did not commit
EXIT_LEASE_LOST = 4    # another job holds (or took over) the checkpoint root's write lease
EXIT_PREEMPTED = 75    # EX_TEMPFAIL: checkpointed on a preemption signal; requeue me
EXIT_HANG = 124        # watchdog: no progress; torchrun restarts the group


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    restart_count: int

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def init_distributed(device: str = "auto", *, timeout_seconds: float) -> DistEnv:
    """Join the job's process group (torchrun's env://) or stay a single process.

    ``timeout_seconds``: of the group's collectives (``Config.process_group_timeout_seconds``,
    which orders it after the hang watchdog)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world <= 1 and "MASTER_ADDR" not in os.environ:
        return DistEnv(0, 1, 0, dev, None, restart)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    ckpt.init_distributed(backend, timeout_seconds=timeout_seconds,
                          device_id=dev if dev.type == "cuda" else None)
    if (dist.get_rank() == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and _env_int("GROUP_WORLD_SIZE") > 1 and _env_int("TORCHELASTIC_MAX_RESTARTS") > 0):
        log.warning("a multi-node job with restarts shares the agents' store: a node that "
                    "is started again cannot rejoin it; set "
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node (docs/trainer.md, "
                    "'Multi-node')")
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend, restart)


def _env_int(name: str) -> int:
    try:
        return int(os.environ.get(name, "0") or 0)
    except ValueError:
        return 0


def shutdown(env: DistEnv, code: int, *, barrier: bool = True) -> NoReturn:
    """Tear down cleanly and exit the process with ``code`` (never returns)."""
    try:
        if env.distributed and dist.is_initialized():
            if barrier and code in (EXIT_OK, EXIT_PREEMPTED):
                dist.barrier()
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - we are leaving anyway
        log.warning("process group teardown failed: %s", exc)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    logging.shutdown()
    os._exit(code)
