"""Bodies of the process-group tests (module-level: run_ranks pickles them by name).

Most run under a "cuda:gloo" default group, which has no CPU backend, as NCCL's has none:
any collective of the store on the default group raises "No backend type associated with
device type cpu" there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def state_at(rank: int, step: int) -> dict:
    """A tiny state whose every value depends on the step: replicated and per-rank parts."""
    return {"model": {"w": torch.full((6, 4), float(step)), "b": torch.arange(4.0) + step},
            f"own{rank}": {"x": torch.full((3,), float(100 * rank + step))},
            "progress": {"step": step}}


def step_of(state: dict, rank: int) -> int:
    """The step ``state`` holds, checking every value belongs to it."""
    step = state["progress"]["step"]
    assert torch.equal(state["model"]["w"], torch.full((6, 4), float(step)))
    assert torch.equal(state["model"]["b"], torch.arange(4.0) + step)
    assert torch.equal(state[f"own{rank}"]["x"], torch.full((3,), float(100 * rank + step)))
    return step


def _one_rank_groups(backend: str):
    """A group of this rank alone, on every rank (made together, as subgroups must be)."""
    mine, _ = dist.new_subgroups_by_enumeration(
        [[r] for r in range(dist.get_world_size())], backend=backend)
    return mine


def api_body(rank: int, world: int, root: str, store_path: str) -> dict:
    """ckpt.save / load / load_latest without a process group, with the default group, with
    groups of either kind, and after the default group was made again."""
    import ckpt
    from ckpt.ranks.groups import world_group

    out: dict = {}
    ckpt.save(state_at(rank, 1), root, 1)
    group = world_group()
    ckpt.save(state_at(rank, 2), root, 2)
    state = state_at(rank, -1)
    out["load"] = (ckpt.load(state, root, 1).step, step_of(state, rank))
    state = state_at(rank, -1)
    out["load_latest"] = (ckpt.load_latest(state, root).step, step_of(state, rank))
    ckpt.save(state_at(rank, 3), root, 3, process_group=dist.group.WORLD)
    # Without an NCCL-like group over every rank, it runs on the store's world group too.
    whole = dist.new_group(backend="cuda:gloo")
    state = state_at(rank, -1)
    out["whole"] = (ckpt.load_latest(state, root, process_group=whole).step,
                    step_of(state, rank))
    out["one_world_group"] = world_group() is group
    # A gloo subgroup (each rank its own root) is used as it is.
    mine = _one_rank_groups("gloo")
    ckpt.save(state_at(rank, 1), f"{root}-{rank}", 1, process_group=mine)
    state = state_at(rank, -1)
    out["gloo_subgroup"] = (ckpt.load_latest(state, f"{root}-{rank}", process_group=mine).step,
                            step_of(state, rank))
    # A subgroup without a CPU backend is refused, naming the fix.
    nocpu = _one_rank_groups("cuda:gloo")
    try:
        ckpt.save(state_at(rank, 2), f"{root}-{rank}", 2, process_group=nocpu)
    except ValueError as exc:
        out["nocpu_subgroup"] = str(exc)
    # A new default group (after destroy) gets a new world group of the store.
    dist.destroy_process_group()
    dist.init_process_group("cuda:gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    ckpt.save(state_at(rank, 4), root, 4)
    out["new_world_group"] = world_group() is not group
    state = state_at(rank, -1)
    out["after_reinit"] = (ckpt.load_latest(state, root).step, step_of(state, rank))
    return out


def manager_body(rank: int, world: int, root: str) -> dict:
    """CheckpointManager: maybe_save, save, load_latest and close, over the world and over
    a subgroup without a CPU backend (only its ranks are used)."""
    from ckpt.job import CheckpointManager, LocalTierOptions, ManagerOptions

    out: dict = {}
    with CheckpointManager(root, busy="wait", cadence="2", retention=[]) as mgr:
        out["started"] = [s for s in range(1, 5) if mgr.maybe_save(s, state_at(rank, s))]
        mgr.wait()
        mgr.save(5, state_at(rank, 5), block=True)
    mgr = CheckpointManager(root, cadence="2")
    state = state_at(rank, -1)
    out["resumed"] = (mgr.load_latest(state).step, step_of(state, rank))
    mgr.close()
    nocpu = _one_rank_groups("cuda:gloo")
    with CheckpointManager(f"{root}-{rank}", process_group=nocpu, retention=[]) as mgr:
        mgr.save(1, state_at(rank, 1), block=True)
        state = state_at(rank, -1)
        out["subgroup"] = (mgr.world_size, mgr.load_latest(state).step, step_of(state, rank))
    return out


def tiers_body(rank: int, world: int, root: str, local_root: str) -> dict:
    """TieredCheckpointManager on two "nodes" (a local root each): saves of both tiers,
    then a resume from the local tier."""
    from ckpt.job import LocalTierOptions, ManagerOptions, TieredCheckpointManager
    from ckpt.root import CheckpointStore

    def tiered():
        return TieredCheckpointManager(root, local_root,
                                       ManagerOptions(busy="wait", lease_ttl_seconds=5.0),
                                       local=LocalTierOptions(node_rank=rank), cadence="4",
                                       local_cadence="2")

    mgr = tiered()
    for step in range(1, 7):
        mgr.maybe_save(step, state_at(rank, step))
    mgr.wait()
    out = {"num_nodes": mgr.num_nodes, "local_world": mgr.local.world_size}
    mgr.close()
    out["local"] = CheckpointStore(local_root.replace("{node}", str(rank))).committed_steps()
    out["durable"] = CheckpointStore(root).committed_steps()
    mgr = tiered()
    state = state_at(rank, -1)
    m = mgr.load_latest(state)
    out["resumed"] = (m.step, mgr.resumed.tier, step_of(state, rank))
    mgr.close()
    return out


def trainer_managers_body(rank: int, world: int, root: str, local_root: str) -> dict:
    """The trainer's start-up: build_manager (plain, and tiered on one node), a resume that
    finds nothing, saves, close."""
    from ckpt.events import EventBus
    from trainer.checkpointing import build_manager
    from trainer.config import config_from_dict

    out = {}
    for name, extra in (("plain", {}), ("tiered", {"local_root": local_root,
                                                   "local_interval": "1"})):
        cfg = config_from_dict({"checkpoint": {"root": f"{root}-{name}", "interval": "2",
                                               **extra}})
        mgr = build_manager(cfg, world, EventBus(rank=rank), "fingerprint")
        assert mgr.load_latest(state_at(rank, -1)) is None
        for step in range(1, 3):
            mgr.maybe_save(step, state_at(rank, step))
        mgr.wait()
        mgr.close()
        state = state_at(rank, -1)
        mgr = build_manager(cfg, world, EventBus(rank=rank), "fingerprint")
        out[name] = (mgr.load_latest(state).step, mgr.resumed.tier, step_of(state, rank))
        mgr.close()
    return out


def world_group_freed_body(rank: int, world: int, root: str) -> dict:
    """The store's world group leaves no thread behind at exit; a save after that makes a
    new one."""
    import gc

    import ckpt
    from ckpt.ranks.groups import free_all_at_exit
    from tests.ckpt._mgr_workers import native_threads

    gc.collect()
    before = native_threads()
    ckpt.save(state_at(rank, 1), root, 1)
    opened = native_threads()
    free_all_at_exit()  # what the interpreter runs at exit
    at_exit = native_threads()
    ckpt.save(state_at(rank, 2), root, 2)
    again = native_threads()
    free_all_at_exit()
    return {"before": before, "opened": opened, "at_exit": at_exit, "again": again,
            "after": native_threads()}
