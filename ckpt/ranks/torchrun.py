"""Join torchrun's process group so that ``--max-restarts`` works: one call, ``init_distributed``.

Why: under ``torchrun`` the workers do not host their own rendezvous store. They are clients
of the agent's TCPStore (``TORCHELASTIC_USE_AGENT_STORE=True``; ``--standalone``, c10d
rendezvous and a fixed ``--master-port`` alike), and that store outlives the workers: a
restart spawns new workers against the same store, which still holds the dead attempt's
keys. ``dist.init_process_group("gloo")`` keys every group by a name that is the same in
every attempt (``default_pg/0/...``; the groups ``dist.new_group`` creates later likewise),
so a restarted worker can read a dead peer's address before the live peer overwrites it:
``Gloo connectFullMesh failed ... Connection refused``, or a hang. ``init_distributed``
gives every attempt its own key space, ``PrefixStore("attempt_<TORCHELASTIC_RESTART_COUNT>")``
over the agent's store; every group created later (the ``CheckpointManager``'s too) lives
under it. (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the launcher's environment, which
makes the workers start a fresh store per attempt, also works; this needs no setting.)

Only a shared store gets the prefix: with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` rank 0
hosts a new store every round and none is needed. Restart counts are each node's agent's own
(a replaced node's starts at 0 while the survivors' are higher), so a job on several nodes
that must survive the loss of a node turns sharing off (docs/trainer.md, *Restarts*).

Which ranks call what: every worker calls ``init_distributed`` once, where it would call
``dist.init_process_group``, before any other collective.
"""

from __future__ import annotations

import datetime
import logging
import os
import weakref

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

__all__ = ["init_distributed", "attempt_store", "is_attempt_scoped", "warn_if_not_attempt_scoped"]

log = logging.getLogger(__name__)

# The default group init_distributed created, by weak reference: a strong one would keep the
# group's gloo threads alive after dist.destroy_process_group(), until the interpreter's
# teardown, where a worker thread still releasing a finished collective's tensors aborts the
# process ("terminate called without an active exception").
_scoped_group: weakref.ref | None = None
_warned = False


def _shared_agent_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def attempt_store(store: dist.Store) -> dist.Store:
    """``store`` narrowed to this torchrun attempt's key space when it is the agent's store,
    shared by every attempt; otherwise (a store of this round only) ``store`` itself."""
    if not _shared_agent_store():
        return store
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    return dist.PrefixStore(f"attempt_{restart}", store)


def init_distributed(backend: str | None = None, *, timeout_seconds: float | None = None,
                     device_id: torch.device | None = None) -> bool:
    """Start the default process group from torchrun's environment (``env://``), with a key
    space of its own per restart attempt. Call it instead of ``dist.init_process_group``.

    Returns True when a group was started; False in a plain single process (no
    ``MASTER_ADDR`` and ``WORLD_SIZE`` unset or 1), where nothing is started, so one script
    runs under ``python`` and ``torchrun`` alike. ``backend`` as for
    ``dist.init_process_group`` (None: torch's default for the devices present).
    """
    global _scoped_group
    if dist.is_initialized():
        raise RuntimeError("init_distributed: the default process group already exists; "
                           "call init_distributed() instead of dist.init_process_group, once")
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1 and "MASTER_ADDR" not in os.environ:
        return False
    rank = int(os.environ.get("RANK", "0") or 0)
    timeout = (default_pg_timeout if timeout_seconds is None
               else datetime.timedelta(seconds=timeout_seconds))
    store, rank, world = next(dist.rendezvous("env://", rank=rank, world_size=world,
                                              timeout=timeout))
    store.set_timeout(timeout)
    dist.init_process_group(backend, store=attempt_store(store), rank=rank, world_size=world,
                            timeout=timeout, device_id=device_id)
    _scoped_group = weakref.ref(dist.group.WORLD)
    return True


def is_attempt_scoped() -> bool:
    """Whether the current default group was started by :func:`init_distributed`."""
    return dist.is_initialized() and _scoped_group is not None and \
        dist.group.WORLD is _scoped_group()


def warn_if_not_attempt_scoped() -> None:
    """Log once when a torchrun job that may restart has a default group whose keys are not
    per attempt (it was started with ``dist.init_process_group``): its restarts can fail."""
    global _warned
    if _warned or is_attempt_scoped():
        return
    if not _shared_agent_store():
        return
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) <= 0:
        return
    _warned = True
    log.warning("torchrun --max-restarts: the default process group was started with "
                "dist.init_process_group, whose keys are the same in every attempt; a restart "
                "can fail ('Gloo connectFullMesh failed') or hang. Call ckpt.init_distributed() "
                "instead (docs/recipes.md, 'Restarts').")
