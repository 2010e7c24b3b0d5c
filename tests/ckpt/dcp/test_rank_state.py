"""State that differs by rank, and Stateful objects that run collectives, on 2 real gloo ranks.

* Stateful objects are visited in one order on every rank (sorted keys), whatever order each
  rank's dict lists them in: objects whose ``state_dict``/``load_state_dict`` run a collective
  on their own group would otherwise wait for each other forever.
* A plain tensor under a key every rank has is saved once (DCP deduplicates it as a replica);
  when the ranks' values differ the save is refused before anything is committed, naming the
  key and the ranks. Per-rank state under per-rank keys (``RNGState``, ``PerRankState``)
  comes back to each rank as its own.
"""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
import torch
from torch.distributed.checkpoint.planner import SavePlan

from ckpt.dcp.planners import SafeSavePlanner
from tests.dist import run_ranks


class _Collective:
    """A Stateful whose state_dict and load_state_dict each run an all-reduce on ``group``."""

    def __init__(self, group, rank: int):
        self.group = group
        self.value = torch.tensor([float(rank + 1)])
        self.loaded = None

    def state_dict(self):
        total = self.value.clone()
        torch.distributed.all_reduce(total, group=self.group)
        return {"sum": total}  # the same on every rank: a true replica

    def load_state_dict(self, sd):
        total = sd["sum"].clone()
        torch.distributed.all_reduce(total, group=self.group)
        self.loaded = float(total.item())


def _opposite_orders(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    import ckpt
    from ckpt.dcp.api import apply_state, resolve_state

    # A short timeout turns the deadlock into an error instead of a hang.
    ga = dist.new_group(backend="gloo", timeout=timedelta(seconds=10))
    gb = dist.new_group(backend="gloo", timeout=timedelta(seconds=10))
    a, b = _Collective(ga, rank), _Collective(gb, rank)
    state = {"a": a, "b": b} if rank == 0 else {"b": b, "a": a}
    sd = resolve_state(state)
    apply_state(state, sd)
    ckpt.save(state, root, 1)
    a.value.fill_(100.0)
    ckpt.load(state, root, 1)
    return {"a": a.loaded, "b": b.loaded}


def test_stateful_objects_run_in_one_order_on_every_rank(tmp_path):
    results = run_ranks(_opposite_orders, 2, str(tmp_path / "root"), timeout=90)
    # The loaded sum (3 on each rank) is all-reduced again on load: 6.
    assert results == [{"a": 6.0, "b": 6.0}] * 2


class _Gen:
    """A user's own generator, saved as its state tensor (different on every rank)."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)

    def state_dict(self):
        return {"state": self.gen.get_state()}

    def load_state_dict(self, sd):
        self.gen.set_state(sd["state"])


def _per_rank_body(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    import ckpt
    from ckpt.dcp import PerRankState, RNGState, rank_key
    from ckpt.root import CheckpointStore
    from trainer.data import BatchLoader, SyntheticMarkovDataset

    out = {}
    # 1. Per-rank values under shared keys: refused, naming the keys and ranks.
    same = torch.arange(10, dtype=torch.float32)
    nearly = torch.zeros(1000)
    nearly[999] = rank  # one element differs
    bad = {"gen": _Gen(seed=rank), "weights": {"w": nearly, "same": same}, "step": 3}
    with pytest.raises(ValueError) as info:
        ckpt.save(bad, root, 1)
    out["message"] = str(info.value)
    # The data loader's state is replicated by contract; a rank that drifted is refused.
    drifted = BatchLoader(SyntheticMarkovDataset(32, 8, seed=5), 8, rank, world)
    for _ in range(rank):
        drifted.next_batch()
    with pytest.raises(ValueError, match=r"'data.next_batch' \(rank 0 \| rank 1\)"):
        ckpt.save({"data": drifted}, root, 1)
    assert CheckpointStore(root).committed_steps() == []
    dist.barrier()

    # 2. The same state with per-rank keys saves, and every rank gets its own back.
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    gen = _Gen(seed=rank)
    loader = BatchLoader(SyntheticMarkovDataset(32, 8, seed=5), 8, rank, world)
    for _ in range(3):
        loader.next_batch()
    state = {"rng": RNGState(), "gen": PerRankState(gen), "data": loader,
             "weights": {"same": same}}
    assert list(state["gen"].state_dict()) == [rank_key(rank)]
    ckpt.save(state, root, 2)
    expected = (torch.rand(4), random.random(), torch.rand(4, generator=gen.gen),
                loader.next_batch()[0])
    # Scramble every stream the same way on every rank, then load.
    torch.manual_seed(0)
    random.seed(0)
    gen.gen.manual_seed(0)
    loader = BatchLoader(SyntheticMarkovDataset(32, 8, seed=5), 8, rank, world)
    state["data"] = loader
    ckpt.load(state, root, 2)
    got = (torch.rand(4), random.random(), torch.rand(4, generator=gen.gen),
           loader.next_batch()[0])
    assert torch.equal(got[0], expected[0]), "torch RNG"
    assert got[1] == expected[1], "python RNG"
    assert torch.equal(got[2], expected[2]), "user generator"
    assert torch.equal(got[3], expected[3]), "data loader"
    out["draw"] = expected[1]
    return out


def test_per_rank_values_under_a_shared_key_are_refused_and_per_rank_keys_restore(tmp_path):
    results = run_ranks(_per_rank_body, 2, str(tmp_path / "root"), timeout=90)
    message = results[0]["message"]
    assert results[1]["message"] == message
    assert "'gen.state'" in message and "'weights.w'" in message, message
    assert "'weights.same'" not in message and "step" not in message, message
    assert "rank 0" in message and "rank 1" in message, message
    assert "per-rank key" in message, message
    # The ranks' streams really differed (else the per-rank restore proves nothing).
    assert results[0]["draw"] != results[1]["draw"]


def _plans(*digests_by_rank: dict[str, int]) -> list[SavePlan]:
    planner = SafeSavePlanner()
    return [SavePlan(items=[], planner_data={planner.digest_key(k): [v] for k, v in d.items()})
            for d in digests_by_rank]


def test_divergence_message_groups_ranks_by_value():
    plans = _plans({"x": 1, "y": 5}, {"x": 1, "y": 5}, {"x": 2, "y": 5}, {"x": 3})
    with pytest.raises(ValueError) as info:
        SafeSavePlanner().create_global_plan(plans)
    message = str(info.value)
    assert "'x'" in message and "'y'" not in message, message
    assert "ranks 0, 1" in message and "rank 2" in message and "rank 3" in message, message


def _local_plan(state) -> SavePlan:
    planner = SafeSavePlanner()
    planner.set_up_planner(state, None, True)
    return planner.create_local_plan()


def test_replica_check_compares_bytes_dtype_and_shape_through_real_local_plans():
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    same = [_local_plan({"t": base.clone(), "n": 1}) for _ in range(2)]
    SafeSavePlanner().create_global_plan(same)  # identical replicas: accepted
    # Non-contiguous views are checksummed by value, like the writer does.
    SafeSavePlanner().create_global_plan([_local_plan({"t": base}),
                                          _local_plan({"t": base.t().contiguous().t()})])
    for other in (base.reshape(3, 2), base.view(torch.int32), base + 1):
        plans = [_local_plan({"t": base}), _local_plan({"t": other})]
        with pytest.raises(ValueError, match=r"'t' \(rank 0 \| rank 1\)"):
            SafeSavePlanner().create_global_plan(plans)
