"""A loading rank of an unchanged layout reads the root, its own part and the parts its refs
name: nothing else of the checkpoint's metadata (four real gloo ranks).

The state mixes an HSDP-like tensor (replicated over one mesh axis, sharded over the other:
DCP writes each shard once, from one of the ranks that hold it, so the others' parts refer
to the writer's), a tensor sharded over both axes, a replicated plain tensor, per-rank
tensors and an object. Each rank saves (in the cached case after a first save of other
values with the same plan cache, so the second save reuses the cached plan and its refs),
then loads into a zeroed state of the same layout
through a storage that records every file it reads. Afterwards one process with no group
(another layout: resharding) consolidates the checkpoint from every part.
"""

from __future__ import annotations

import io

import pytest
import torch

from ckpt.format import jsonio, step_dirname
from tests.dist import run_ranks

pytestmark = pytest.mark.timeout(300)

STEP = 3


def _state(rank: int, mesh, seed: int) -> dict:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    g = torch.Generator().manual_seed(seed)
    hsdp = torch.randn(8, 4, generator=g)  # the same on every rank: a replica of a model
    both = torch.randn(4, 6, generator=g)
    plain = torch.randn(3, generator=g)
    shard = mesh.get_local_rank("shard")
    rep = mesh.get_local_rank("replicate")
    h = DTensor.from_local(hsdp.chunk(2, 0)[shard].clone(), mesh, [Replicate(), Shard(0)],
                           run_check=False)
    b = DTensor.from_local(both.chunk(2, 0)[rep].chunk(2, 1)[shard].clone(), mesh,
                           [Shard(0), Shard(1)], run_check=False)
    return {"model": {"h": h, "b": b, "p": plain},
            f"rank{rank}": torch.full((2,), float(rank + seed)), "step": seed}


def _zeroed(state: dict) -> dict:
    def zero(v):
        if isinstance(v, torch.Tensor):
            return v.detach().clone().zero_() if not hasattr(v, "to_local") else \
                type(v).from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements,
                                   run_check=False, shape=v.shape, stride=v.stride())
        if isinstance(v, dict):
            return {k: zero(x) for k, x in v.items()}
        return 0
    return zero(state)


def _body(rank: int, world: int, root: str, cached: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import ckpt
    from ckpt.dcp import SavePlanCache, SaveRequest
    from ckpt.dcp.api import save_with
    from ckpt.dcp.api import resolve_state
    from tests.ckpt._helpers import assert_same, snapshot
    from tests.ckpt._parts import RecordingStorage

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    saved = _state(rank, mesh, seed=7)
    cache = SavePlanCache() if cached else None
    if cached:
        save_with(resolve_state(_state(rank, mesh, seed=5)), RecordingStorage(root), STEP - 1,
                  SaveRequest(save_plan_cache=cache))
    save_with(resolve_state(saved), RecordingStorage(root), STEP,
              SaveRequest(save_plan_cache=cache))
    if cached:
        assert (cache.num_full_plans, cache.num_cached_plans, cache.num_replans) == (1, 1, 0)
    dist.barrier()
    storage = RecordingStorage(root)
    state = _zeroed(saved)
    ckpt.load(state, storage, STEP)
    assert_same(snapshot(saved), snapshot(state))
    full = {k: v.full_tensor() for k, v in saved["model"].items() if hasattr(v, "full_tensor")}
    blob = None
    if rank == 0:
        buf = io.BytesIO()
        torch.save({**full, "p": saved["model"]["p"]}, buf)
        blob = buf.getvalue()
    folder = step_dirname(STEP) + "/"
    return {"reads": sorted({rel[len(folder):] for rel in storage.reads
                             if rel.startswith(folder) and rel.endswith(".json")}),
            "full": blob}


@pytest.mark.parametrize("cached", [False, True], ids=["planned", "cached-plan"])
def test_a_loading_rank_reads_only_its_part_and_the_parts_its_refs_name(tmp_path, cached):
    import ckpt
    from ckpt.export._consolidate import consolidate

    root = str(tmp_path / "root")
    results = run_ranks(_body, 4, root, cached, timeout=240)
    folder = tmp_path / "root" / step_dirname(STEP)
    parts = {}
    for path in folder.glob("part-*.json"):
        doc = jsonio.loads(path.read_bytes(), path.name)
        parts[doc["rank"]] = (path.name, doc)
    assert sorted(parts) == [0, 1, 2, 3]
    by_rank = {rank: name for rank, (name, _) in parts.items()}
    num_refs = 0
    for rank, result in enumerate(results):
        name, doc = parts[rank]
        writers = {writer for refs in doc["refs"].values() for _, writer in refs}
        num_refs += sum(len(refs) for refs in doc["refs"].values())
        expected = sorted({"manifest.json", name, *(by_rank[w] for w in writers)})
        assert result["reads"] == expected, (rank, result["reads"], expected)
        assert len(result["reads"]) < 1 + len(parts), "a rank read every part"
    # DCP wrote each HSDP shard once: the ranks that did not write theirs refer to it.
    assert num_refs > 0
    # One process, no group (another layout): every part, and exactly the saved values.
    manifest = ckpt.CheckpointStore(root).read_manifest(STEP, complete=True)
    assert len(manifest.tensors["model.h"]["chunks"]) == 2  # written once each
    assert len(manifest.tensors["model.b"]["chunks"]) == 4
    flat, _ = consolidate(root, STEP, nested=False)
    full = torch.load(io.BytesIO(results[0]["full"]), weights_only=True)
    for key, value in full.items():
        assert torch.equal(flat[f"model.{key}"], value), key
    for rank in range(4):
        assert torch.equal(flat[f"rank{rank}"], torch.full((2,), float(rank + 7)))
