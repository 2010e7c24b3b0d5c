"""Cooperative loads: each byte a load needs is read from storage once, by one rank.

Real gloo ranks, real files; bytes are counted where they leave storage (a ``Storage`` whose
local files and ranged reads count the data-file bytes they return), summed over the ranks.

- A replicated state (DDP's, every HSDP replica's) saved once and loaded on 2 and 4 ranks
  reads each byte once in all (not once per rank), no rank much more than its share, and
  loads bit for bit; the same through ``CheckpointManager.load_latest`` and on ``memory://``
  (ranged reads).
- A 4 -> 2 reshard whose saved chunks straddle the loading ranks' shards reads the
  straddling chunk once.
- Bytes damaged in transit (a flipped byte in what a rank sends) are refused by the
  receiver: ``load_latest`` falls back to the step before, on every rank, the state left
  as the older step's.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.distributed as dist

import ckpt
from ckpt.dcp import SaveRequest
from ckpt.dcp.api import save_with
from ckpt.dcp.api import resolve_state
from ckpt.root import CheckpointStore
from ckpt.storage import Storage
from tests.ckpt._helpers import assert_same
from tests.dist import run_ranks

_DATA = re.compile(r"(?:^|/)r\d{5}_[0-9a-f]+_\d+\.bin$")


class _Counted:
    """A file object that adds what it reads to its storage's count."""

    def __init__(self, f, storage):
        self._f, self._storage = f, storage

    def readinto(self, view):
        n = self._f.readinto(view)
        self._storage.data_bytes_read += n or 0
        return n

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


class ReadCountingStorage(Storage):
    """A real ``Storage`` that counts the data-file bytes it returns (local or ranged)."""

    data_bytes_read = 0

    def open_local(self, rel):
        f = super().open_local(rel)
        return _Counted(f, self) if _DATA.search(rel) else f

    def read_bytes(self, rel, start=None, end=None, **kwargs):
        data = super().read_bytes(rel, start, end, **kwargs)
        if _DATA.search(rel):
            self.data_bytes_read += len(data)
        return data


def _replicated(seed: int, num_tensors: int = 12) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(4096 + 64 * i, generator=g)
                      for i in range(num_tensors)},
            "meta": {"step": seed, "note": f"seed {seed}"}}


def _zeros_like(state: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "meta": {"step": -1, "note": ""}}


def _data_bytes(root: str, step: int) -> int:
    """Bytes of the items a full load reads (every chunk and object, once)."""
    m = CheckpointStore(root).read_manifest(step)
    return sum(rec.size for name, rec in m.files.items() if _DATA.search(name))


def _load_replicated(rank, world, root, via):
    warnings.filterwarnings("ignore", message=".*assuming the intent is")
    saved = _replicated(1)
    ckpt.save(saved, root, 1)
    storage = ReadCountingStorage(root)
    state = _zeros_like(saved)
    if via == "manager":
        mgr = ckpt.CheckpointManager(storage, ckpt.ManagerOptions(use_lease=False))
        try:
            assert mgr.load_latest(state).step == 1
        finally:
            mgr.close()
    else:
        ckpt.load(state, storage, 1)
    assert_same(saved, state)
    return storage.data_bytes_read


@pytest.mark.parametrize("world,via", [(2, "load"), (4, "load"), (2, "manager")])
def test_replicated_load_reads_each_byte_once(tmp_path, world, via):
    root = str(tmp_path / "root")
    per_rank = run_ranks(_load_replicated, world, root, via)
    total = _data_bytes(root, 1)
    # Today's load read everything on every rank: world x total.
    assert sum(per_rank) <= 1.05 * total, (per_rank, total)
    largest = max(v.numel() * 4 for v in _replicated(1)["model"].values())
    assert max(per_rank) <= total / world + largest + 4096, (per_rank, total)


def _load_replicated_memory(rank, world, prefix):
    warnings.filterwarnings("ignore", message=".*assuming the intent is")
    # memory:// is per process: every rank saves the same files (one save id) alone, then
    # the group loads; each rank counts its ranged reads.
    saved = _replicated(2)
    root = f"memory://{prefix}"
    alone = [dist.new_group([r], backend="gloo") for r in range(world)]
    save_with(resolve_state(saved), Storage(root), 2, SaveRequest(save_id="c0c0c0c0c0c0"),
              process_group=alone[rank])
    storage = ReadCountingStorage(root)
    state = _zeros_like(saved)
    ckpt.load(state, storage, 2)
    assert_same(saved, state)
    m = CheckpointStore(root).read_manifest(2)
    return storage.data_bytes_read, sum(r.size for n, r in m.files.items() if _DATA.search(n))


def test_replicated_load_reads_each_byte_once_remote():
    per_rank = run_ranks(_load_replicated_memory, 2, "/coop-remote")
    total = per_rank[0][1]
    assert sum(n for n, _ in per_rank) <= 1.05 * total, per_rank


def _reshard(rank, world, root, save_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    warnings.filterwarnings("ignore", message=".*assuming the intent is")
    full = torch.arange(10 * 1024, dtype=torch.float32).reshape(10, 1024)
    if world == save_world:
        mesh = init_device_mesh("cpu", (world,))
        ckpt.save({"t": distribute_tensor(full, mesh, [Shard(0)])}, root, 1)
        return 0
    mesh = init_device_mesh("cpu", (world,))
    state = {"t": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)])}
    storage = ReadCountingStorage(root)
    ckpt.load(state, storage, 1)
    mine = full.chunk(world)[rank]
    assert torch.equal(state["t"].to_local(), mine)
    return storage.data_bytes_read


def test_reshard_reads_a_straddling_chunk_once(tmp_path):
    root = str(tmp_path / "root")
    run_ranks(_reshard, 4, root, 4)  # rows 3, 3, 3, 1 per rank
    per_rank = run_ranks(_reshard, 2, root, 4)  # rows 5, 5: the second chunk straddles
    assert sum(per_rank) <= 1.05 * _data_bytes(root, 1), per_rank


def _flip_in_transit(rank, world, root):
    """Every rank saves steps 1 and 2; in the first load, rank 1 flips one byte of the
    first message it sends. The receiver refuses it, the walk falls back to step 1."""
    warnings.filterwarnings("ignore", message=".*assuming the intent is")
    for step in (1, 2):
        ckpt.save(_replicated(step), root, step)
    real_isend, sent = dist.isend, []

    def damaging_isend(tensor, *args, **kwargs):
        if rank == 1 and not sent and tensor.numel():
            tensor = tensor.clone()
            tensor[tensor.numel() // 2] ^= 0x10
        sent.append(tensor.numel())
        return real_isend(tensor, *args, **kwargs)

    dist.isend = damaging_isend
    fallbacks = []
    state = _zeros_like(_replicated(0))
    try:
        manifest = ckpt.load_latest(state, root,
                                    on_fallback=lambda step, why: fallbacks.append((step, why)))
    finally:
        dist.isend = real_isend
    assert sent, "nothing was sent: the load did not share its reads"
    assert manifest is not None and manifest.step == 1, manifest
    assert_same(_replicated(1), state)
    assert [s for s, _ in fallbacks] == [2], fallbacks
    assert "in transit" in fallbacks[0][1] and "rank 1" in fallbacks[0][1], fallbacks
    return True


def test_damaged_in_transit_is_refused_and_the_job_falls_back(tmp_path):
    run_ranks(_flip_in_transit, 2, str(tmp_path / "root"))



def test_plan_reads_each_location_once_and_both_sides_agree_on_every_message():
    """The coordinator's plan (no ranks needed): random holders, lengths (zero included)
    and files; every wanted location is read by exactly one rank that wants it; the loads
    are balanced; what a sender sends each receiver, run by run and batch by batch, has
    the sizes the receiver expects, in the same order."""
    import numpy as np

    from ckpt.dcp._coop import Wanted, assign, receive_layout, send_layout

    rng = np.random.default_rng(0)
    world, num = 4, 300
    files = ["a.bin", "b.bin", "c.bin"]
    offsets = {f: 0 for f in files}
    locations = []
    while len(locations) < num:
        f = files[int(rng.integers(3))]
        n = int(rng.choice([0, 3, 100, 4096, 3 << 20]))
        if (f, offsets[f], n) not in locations:  # two empty items at one offset are one
            locations.append((f, offsets[f], n))
        offsets[f] += n
    wanted, holders = [], {}
    for r in range(world):
        mine = [k for k in range(num) if rng.random() < 0.6 or k % world == r]
        rng.shuffle(mine)
        for k in mine:
            holders.setdefault(k, []).append(r)
        table = np.array([(files.index(locations[k][0]), locations[k][1], locations[k][2])
                          for k in mine], dtype=np.int64)
        wanted.append((mine, Wanted(files, table)))
    shares = assign([w for _, w in wanted])
    read_by: dict[int, list[int]] = {}
    for r, (mine, _) in enumerate(wanted):
        for i in shares[r].read.tolist():
            read_by.setdefault(mine[i], []).append(r)
    shared = {k for k, hs in holders.items() if len(hs) > 1}
    assert set(read_by) == shared and all(len(v) == 1 for v in read_by.values())
    assert all(read_by[k][0] in holders[k] for k in shared)
    lengths = [np.array([locations[k][2] for k in mine], dtype=np.int64) for mine, _ in wanted]
    load = [sum(locations[k][2] for k in shared if read_by[k] == [r]) +
            sum(locations[k][2] for k in mine if k not in shared)
            for r, (mine, _) in enumerate(wanted)]
    assert max(load) <= sum(load) / world + (3 << 20) + 1, load
    for src in range(world):
        _, _, sends = send_layout(shares[src], lengths[src])
        by_dst: dict[int, list[int]] = {}
        for batch in sorted(sends):
            for dst, _, nbytes in sends[batch]:
                by_dst.setdefault(dst, []).append(nbytes)
        for dst in range(world):
            if src not in shares[dst].recv:
                assert dst not in by_dst
                continue
            idx, slots, batches = shares[dst].recv[src]
            assert [wanted[dst][0][i] for i in idx.tolist()] == \
                [wanted[src][0][shares[src].read[s]] for s in slots.tolist()]
            runs_of, _, _ = receive_layout(lengths[dst][idx], slots, batches)
            assert [n for _, n, _, _ in runs_of] == by_dst.get(dst, [])
