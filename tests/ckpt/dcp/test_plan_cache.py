"""Plan caching (``ckpt.dcp.plancache``) keeps every guarantee of a fully planned save.

On 2 real gloo ranks:

* a replica that drifts on one rank is refused on the 50th cached save as on the first,
  naming the key (the digests of the holder sets travel with every cached plan);
* a cached plan reused by a later save writes files named by that save's own id: the first
  save's files are untouched and both checkpoints load;
* a layout change (a new key, a changed shape, dtype or placement) plans in full; one rank's
  change alone (a mixed set of cached and full plans) makes the save plan again on every rank;
* with a manager, the second and later saves build no local plan (DCP's
  ``create_default_local_save_plan`` is counted), and two managers in one process (two tiers)
  each keep their own plans, alternating saves of different states without mixing them up.

In one process: the coordinator's check of a global plan is linear in the chunks of one
tensor (DCP's pairwise ``_validate_global_plan`` is quadratic for chunks split along a
dimension other than the one it sweeps), and still finds every overlap, gap and chunk out of
bounds.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from ckpt.dcp import SaveRequest
from ckpt.dcp.api import save_with
from ckpt.dcp.api import resolve_state
from ckpt.dcp.planners import SafeSavePlanner, tiling_problem
from ckpt.storage import Storage
from tests.ckpt._helpers import least_cpu_seconds
from tests.dist import run_ranks

pytestmark = pytest.mark.timeout(300)



def _save(state, root: str, step: int, cache) -> None:
    """A loop's own save that keeps its plans (``ckpt.dcp.save_with`` with a ``SavePlanCache``),
    with no lease and nothing synced: what these tests measure is the planning."""
    save_with(resolve_state(state), Storage(root), step,
              SaveRequest(save_plan_cache=cache, durable=False))


def _model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(1, 4)).sum().backward()
    optim.step()
    return model, optim


def _drift_body(rank: int, world: int, root: str) -> dict:
    """50 cached saves of a replicated model, then one rank's replicated values differ."""
    import ckpt
    from ckpt.dcp import ModelState, PerRankState, SavePlanCache
    from ckpt.root import CheckpointStore

    class Counter:
        def __init__(self):
            self.n = rank

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, sd):
            self.n = sd["n"]

    model, optim = _model()  # the same on every rank: replicas
    cache = SavePlanCache()
    counter = Counter()
    state = {"app": ModelState(model, optim), "cfg": {"lr": 0.1, "name": "x"},
             "mine": PerRankState(counter)}
    for step in range(1, 51):
        counter.n = rank * 1000 + step
        _save(state, root, step, cache)
    assert (cache.num_full_plans, cache.num_cached_plans, cache.num_replans) == (1, 49, 0)
    store = CheckpointStore(root)
    first, last = store.read_manifest(1), store.read_manifest(50)
    out = {"ids": [first.save_id, last.save_id],
           "files": [sorted(first.files), sorted(last.files)]}

    # An object replica drifts on rank 1: refused, naming the key; nothing committed.
    state["cfg"]["lr"] = 0.1 if rank == 0 else 0.2
    with pytest.raises(ValueError) as info:
        _save(state, root, 51, cache)
    out["object_error"] = str(info.value)
    state["cfg"]["lr"] = 0.1
    # A tensor replica (a DDP-style model weight) drifts by one element on rank 1.
    with torch.no_grad():
        model[1].bias[0] += rank
    with pytest.raises(ValueError) as info:
        _save(state, root, 51, cache)
    out["tensor_error"] = str(info.value)
    with torch.no_grad():
        model[1].bias[0] -= rank
    assert cache.num_replans == 2
    assert 51 not in store.committed_steps()
    # Back in line: saved from the cache again (the failed full plans cached nothing).
    _save(state, root, 51, cache)
    assert (cache.num_full_plans, cache.num_cached_plans) == (3, 52)

    # Every checkpoint loads as saved: step 1's files were never overwritten by later saves.
    for step in (1, 50):
        fresh_model, fresh_optim = _model(seed=7)
        got = Counter()
        ckpt.load({"app": ModelState(fresh_model, fresh_optim), "cfg": {"lr": 0.0, "name": ""},
                   "mine": PerRankState(got)}, root, step)
        assert got.n == rank * 1000 + step
        for a, b in zip(model.parameters(), fresh_model.parameters()):
            assert torch.equal(a, b)
        store.verify(step)
    return out


def test_a_drifting_replica_is_refused_on_the_50th_cached_save(tmp_path):
    results = run_ranks(_drift_body, 2, str(tmp_path / "root"), timeout=240)
    out = results[0]
    assert "'cfg.lr' (rank 0 | rank 1)" in out["object_error"], out["object_error"]
    assert "'app.model.1.bias' (rank 0 | rank 1)" in out["tensor_error"], out["tensor_error"]
    # Each save's data files carry its own save id, from every rank.
    first_id, last_id = out["ids"]
    assert first_id != last_id
    for save_id, files in zip(out["ids"], out["files"]):
        ranks = {name[:6] for name in files}
        assert ranks == {"r00000", "r00001"}, files
        assert all(name.startswith(f"r0000{r}_{save_id}_") for r in (0, 1)
                   for name in files if name.startswith(f"r0000{r}")), files


def _layout_body(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import ckpt
    from ckpt.dcp import SavePlanCache

    mesh = init_device_mesh("cpu", (world,))
    cache = SavePlanCache()
    state = {"w": {"a": torch.ones(4)}, "n": 1,
             "d": distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])}
    counts = []

    def save(step):
        _save(state, root, step, cache)
        counts.append((cache.num_full_plans, cache.num_cached_plans, cache.num_replans))

    save(1)
    save(2)  # cached
    state["w"]["b"] = torch.arange(3.0)  # a new parameter, on every rank
    save(3)
    state["w"]["a"] = torch.arange(5.0)  # a new shape
    save(4)
    state["w"]["a"] = torch.arange(5, dtype=torch.float64)  # a new dtype
    save(5)
    state["d"] = distribute_tensor(torch.arange(8.0) * 2, mesh, [Replicate()])  # placement
    save(6)
    if rank == 1:  # one rank's layout alone: the others' plans are cached
        state["extra"] = {f"rank{rank}": torch.full((2,), 7.0)}
    save(7)
    save(8)  # cached again
    # Every checkpoint loads into the state it was saved from.
    loaded = {"w": {"a": torch.zeros(5, dtype=torch.float64), "b": torch.zeros(3)}, "n": 0,
              "d": distribute_tensor(torch.zeros(8), mesh, [Replicate()])}
    if rank == 1:
        loaded["extra"] = {"rank1": torch.zeros(2)}
    ckpt.load(loaded, root, 8)
    assert torch.equal(loaded["w"]["a"], state["w"]["a"])
    assert torch.equal(loaded["w"]["b"], torch.arange(3.0))
    assert torch.equal(loaded["d"].full_tensor(), torch.arange(8.0) * 2)
    if rank == 1:
        assert torch.equal(loaded["extra"]["rank1"], torch.full((2,), 7.0))
    old = {"w": {"a": torch.zeros(4)}, "n": 0,
           "d": distribute_tensor(torch.zeros(8), mesh, [Shard(0)])}
    ckpt.load(old, root, 1)
    assert torch.equal(old["w"]["a"], torch.ones(4))
    assert torch.equal(old["d"].full_tensor(), torch.arange(8.0))
    return {"counts": counts}


def test_a_layout_change_plans_again(tmp_path):
    results = run_ranks(_layout_body, 2, str(tmp_path / "root"), timeout=180)
    # (full plans, cached plans, replans) after each save.
    expected_rank0 = [(1, 0, 0), (1, 1, 0), (2, 1, 0), (3, 1, 0), (4, 1, 0), (5, 1, 0),
                      (6, 2, 1), (6, 3, 1)]
    assert results[0]["counts"] == expected_rank0
    # Rank 1 planned its changed layout in full at step 7, then again in the retry.
    assert results[1]["counts"][6] == (7, 1, 1)


def _manager_body(rank: int, world: int, root: str) -> dict:
    import torch.distributed.checkpoint.default_planner as default_planner

    import ckpt.dcp.planners as planners
    from ckpt.dcp import ModelState
    from ckpt.job import CheckpointManager, ManagerOptions

    calls = []
    original = default_planner.create_default_local_save_plan

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    # DCP's planner and ours (whichever one plans) build a local plan through this function.
    default_planner.create_default_local_save_plan = counted
    if hasattr(planners, "create_default_local_save_plan"):
        planners.create_default_local_save_plan = counted
    model_a, optim_a = _model(seed=1)
    torch.manual_seed(2)
    model_b = torch.nn.Linear(3, 5)
    optim_b = torch.optim.SGD(model_b.parameters(), lr=0.5, momentum=0.9)
    model_b(torch.ones(1, 3)).sum().backward()
    optim_b.step()
    # Two managers in one process, as the two tiers of TieredCheckpointManager, saving
    # different states in turn.
    a = CheckpointManager(f"{root}/a", ManagerOptions(async_save=False, use_lease=False),
                          retention=[])
    b = CheckpointManager(f"{root}/b", ManagerOptions(async_save=False, use_lease=False),
                          retention=[])
    state_a = {"app": ModelState(model_a, optim_a), "step": 0}
    state_b = {"other": ModelState(model_b, optim_b), "tag": "b"}
    for step in (1, 2, 3):
        state_a["step"] = step
        with torch.no_grad():
            model_a[0].bias.add_(1.0)
            model_b.bias.add_(1.0)
        a.save(step, state_a)
        b.save(step, state_b)
    counts = {name: (m.save_plan_cache.num_full_plans, m.save_plan_cache.num_cached_plans)
              for name, m in (("a", a), ("b", b))}
    assert a.save_plan_cache is not b.save_plan_cache
    fresh_a, fresh_optim_a = _model(seed=9)
    loaded_a = {"app": ModelState(fresh_a, fresh_optim_a), "step": 0}
    torch.manual_seed(3)
    fresh_b = torch.nn.Linear(3, 5)
    fresh_optim_b = torch.optim.SGD(fresh_b.parameters(), lr=0.1, momentum=0.9)
    loaded_b = {"other": ModelState(fresh_b, fresh_optim_b), "tag": ""}
    assert a.load_latest(loaded_a).step == 3 and b.load_latest(loaded_b).step == 3
    a.close()
    b.close()
    assert loaded_a["step"] == 3 and loaded_b["tag"] == "b"
    for x, y in zip(list(model_a.parameters()) + list(model_b.parameters()),
                    list(fresh_a.parameters()) + list(fresh_b.parameters())):
        assert torch.equal(x, y)
    assert fresh_optim_b.param_groups[0]["lr"] == 0.5
    return {"calls": len(calls), "counts": counts,
            "files": sorted(os.listdir(f"{root}/a/step_000000003"))}


def test_cached_saves_build_no_local_plan_and_two_managers_keep_their_own(tmp_path):
    results = run_ranks(_manager_body, 2, str(tmp_path / "root"), timeout=240)
    for out in results:
        # One full local plan per manager (its first save), none for the 4 saves after.
        assert out["calls"] == 2, out
        assert out["counts"] == {"a": (1, 2), "b": (1, 2)}, out


def _chunked_plans(num_chunks: int, *, rows: int = 1 << 20) -> list[SavePlan]:
    """One tensor [rows, num_chunks], one column per rank: split along dim 1 while DCP
    sweeps dim 0 (the larger), so all chunks are active at once in its sweep."""
    size = torch.Size([rows, num_chunks])
    props = TensorProperties(dtype=torch.float32)
    plans = []
    for r in range(num_chunks):
        offs, sizes = torch.Size([0, r]), torch.Size([rows, 1])
        item = WriteItem(MetadataIndex("w", offs), WriteItemType.SHARD,
                         tensor_data=TensorWriteData(ChunkStorageMetadata(offs, sizes),
                                                     props, size))
        plans.append(SavePlan([item], planner_data={"w": ("w",)}))
    return plans


def test_global_plan_check_is_linear_in_the_chunks_of_one_tensor():
    def cpu_seconds(n: int) -> float:
        plans = _chunked_plans(n)
        return least_cpu_seconds(lambda: SafeSavePlanner().create_global_plan(plans))

    cpu_seconds(100)  # warm up
    small, large = cpu_seconds(500), cpu_seconds(4000)
    # Linear: x8 (plus the per-rank plan handling), measured x5-12; DCP's pairwise check
    # is quadratic: x64.
    assert large / small < 32, (small, large)


class _C:
    def __init__(self, offsets, sizes):
        self.offsets, self.sizes = offsets, sizes


@pytest.mark.parametrize("chunks,problem,gap", [
    ([((0, 0), (2, 4)), ((2, 0), (2, 4))], None, False),  # rows
    ([((0, 0), (4, 1)), ((0, 1), (4, 3))], None, False),  # uneven columns
    ([((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2)), ((2, 2), (2, 2))], None,
     False),  # grid
    ([((0, 0), (2, 4)), ((2, 0), (2, 1)), ((2, 1), (2, 3))], None, False),  # no grid, tiles
    ([((0, 0), (4, 4)), ((4, 0), (0, 4))], None, False),  # an empty chunk at the edge
    ([((0, 0), (2, 4)), ((1, 0), (3, 4))], "key 'w': chunks hold 20", False),  # overlap
    ([((0, 0), (2, 4)), ((1, 0), (1, 4)), ((3, 0), (1, 4))],
     "key 'w'.chunks[0] (offsets [0, 0], sizes [2, 4]) overlaps another", False),  # same count
    ([((0, 0), (2, 4)), ((0, 0), (2, 4)), ((2, 0), (2, 4))], "key 'w': chunks hold 24",
     False),  # twice
    ([((0, 0), (2, 4)), ((2, 0), (1, 4))], "key 'w': chunks hold 12 elements", True),  # a row
    ([((0, 0), (2, 2)), ((2, 2), (2, 2))], "key 'w': chunks hold 8", True),  # grid cells
    ([((0, 0), (2, 4)), ((2, 0), (3, 4))],
     "key 'w'.chunks[1] (offsets [2, 0], sizes [3, 4]) lies outside", False),
])
def test_chunk_check_finds_every_overlap_gap_and_stray_chunk(chunks, problem, gap):
    boxes = [_C(o, s) for o, s in chunks]
    got = tiling_problem("w", (4, 4), boxes)
    if problem is None:
        assert got is None
    else:
        assert got and problem in got, got
    # One node's share (partial) may leave a gap, never an overlap or a stray chunk.
    assert (tiling_problem("w", (4, 4), boxes, partial=True) is None) == (problem is None
                                                                          or gap)
    # DCP's planner refuses the same plans (and accepts the same ones).
    plans = []
    for offs, sizes in chunks:
        item = WriteItem(MetadataIndex("w", torch.Size(offs)), WriteItemType.SHARD,
                         tensor_data=TensorWriteData(
                             ChunkStorageMetadata(torch.Size(offs), torch.Size(sizes)),
                             TensorProperties(dtype=torch.float32), torch.Size([4, 4])))
        plans.append(SavePlan([item]))
    if len({offs for offs, _ in chunks}) == len(chunks):  # DCP's dedup would merge twins
        if problem is None:
            SafeSavePlanner().create_global_plan(plans)
        else:
            with pytest.raises(ValueError, match="Failed to validate global plan"):
                SafeSavePlanner().create_global_plan(plans)
