"""Bodies of the multi-process manager tests (module-level: run_ranks pickles them by name).

Each runs on every rank of a real gloo group and returns plain data for the parent to check;
anything that must hold on every rank is asserted inside.
"""

from __future__ import annotations

import dataclasses

import io
import json
import time

import pytest
import torch

from tests.ckpt._helpers import assert_same, snapshot
from tests.ckpt._mgr_util import FaultyStorage, OnlyRankWants


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _build(world: int, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)  # identical on every rank, as DDP/FSDP2 expect
    ddp = DDP(_mlp())
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    fsdp = _mlp()
    fully_shard(fsdp, mesh=init_device_mesh("cpu", (world,)))
    fsdp_opt = torch.optim.AdamW(fsdp.parameters(), lr=2e-2)
    return ddp, ddp_opt, fsdp, fsdp_opt


def _train(models, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    for model, opt in models:
        x = torch.randn(4, 6, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _local_tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        t = obj.to_local() if hasattr(obj, "to_local") else obj
        return t.numel() * t.element_size()
    if isinstance(obj, dict):
        return sum(_local_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_local_tensor_bytes(v) for v in obj)
    return 0


def async_resume_body(rank: int, world: int, root: str) -> dict:
    """Several async saves of DDP + FSDP2 state while training; resume bit-for-bit."""
    import torch.distributed as dist

    from ckpt.dcp import ModelState
    from ckpt.dcp.api import resolve_state
    from ckpt.job import CheckpointManager, ManagerOptions, ReadOnlyCheckpointer

    ddp, ddp_opt, fsdp, fsdp_opt = _build(world, 0)
    # Plain tensors are taken as replicated by DCP: per-rank values need per-rank keys.
    own = f"own{rank}"
    state = {"ddp": ModelState(ddp, ddp_opt), "fsdp": ModelState(fsdp, fsdp_opt), "step": 0,
             own: torch.full((3,), float(rank))}
    storage = FaultyStorage(root, delay_seconds=0.15)  # keeps each save in flight a while
    mgr = CheckpointManager(storage,
                            ManagerOptions(busy="wait", num_threads=2, layout={"dp": world}),
                            retention=[])
    snaps, allocations = {}, []
    for step in range(1, 7):
        _train([(ddp, ddp_opt), (fsdp, fsdp_opt)], rank, step)
        state["step"] = step
        if step % 2 == 0:
            snaps[step] = snapshot(resolve_state(state))
            assert mgr.save(step, state, user_metadata={"loss": 1.0 / step})
            assert mgr.in_flight()  # save() returned; persisting goes on in the background
            allocations.append(mgr.staging.num_allocations)
            state[own].add_(10)  # mutate right away: the staged copy must not change
    # Buffers allocated once (first save), reused by the later ones; about one shard copy.
    assert allocations[0] > 0 and allocations == [allocations[0]] * 3, allocations
    assert mgr.staging.nbytes == _local_tensor_bytes(resolve_state(state)), \
        (mgr.staging.nbytes, _local_tensor_bytes(resolve_state(state)))
    mgr.close()
    committed = [e.step for e in mgr.events.of_kind("save_committed")]
    assert committed == [2, 4, 6], committed
    waited = [e.step for e in mgr.events.of_kind("save_waited")]

    # A fresh job: new models and a fresh manager resume from the newest checkpoint.
    ddp2, ddp_opt2, fsdp2, fsdp_opt2 = _build(world, 123)
    state2 = {"ddp": ModelState(ddp2, ddp_opt2), "fsdp": ModelState(fsdp2, fsdp_opt2),
              "step": -1, own: torch.zeros(3)}
    _train([(ddp2, ddp_opt2), (fsdp2, fsdp_opt2)], rank, 99)  # optimizer state exists
    mgr2 = CheckpointManager(root, retention=[])
    manifest = mgr2.load_latest(state2)
    assert manifest is not None and manifest.step == 6
    assert_same(snaps[6], snapshot(resolve_state(state2)), f"rank {rank} step 6")
    assert state2["step"] == 6
    # An older step loads too, read only (without rewinding the root: 4 and 6 stay
    # committed).
    assert ReadOnlyCheckpointer(root).load_latest(state2, step=2).step == 2
    assert_same(snaps[2], snapshot(resolve_state(state2)), f"rank {rank} step 2")
    # Training continues in lockstep after the resume.
    _train([(ddp2, ddp_opt2), (fsdp2, fsdp_opt2)], rank, 7)
    mgr2.close()
    dist.barrier()
    return {"waited": waited, "layout": manifest.layout if rank == 0 else None,
            "user_metadata": manifest.user_metadata}


def failure_body(rank: int, world: int, root: str) -> dict:
    """A storage failure on rank 1 only fails the save on every rank; nothing commits."""
    import pytest
    import torch.distributed as dist

    from ckpt.errors import RankFailuresError
    from ckpt.job import CheckpointManager, ManagerOptions
    from ckpt.root.lease import LEASE_NAME

    storage = FaultyStorage(root, fail_attempts=-1 if rank == 1 else 0)
    mgr = CheckpointManager(storage, ManagerOptions(max_attempts=2, retry_backoff_seconds=0.05),
                            retention=[])
    state = {f"w{rank}": torch.full((4,), float(rank)), "step": 1}
    assert mgr.save(1, state)
    assert mgr.wait(raise_errors=False) is None
    failed = mgr.events.of_kind("save_failed")
    assert [(e.fields["attempt"], e.fields["final"]) for e in failed] == [(1, False), (2, True)]
    assert "rank 1" in failed[-1].fields["error"]
    with pytest.raises(RankFailuresError, match="rank 1: OSError"):
        mgr.wait()
    assert not mgr.events.of_kind("save_committed")
    dist.barrier()
    assert not storage.exists("step_000000001/manifest.json")
    assert mgr.store.committed_steps() == []

    # raise_on_failure: the next save() raises on every rank, even on a rank whose own
    # persist thread has not finished yet (the pending failure is agreed first).
    mgr.options = dataclasses.replace(mgr.options, raise_on_failure=True)
    assert mgr.save(10, state)
    if rank == 0:
        mgr.wait(raise_errors=False)
    with pytest.raises(RankFailuresError, match="rank 1"):
        mgr.save(11, state)
    mgr.options = dataclasses.replace(mgr.options, raise_on_failure=False)
    assert not mgr.in_flight()

    # Storage heals: the next save commits on both ranks (nothing is stuck or out of step).
    storage.fail_attempts = 0
    storage.failed_save_ids.clear()
    state["step"] = 2
    assert mgr.save(2, state, block=True)
    assert [e.step for e in mgr.events.of_kind("save_committed")] == [2]

    # A non-deterministic cadence: only rank 1 wants to save at step 3; all ranks agree.
    mgr.cadence = OnlyRankWants(1, rank, 3)
    assert mgr.maybe_save(2, state) is False
    assert mgr.maybe_save(3, state) is True
    mgr.wait()
    mgr.cadence = None

    # The lease (held by rank 0) is lost: every rank skips the save, reported, no hang.
    if rank == 0:
        storage.write_bytes(LEASE_NAME, json.dumps({
            "holder": "intruder", "job": "other", "host": "elsewhere", "pid": 1,
            "acquired_unix": time.time(), "heartbeat_unix": time.time(),
            "ttl_seconds": 60}).encode())
        mgr.lease.heartbeat()  # the heartbeat thread would notice within ttl/4 as well
        assert mgr.lease.lost
        assert mgr.events.of_kind("lease_lost")
    dist.barrier()
    assert mgr.save(4, state) is False
    skipped = mgr.events.of_kind("save_skipped")[-1]
    assert skipped.step == 4 and skipped.fields["reason"] == "lease lost"
    mgr.close()
    dist.barrier()
    out = {"committed": mgr.store.committed_steps()}
    if rank == 0:  # the intruder's lease is left alone
        out["lease_holder"] = json.loads(storage.read_bytes(LEASE_NAME))["holder"]
    return out


def exit_body(rank: int, world: int, root: str) -> dict:
    """close(flush=True) commits the in-flight save on every rank; close(flush=False)
    abandons it (never committed); the next job's manager removes the leftovers."""
    import torch.distributed as dist

    from ckpt.job import CheckpointManager, ManagerOptions

    storage = FaultyStorage(root, delay_seconds=0.3)
    state = {f"w{rank}": torch.full((4,), float(rank))}
    with CheckpointManager(storage, retention=[]) as mgr:
        assert mgr.save(1, state)
        assert mgr.in_flight()
    flushed = mgr.store.committed_steps()

    storage.writing.clear()
    mgr = CheckpointManager(storage, retention=[])
    mgr.save(2, state)
    assert storage.writing.wait(30)  # this rank's data files are being written
    mgr.close(flush=False)
    ev = mgr.events.of_kind("save_failed")[-1]
    assert ev.step == 2 and ev.fields["outcome"] == "abandoned", ev
    dist.barrier()
    assert not storage.exists("step_000000002/manifest.json")
    leftover = sorted(n for n, _, _ in storage.listdir("step_000000002"))

    mgr2 = CheckpointManager(root, retention=[])
    cleaned = [e.step for e in mgr2.events.of_kind("cleanup_aborted")]
    mgr2.close()
    dist.barrier()
    return {"flushed": flushed, "leftover": leftover, "cleaned": cleaned,
            "after": sorted(n for n, _, _ in storage.listdir("") if n.startswith("step_"))}


def fsdp_save_body(rank: int, world: int, root: str) -> dict:
    """Save a trained FSDP2 model + optimizer; return the full (unsharded) tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ckpt.dcp import ModelState
    from ckpt.dcp.api import resolve_state
    from ckpt.job import CheckpointManager, ManagerOptions, ReadOnlyCheckpointer

    torch.manual_seed(0)
    model = _mlp()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train([(model, opt)], rank, 1)
    state = {"app": ModelState(model, opt), "step": 11}
    with CheckpointManager(root, retention=[]) as mgr:
        mgr.save(11, state, user_metadata={"loss": 0.5})

    def full(obj):
        if isinstance(obj, torch.Tensor):
            return (obj.full_tensor() if hasattr(obj, "full_tensor") else obj).detach().clone()
        if isinstance(obj, dict):
            return {k: full(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(full(v) for v in obj)
        return obj

    sd = full(resolve_state(state))  # collective (all-gathers): every rank calls it
    local_numel = model[0].weight.to_local().numel()
    # Tensors cross the result queue as bytes: torch shares them by file descriptor, which
    # dies with this process before the parent reads it.
    blob = None
    if rank == 0:
        buf = io.BytesIO()
        torch.save(sd, buf)
        blob = buf.getvalue()
    return {"state": blob, "local_numel": local_numel}


def native_threads() -> int:
    """Threads of this process that Python did not start (gloo's among them)."""
    import os
    import threading

    return len(os.listdir("/proc/self/task")) - threading.active_count()


def groups_freed_body(rank: int, world: int, root: str) -> dict:
    """A manager's gloo groups leave no thread behind: after close(), and at exit for a
    manager never closed. (A gloo group alive at the interpreter's teardown can abort the
    process while a worker thread releases a finished collective's tensors.)"""
    import gc

    from ckpt.job import CheckpointManager, ManagerOptions, TieredCheckpointManager
    from ckpt.ranks.groups import free_all_at_exit

    gc.collect()
    before = native_threads()
    state = {"w": torch.arange(8.0) + rank, "step": 0}
    with CheckpointManager(root, cadence=None) as mgr:
        assert native_threads() > before  # the two groups' gloo threads
        mgr.save(1, {"w": torch.arange(8.0), "step": 1}, block=True)
        assert mgr.load_latest(state).step == 1
    closed = native_threads()
    with pytest.raises(RuntimeError, match="after close"):
        mgr.load_latest(state)
    unclosed = CheckpointManager(root, cadence=None)
    assert unclosed.load_latest(state).step == 1
    opened = native_threads()
    free_all_at_exit()  # what the interpreter runs at exit
    at_exit = native_threads()
    unclosed.close()  # still works: releases the lease
    # Two tiers: the tier logic's own group and both tiers' groups.
    tiered = TieredCheckpointManager(root + "-durable", root + "-local", local_cadence="1")
    tiered.maybe_save(1, state)
    tiered.wait()
    tiers_opened = native_threads()
    free_all_at_exit()
    tiers_at_exit = native_threads()
    tiered.close()
    return {"before": before, "closed": closed, "opened": opened, "at_exit": at_exit,
            "tiers_opened": tiers_opened, "tiers_at_exit": tiers_at_exit}
