"""Save/load round trips on 1, 2 and 4 real gloo processes, bit-exact.

One launch per (storage, world size) checks every kind of state at once: plain tensors of
several dtypes (shared and per-rank), a DDP model + AdamW + LambdaLR, an FSDP2 model + AdamW +
CosineAnnealingLR, a step counter, per-rank RNG streams and an arbitrary Stateful object. It
also checks that each rank wrote only its own data files, several of them, from several
threads, and that the manifest records who wrote what. Each launch runs the round trip on
local disk and on S3 (moto over loopback HTTP, the ``s3_root`` fixture of tests/conftest.py).
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from ckpt.storage import Storage
from tests.ckpt._helpers import assert_same, snapshot
from tests.dist import run_ranks

STEP = 3
NUM_THREADS = 4


class _RecordingStorage(Storage):
    """Storage that records which file each write went to, and from which thread."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.writes: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def write_buffers(self, rel, buffers, **kwargs):
        with self._lock:
            self.writes.append((rel, threading.current_thread().name))
        return super().write_buffers(rel, buffers, **kwargs)

    def create_exclusive(self, rel, data):
        with self._lock:
            self.writes.append((rel, threading.current_thread().name))
        return super().create_exclusive(rel, data)


class _Counter:
    """An arbitrary user object with state_dict()/load_state_dict()."""

    def __init__(self, rank: int):
        self.n = 10 + rank
        self.name = f"counter-{rank}"
        self.history = [0.5, float("inf"), -1.25]
        self.pair = (rank, "x", None)
        self.blob = b"\x00\xffbytes"
        self.weights = torch.arange(5, dtype=torch.float64) * (rank + 1)

    def state_dict(self):
        return {"n": self.n, "name": self.name, "history": list(self.history),
                "pair": self.pair, "blob": self.blob, "weights": self.weights,
                "nested": {"ok": True, "ids": [1, 2, 3]}}

    def load_state_dict(self, sd):
        self.n, self.name, self.history = sd["n"], sd["name"], list(sd["history"])
        self.pair, self.blob = sd["pair"], sd["blob"]
        self.weights = sd["weights"].clone()
        assert sd["nested"] == {"ok": True, "ids": [1, 2, 3]}


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _train(model, optim, sched, rank: int, num_steps: int) -> None:
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(num_steps):
        x = torch.randn(4, 8, generator=g)
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad()
        sched.step()


def _roundtrip_body(rank: int, world: int, url: str, storage_options) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR

    import ckpt
    from ckpt.dcp import ModelState, RNGState
    from ckpt.dcp.api import resolve_state
    from ckpt.root import CheckpointStore

    storage = _RecordingStorage(url, storage_options)

    def build(seed: int):
        torch.manual_seed(seed)  # identical on every rank, as DDP/FSDP expect
        ddp = DDP(_mlp())
        ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        ddp_sched = LambdaLR(ddp_opt, lambda epoch: 0.9 ** epoch)
        fsdp = _mlp()
        fully_shard(fsdp, mesh=init_device_mesh("cpu", (world,)))
        fsdp_opt = torch.optim.AdamW(fsdp.parameters(), lr=2e-2, weight_decay=0.1)
        fsdp_sched = CosineAnnealingLR(fsdp_opt, T_max=10)
        return ddp, ddp_opt, ddp_sched, fsdp, fsdp_opt, fsdp_sched

    ddp, ddp_opt, ddp_sched, fsdp, fsdp_opt, fsdp_sched = build(0)
    _train(ddp, ddp_opt, ddp_sched, rank, 2)
    _train(fsdp, fsdp_opt, fsdp_sched, rank, 2)
    g = torch.Generator().manual_seed(7)  # shared tensors: same values on every rank
    shared = {"f32": torch.randn(6, 5, generator=g), "i64": torch.arange(12).reshape(3, 4),
              "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
              "mask": torch.tensor([True, False, True]), "scalar": torch.tensor(3.5),
              "empty": torch.empty(0, 3)}
    own = {f"t{i}": torch.randn(64, generator=torch.Generator().manual_seed(rank * 100 + i))
           for i in range(6)}
    own["i32"] = torch.full((5,), rank, dtype=torch.int32)
    torch.manual_seed(500 + rank)
    random.seed(600 + rank)
    state = {
        "shared": shared,
        f"rank{rank}": own,
        "ddp": ModelState(ddp, ddp_opt),
        "ddp_sched": ddp_sched,
        "fsdp": ModelState(fsdp, fsdp_opt),
        "fsdp_sched": fsdp_sched,
        "step": 7,
        "meta": {"epoch": 2, "tag": "pretrain"},
        "rng": RNGState(),
        # Same key on every rank means replicated (DCP saves it from one rank only), so a
        # per-rank object needs a per-rank key, as RNGState does.
        "counter": _Counter(0),
        f"counter{rank}": _Counter(rank),
    }
    expected = snapshot(resolve_state(state))
    manifest = ckpt.save(state, storage, STEP, num_threads=NUM_THREADS,
                         user_metadata={"note": "rt"})
    expected_draws = (torch.rand(3), random.random())  # saving must not consume randomness
    writes = list(storage.writes)
    dist.barrier()

    # Perturb everything in place, and recreate the DDP side from scratch.
    _train(fsdp, fsdp_opt, fsdp_sched, rank, 1)
    ddp, ddp_opt, ddp_sched, _, _, _ = build(99)
    state["ddp"], state["ddp_sched"] = ModelState(ddp, ddp_opt), ddp_sched
    for t in list(shared.values()) + list(own.values()):
        if t.numel():
            t.copy_(torch.zeros_like(t) if t.dtype != torch.bool else ~t)
    state["step"] = 0
    state["meta"]["epoch"] = 0
    for key in ("counter", f"counter{rank}"):
        state[key].n, state[key].pair = -1, ()
        state[key].weights = torch.zeros(5, dtype=torch.float64)
    torch.manual_seed(12345)
    random.seed(12345)
    # Sanity: the perturbation really changed things.
    with pytest.raises(AssertionError):
        assert_same(expected, snapshot(resolve_state(state)))

    loaded = ckpt.load(state, storage, STEP)
    assert loaded.step == STEP
    assert_same(expected, snapshot(resolve_state(state)))
    assert state["step"] == 7
    assert_same(expected_draws, (torch.rand(3), random.random()), "rng draws")
    # The restored DDP model still trains in lockstep (its buckets see the loaded params).
    _train(ddp, ddp_opt, ddp_sched, rank, 1)

    store = CheckpointStore(storage)
    on_storage = {name for name, kind, _ in storage.listdir(f"step_{STEP:09d}")}
    return {"writes": writes, "manifest_files": {n: (r.rank, r.size) for n, r in
                                                 store.read_manifest(STEP).files.items()},
            "world_size": store.read_manifest(STEP).world_size,
            "committed": store.committed_steps(), "on_storage": sorted(on_storage),
            "returned_manifest": manifest is not None}


def _roundtrip_all(rank: int, world: int, targets) -> list[dict]:
    # One launch covers every storage: process start-up dominates the cost of these tests.
    return [_roundtrip_body(rank, world, url, opts) for url, opts in targets]


@pytest.fixture
def targets(request, tmp_path) -> list[tuple[str, dict | None]]:
    """(url, storage_options) of empty roots: local disk, and S3 when its fixture exists."""
    out = [(str(tmp_path / "root"), None)]
    try:
        url, opts = request.getfixturevalue("s3_root")
        out.append((url, opts))
    except pytest.FixtureLookupError:  # tests/conftest.py without the S3 fixture
        pass
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_roundtrip(targets, world):
    per_rank = run_ranks(_roundtrip_all, world, targets, timeout=240)
    num_threads = []
    for i, (url, _) in enumerate(targets):
        num_threads += _check_files(url, world, [r[i] for r in per_rank])
    # Data files are written in parallel. (Per rank this is only very likely: a thread pool
    # may reuse one thread if each write ends before the next is submitted.)
    assert max(num_threads) >= 2, num_threads


def _check_files(url: str, world: int, results: list[dict]) -> list[int]:
    """Check who wrote what; return the number of writer threads each rank used."""
    num_threads = []
    files = results[0]["manifest_files"]
    assert results[0]["world_size"] == world
    assert results[0]["committed"] == [STEP]
    assert results[0]["returned_manifest"] and not any(r["returned_manifest"]
                                                      for r in results[1:])
    # Exactly the data files and parts the manifest lists are on storage, plus the manifest.
    assert results[0]["on_storage"] == sorted(list(files) + ["manifest.json"]), url
    files_id = next(iter(files)).split("_")[1].split(".")[0]
    for rank, res in enumerate(results):
        prefix = f"r{rank:05d}_"
        data_writes = [(rel.rsplit("/", 1)[-1], thread) for rel, thread in res["writes"]
                       if rel.endswith(".bin")]
        other = [rel for rel, _ in res["writes"] if not rel.endswith(".bin")]
        # Besides its data files a rank writes its own part (it holds FSDP shards when the
        # world has several ranks); only the coordinator writes anything else: in the step's
        # folder its attempt marker and the manifest; at the root the lease's control files.
        in_step = [rel for rel in other if rel.startswith(f"step_{STEP:09d}/")]
        parts = [rel.split("/")[1] for rel in in_step if rel.split("/")[1].startswith("part-")]
        assert parts == ([f"part-r{rank:05d}_{files_id}.json"] if world > 1 else []), \
            (url, rank, parts)
        assert all(files[name][0] == rank for name in parts), (url, rank, parts)
        assert all(rel in ("_lease.json",) or rel.startswith("_fence/")
                   for rel in other if rel not in in_step), (url, other)
        in_step = [rel for rel in in_step if rel.split("/")[1] not in parts]
        assert len(in_step) == (0 if rank else 2), (url, other)
        if rank == 0:
            assert in_step[0].split("/")[1].startswith("pending-") and \
                in_step[1].endswith("/manifest.json"), (url, other)
        names = sorted(n for n, _ in data_writes)
        assert all(n.startswith(prefix) for n in names), (url, rank, names)
        assert names == sorted(n for n, (r, _) in files.items() if r == rank
                               and n.endswith(".bin")), (url, rank, names)
        # Data is spread over several files written by a thread pool.
        assert 2 <= len(names) <= NUM_THREADS, (url, rank, names)
        threads = {t for _, t in data_writes}
        assert all(t.startswith("ckpt-write") for t in threads), (url, threads)
        num_threads.append(len(threads))
    return num_threads
