"""Bodies of the two-tier tests (module-level: run_ranks pickles them by name)."""

from __future__ import annotations

from pathlib import Path

import torch


def state_at(rank: int, step: int) -> dict:
    """A tiny state whose every value depends on the step: replicated and per-rank parts."""
    return {"model": {"w": torch.full((16, 4), float(step)), "b": torch.arange(8.0) + step},
            f"own{rank}": {"x": torch.full((5,), float(100 * rank + step))},
            "progress": {"step": step}}


def blank(rank: int) -> dict:
    return state_at(rank, -1)


def step_of(state: dict, rank: int) -> int:
    step = state["progress"]["step"]
    assert torch.equal(state["model"]["w"], torch.full((16, 4), float(step)))
    assert torch.equal(state["model"]["b"], torch.arange(8.0) + step)
    assert torch.equal(state[f"own{rank}"]["x"], torch.full((5,), float(100 * rank + step)))
    return step


def _mgr(root: str, local_root: str, node_rank: int | None, copies: int = 1, **kw):
    from ckpt.job import LocalTierOptions, ManagerOptions, TieredCheckpointManager

    return TieredCheckpointManager(root, local_root,
                                   ManagerOptions(busy="wait", lease_ttl_seconds=5.0),
                                   local=LocalTierOptions(node_rank=node_rank, copies=copies),
                                   cadence=kw.pop("cadence", "4"),
                                   local_cadence=kw.pop("local_cadence", "2"), **kw)


def _run(mgr, rank: int, first: int, last: int) -> None:
    for step in range(first, last + 1):
        mgr.maybe_save(step, state_at(rank, step))
    mgr.wait()


def _local_files(local_root: str, step: int) -> list[Path]:
    """The data files of ``step`` under a local root (by the format's names)."""
    return sorted((Path(local_root) / f"step_{step:09d}").glob("r*.bin"))


def nodes_body(rank: int, world: int, root: str, local_root: str) -> dict:
    """Two ranks as two nodes (a local root each): cadences, resume order and fall back."""
    from ckpt.root import CheckpointStore

    out: dict = {}
    mine = local_root.replace("{node}", str(rank))
    # 1. local every 2, durable every 4, steps 1..10.
    mgr = _mgr(root, local_root, rank)
    _run(mgr, rank, 1, 10)
    assert mgr.num_nodes == 2 and mgr.local.world_size == 1
    mgr.close()
    out["local"] = CheckpointStore(mine).committed_steps()
    out["durable"] = CheckpointStore(root).committed_steps()
    # 2. Resume: the newest step is local only (10); local tried first.
    mgr = _mgr(root, local_root, rank)
    state = blank(rank)
    m = mgr.load_latest(state)
    out["resume1"] = (m.step, mgr.resumed.tier, step_of(state, rank))
    _run(mgr, rank, 11, 12)  # local 12 (durable's next is 12 too: one interval after 8)
    mgr.close()
    out["after_resume"] = (CheckpointStore(mine).committed_steps(),
                           CheckpointStore(root).committed_steps())
    # 3. Node 1 loses its local tier (a lost node): local steps are on node 0 only.
    torch.distributed.barrier()
    if rank == 1:
        import shutil
        shutil.rmtree(mine)
    torch.distributed.barrier()
    mgr = _mgr(root, local_root, rank)
    state = blank(rank)
    m = mgr.load_latest(state)
    out["resume_wiped"] = (m.step, mgr.resumed.tier, step_of(state, rank))
    _run(mgr, rank, 13, 14)  # local 14 on both nodes again
    mgr.close()
    out["after_wiped"] = CheckpointStore(mine).committed_steps()
    # 4. Node 1's newest local file damaged (one byte): fall back, agreed, to an older one.
    torch.distributed.barrier()
    if rank == 1:
        damaged = _local_files(mine, 14)
        assert damaged, list(Path(mine).rglob("*"))
        data = bytearray(damaged[0].read_bytes())
        data[len(data) // 2] ^= 0xFF
        damaged[0].write_bytes(bytes(data))
    torch.distributed.barrier()
    mgr = _mgr(root, local_root, rank)
    state = blank(rank)
    m = mgr.load_latest(state)
    out["resume_damaged"] = (m.step, mgr.resumed.tier, step_of(state, rank))
    fallbacks = [(e.step, e.fields.get("tier")) for e in mgr.events.of_kind("load_fallback")]
    out["fallbacks"] = fallbacks
    mgr.close()
    out["local_after_damaged"] = CheckpointStore(mine).committed_steps()
    return out


def one_node_body(rank: int, world: int, root: str, local_root: str) -> dict:
    """Two ranks on one node: one stall when both tiers are due; per-tier retention."""
    from ckpt.root import CheckpointStore

    mgr = _mgr(root, local_root, 0, cadence="3", local_cadence="1")
    copies = []
    for step in range(1, 7):
        before = (mgr.durable.num_stages, mgr.local.num_stages)
        mgr.maybe_save(step, state_at(rank, step))
        after = (mgr.durable.num_stages, mgr.local.num_stages)
        copies.append((step, after[0] - before[0], after[1] - before[1]))
    mgr.wait()
    events = mgr.events.of_kind("save_staged") + mgr.events.of_kind("local_save_staged")
    staged = [(e.step, e.fields.get("tier"), e.fields["reused"]) for e in events]
    committed = sorted([(e.step, "durable") for e in mgr.events.of_kind("save_committed")]
                       + [(e.step, e.fields["tier"])
                          for e in mgr.events.of_kind("local_save_committed")])
    mgr.close()
    return {"copies": copies, "staged": staged, "committed": committed,
            "local": CheckpointStore(local_root).committed_steps(),
            "durable": CheckpointStore(root).committed_steps()}


def _fsdp_across_nodes(world: int):
    """A tiny model and optimizer under FSDP2 over every rank (each parameter sharded across
    the nodes), and a 2-D ``probe`` DTensor sharded by rows over every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from tests.ckpt._mgr_workers import _mlp

    torch.manual_seed(3)  # identical on every rank, as FSDP2 expects
    mesh = init_device_mesh("cpu", (world,))
    model = _mlp()
    fully_shard(model, mesh=mesh)
    probe = distribute_tensor(torch.arange(8.0 * world).reshape(2 * world, 4), mesh, [Shard(0)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), probe, mesh


def fsdp_nodes_body(rank: int, world: int, root: str, local_root: str, per_node: int,
                    replicas: int) -> dict:
    """FSDP2 over every rank of 2 "nodes" x ``per_node`` ranks (node = rank // per_node):
    each node's local checkpoint holds its share. A first job trains 1..7 (local every 2,
    keep 2: 4 and 6; durable every 4) and stops. Then the partial local versions are asked
    for what they cannot give (another node's root, a state sharded otherwise: refused in
    one line); with ``replicas`` = 2 node 1's local root is wiped (a replaced machine) and a
    job resumes from local 6 through node 0's copy; with 1 a job resumes from local 6 as it
    is, node 1 is wiped, and the next job falls back to the durable tier. Every resume must
    equal, bit for bit, the state saved at the step it names."""
    import shutil

    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    import ckpt
    from ckpt.dcp import ModelState
    from ckpt.dcp.api import resolve_state
    from ckpt.errors import PartialCheckpointError
    from tests.ckpt._helpers import assert_same, snapshot
    from tests.ckpt._mgr_workers import _train

    node, nodes = rank // per_node, 2
    model, opt, probe, mesh = _fsdp_across_nodes(world)

    def state(step: int) -> dict:
        return {"m": ModelState(model, opt), "probe": probe, "progress": {"step": step}}

    def mgr():
        return _mgr(root, local_root, node, copies=replicas)

    out: dict = {}
    saved: dict[int, dict] = {}
    m = mgr()
    for step in range(1, 8):
        _train([(model, opt)], rank, step)
        with torch.no_grad():
            probe.to_local().add_(1.0)
        if m.maybe_save(step, state(step)):
            m.wait()  # each copy to the next node lands before the next save
            saved[step] = snapshot(resolve_state(state(step)))
    m.close()
    mine = local_root.replace("{node}", str(node))
    meta = ckpt.CheckpointStore(mine).read_manifest(6)
    out["span"] = meta.span.to_json()
    out["parts"] = sorted(r.rank for r in meta.parts.values())
    # What a node's partial version cannot give, refused in one line on every rank alike.
    group, _ = dist.new_subgroups_by_enumeration(
        [list(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)], backend="gloo")
    other = local_root.replace("{node}", str(1 - node))
    refused = {}
    for what, target, into in (
            ("other node", other, state(0)),
            ("other sharding", mine,
             {"probe": distribute_tensor(torch.zeros(2 * world, 4), mesh, [Shard(1)])})):
        before = snapshot(resolve_state(into))
        try:
            ckpt.load(into, target, 6, process_group=group, strict=False)
        except PartialCheckpointError as exc:
            refused[what] = str(exc)
        assert_same(before, snapshot(resolve_state(into)), f"rank {rank}: {what} changed")
    out["refused"] = refused

    def resume() -> tuple:
        m = mgr()
        target = state(-1)
        loaded = m.load_latest(target)
        assert_same(saved[loaded.step], snapshot(resolve_state(target)), f"rank {rank}")
        events = {k: [e.step for e in m.events.of_kind(k)]
                  for k in ("copy_restored", "load_fallback")}
        m.close()
        return loaded.step, m.resumed.tier, events

    if replicas == 1:
        out["intact"] = resume()
    dist.barrier()
    if rank == per_node:  # node 1's first rank: its machine is replaced, empty
        shutil.rmtree(local_root.replace("{node}", "1"))
    dist.barrier()
    out["wiped"] = resume()
    return out


def assert_refused_where_partial(out: list[dict], per_node: int) -> None:
    """Each rank of ``w.fsdp_nodes_body``: its node's local version named its share, one
    part per rank of the node, and was refused in one line where it cannot serve."""
    for rank, r in enumerate(out):
        node = rank // per_node
        ranks = list(range(node * per_node, (node + 1) * per_node))
        assert r["span"] == {"node": node, "nodes": 2, "ranks": ranks,
                             "world_size": 2 * per_node}
        assert r["parts"] == list(range(per_node))
        other, sharded = r["refused"]["other node"], r["refused"]["other sharding"]
        assert f"node {1 - node}'s share of a job of 2 nodes" in other
        assert "loads only on that layout" in other and "\n" not in other
        assert "lacks chunks of key 'probe'" in sharded and "\n" not in sharded


def hsdp_nodes_body(rank: int, world: int, root: str, local_root: str) -> dict:
    """HSDP on 2 "nodes" x 2 ranks (shard within a node, replicate across nodes): each
    node's local checkpoint holds whole tensors; resuming from it restores the sharded model
    and optimizer bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ckpt.dcp import ModelState
    from ckpt.dcp.api import resolve_state
    from tests.ckpt._helpers import assert_same, snapshot
    from tests.ckpt._mgr_workers import _mlp, _train

    torch.manual_seed(3)
    model = _mlp()
    fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard")))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"m": ModelState(model, opt)}
    node = rank // 2
    mgr = _mgr(root, local_root, node, cadence="4", local_cadence="3")
    for step in range(1, 7):
        _train([(model, opt)], rank, step)
        mgr.maybe_save(step, state)
    mgr.wait()
    saved = snapshot(resolve_state(state))
    _train([(model, opt)], rank, 7)  # move on, unsaved
    mgr.close()
    mgr = _mgr(root, local_root, node, cadence="4", local_cadence="3")
    m = mgr.load_latest(state)
    assert_same(saved, snapshot(resolve_state(state)), f"rank {rank}")
    out = {"step": m.step, "tier": mgr.resumed.tier, "world_size": m.world_size}
    mgr.close()
    return out


def timed_nodes_body(rank: int, world: int, root: str, local_root: str) -> list[int]:
    """A time-based local interval on two "nodes" whose steps take different times: both
    nodes still save the same local steps (decisions and busy skips agreed job-wide)."""
    import dataclasses
    import time

    from ckpt.root import CheckpointStore

    mgr = _mgr(root, local_root, rank, cadence="1000", local_cadence="60ms")
    mgr.local.options = dataclasses.replace(mgr.local.options, busy="skip")
    for step in range(1, 41):
        time.sleep(0.01 * (1 + 2 * rank))  # node 1 is slower
        mgr.maybe_save(step, state_at(rank, step))
    mgr.wait()
    mgr.close()
    kept = CheckpointStore(local_root.replace("{node}", str(rank))).committed_steps()
    return kept
