"""The low-precision dtypes round-trip bit for bit; a dtype the format lacks is refused early.

float8 (``e4m3fnuz``, ``e5m2fnuz``, ``e8m0fnu``) and the packed ``float4_e2m1fn_x2`` are
raw bytes to the format: saved, loaded (also resharded), staged by a manager, exported and
compared by ``ckpt diff``, every bit pattern kept (NaN encodings included). torch converts
nothing to float4 and has no ``equal`` for it, so every comparison here is of
``.view(torch.uint8)``. A dtype the format does not hold is refused while the ranks plan,
before the attempt's marker or any data file exists, naming the key and the dtype.
"""

from __future__ import annotations

import os

import pytest
import torch

import ckpt
from ckpt.job import CheckpointManager, KeepLast, ManagerOptions
from tests.dist import run_ranks

NEW_DTYPES = [getattr(torch, name) for name in
              ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2")]
IDS = [str(d).removeprefix("torch.") for d in NEW_DTYPES]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes_of(a), _bytes_of(b))


def _state(dtype: torch.dtype, seed: int = 0, scalar: bool = True) -> dict[str, torch.Tensor]:
    """Every byte value in a matrix, an empty tensor and a scalar of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    every = torch.randperm(256, generator=g).to(torch.uint8).view(16, 16)
    state = {"w": every.view(dtype), "empty": torch.empty(0, 3, dtype=dtype),
             "other": torch.arange(5, dtype=torch.float32)}
    if scalar:
        state["scalar"] = torch.tensor(0x3C, dtype=torch.uint8).view(dtype)
    return state


def _blank(t: torch.Tensor) -> torch.Tensor:
    """A zeroed tensor like ``t`` to load into (torch cannot fill an empty float4 one)."""
    return torch.zeros_like(t) if t.numel() else torch.empty_like(t)


def _files_under(path: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path)
                  for d, _, files in os.walk(path) for f in files)


@pytest.mark.parametrize("dtype", NEW_DTYPES, ids=IDS)
def test_save_load_bit_for_bit(tmp_path, dtype):
    root = str(tmp_path / "root")
    saved = _state(dtype)
    manifest = ckpt.save(saved, root, 1)
    assert manifest.tensors["w"]["dtype"] == str(dtype).removeprefix("torch.")
    loaded = {k: _blank(v) for k, v in saved.items()}
    ckpt.load(loaded, root, 1)
    for key, value in saved.items():
        assert _same(loaded[key], value), key
    ckpt.CheckpointStore(root).verify(1)  # every checksum


@pytest.mark.parametrize("dtype", NEW_DTYPES, ids=IDS)
def test_manager_stages_and_exports(tmp_path, dtype):
    """Through a manager (its staging copy), then out to .pt and .safetensors; ``ckpt
    diff`` of two steps that differ in a packed or float8 tensor."""
    from safetensors.torch import load_file

    from ckpt.cli._inspection import diff, select
    from ckpt.export import export
    from ckpt.export._consolidate import consolidate

    root = str(tmp_path / "root")
    # No scalar: safetensors has no shape for a 0-dimensional float4 (test below).
    first, second = _state(dtype, seed=0, scalar=False), _state(dtype, seed=1, scalar=False)
    with CheckpointManager(root, ManagerOptions(use_lease=False), retention=[KeepLast(5)]) as mgr:
        mgr.save(1, first, block=True)
        mgr.save(2, second, block=True)
    flat, _ = consolidate(root, 2, nested=False)
    for key, value in second.items():
        assert _same(flat[key], value), key
    export(root, 2, str(tmp_path / "w.pt"))
    exported = torch.load(tmp_path / "w.pt", weights_only=True)
    export(root, 2, str(tmp_path / "w.safetensors"), dtype="bf16")
    cast = load_file(str(tmp_path / "w.safetensors"))
    assert _same(exported["w"], second["w"])
    if dtype == torch.float4_e2m1fn_x2:  # nothing converts float4: exported as it is
        assert _same(cast["w"], second["w"])
    else:
        assert _same(cast["w"], second["w"].to(torch.bfloat16))  # NaNs too: by bytes
    store = ckpt.CheckpointStore(root)
    rows = {r["key"]: r for r in diff(store, select(store, 1), select(store, 2))["tensors"]}
    assert rows["w"]["status"] == "changed" and rows["other"]["status"] == "identical"
    assert ("max_abs_diff" in rows["w"]) == (dtype != torch.float4_e2m1fn_x2)


def test_float4_scalar_export_to_safetensors_is_refused(tmp_path):
    from ckpt.export import export

    root = str(tmp_path / "root")
    ckpt.save(_state(torch.float4_e2m1fn_x2), root, 1)
    with pytest.raises(ValueError, match="'scalar'"):
        export(root, 1, str(tmp_path / "w.safetensors"))
    assert not (tmp_path / "w.safetensors").exists()
    export(root, 1, str(tmp_path / "w.pt"))  # .pt holds it
    assert _same(torch.load(tmp_path / "w.pt", weights_only=True)["scalar"],
                 _state(torch.float4_e2m1fn_x2)["scalar"])


def _save_sharded_load_whole(rank: int, world: int, root: str) -> None:
    """2 ranks save row halves of each new dtype as DTensors; each rank then loads the
    whole tensors and gets every byte back."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    full = {IDS[i]: _state(d, seed=i)["w"] for i, d in enumerate(NEW_DTYPES)}
    ckpt.save({k: DTensor.from_local(v.chunk(world)[rank].clone(), mesh, [Shard(0)],
                                     run_check=False) for k, v in full.items()}, root, 1)
    whole = {k: _blank(v) for k, v in full.items()}
    ckpt.load(whole, root, 1, process_group=None)
    for key, value in full.items():
        assert _same(whole[key], value), f"rank {rank}: {key}"


def test_sharded_save_reshards(tmp_path):
    run_ranks(_save_sharded_load_whole, 2, str(tmp_path / "root"), timeout=120)


@pytest.mark.parametrize("dtype", [torch.complex32, torch.uint4], ids=["complex32", "uint4"])
def test_unsupported_dtype_refused_before_any_write(tmp_path, dtype):
    root = str(tmp_path / "root")
    state = {"fine": torch.ones(1000), "nested": {"odd": torch.zeros(8, dtype=torch.uint8)
                                                  .view(dtype)}}
    with pytest.raises(ValueError) as info:
        ckpt.save(state, root, 7)
    message = str(info.value)
    assert "'nested.odd'" in message and str(dtype) in message, message
    assert "float8_e8m0fnu" in message  # the supported ones are listed
    # Nothing of step 7 was written: no marker, no data file (only the lease's files).
    assert not [f for f in _files_under(root) if f.startswith("step_")], _files_under(root)
    assert ckpt.CheckpointStore(root).steps() == []


def _one_rank_holds_unsupported(rank: int, world: int, root: str) -> str:
    state = {"w": torch.ones(4), f"rank{rank}": torch.zeros(2, dtype=torch.uint8)}
    if rank == 1:
        state["rank1"] = state["rank1"].view(torch.uint4)
    try:
        ckpt.save(state, root, 3)
    except ValueError as exc:
        return str(exc)
    return "saved"


def test_unsupported_dtype_on_one_rank_fails_every_rank_before_writing(tmp_path):
    root = str(tmp_path / "root")
    messages = run_ranks(_one_rank_holds_unsupported, 2, root, timeout=120)
    assert all("'rank1' (torch.uint4)" in m for m in messages), messages
    assert not [f for f in _files_under(root) if f.startswith("step_")], _files_under(root)
