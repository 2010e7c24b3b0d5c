"""Staging a sharded state: host copies of the live shards, nothing left on the device.

The dtensor section of bench/gpu_check.py, one process per rank (run under torchrun:
``python bench/_gpu_dtensor.py OUT_DIR DEVICE``; or :func:`check_rank` on ranks whose process
group exists). On a mesh over every rank it builds two models, an FSDP2-sharded MLP (fp32;
rows that do not divide evenly over 2 ranks) and a tensor-parallel one (bf16, column- then
row-wise), takes one AdamW step, and for the model's and the optimizer's state dicts
(DTensors: this rank's shards, and the plain ``step`` counters):

* **stage**: ``ckpt.dcp.staging.StagingBuffers.stage`` with ~50 ms of GPU work queued first, then
  an in-place change of every parameter on the training stream right away; after
  ``wait_ready`` every staged tensor must hold the bytes of the state *before* the change
  (the training stream waits for the copies), every staged DTensor must have the source's
  mesh, placements and global shape around a local tensor on the host (CPU), and the GPU
  memory allocated must be what it was before the stage (nothing of the staged copy on the
  device);
* **manager**: ``CheckpointManager.save(..., block=True)``: its staged copy
  (``last_staged``) likewise, and the GPU memory it holds after the commit;
* **loaded**: the checkpoint loaded back into zeroed DTensors equals the state saved, bit
  for bit.

On CPU (gloo) the same runs as a check of this harness; GPU memory is then not measured.
Each rank writes ``rank{R}.json`` into OUT_DIR: the problems found per layout and phase.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["Leaf", "host_snapshot", "compare", "held_device_bytes", "held_memory_problems",
           "check_rank", "main"]

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
MAX_PROBLEMS = 20  # named per phase


@dataclass(frozen=True)
class Leaf:
    """One tensor of a state as it was: its local bytes on the host, and for a DTensor its
    mesh, placements and global shape."""

    local: torch.Tensor
    is_dtensor: bool
    mesh: Any = None
    placements: tuple = ()
    shape: tuple = ()


def _dtensor_cls():
    from torch.distributed.tensor import DTensor

    return DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    dtensor = _dtensor_cls()
    return t.to_local() if isinstance(t, dtensor) else t


def _flat(state: Any, path: str = "") -> dict[str, Any]:
    """``{dotted path: value}`` of the tensors (and other leaves) of a nested state."""
    if isinstance(state, dict):
        out: dict[str, Any] = {}
        for k, v in state.items():
            out.update(_flat(v, f"{path}.{k}" if path else str(k)))
        return out
    if isinstance(state, (list, tuple)):
        out = {}
        for i, v in enumerate(state):
            out.update(_flat(v, f"{path}.{i}" if path else str(i)))
        return out
    return {path: state}


def host_snapshot(state: Any) -> dict[str, Leaf]:
    """Every tensor of ``state`` as a :class:`Leaf` (a host copy of its local bytes), by path.
    Synchronous: the copies are done when it returns."""
    dtensor = _dtensor_cls()
    out = {}
    for path, value in _flat(state).items():
        if not isinstance(value, torch.Tensor):
            continue
        local = _local(value).detach().to("cpu", copy=True).contiguous()
        if isinstance(value, dtensor):
            out[path] = Leaf(local, True, value.device_mesh, tuple(value.placements),
                             tuple(value.shape))
        else:
            out[path] = Leaf(local, False)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def compare(expected: dict[str, Leaf], got: Any, *, on_host: bool) -> list[str]:
    """What differs between ``expected`` (:func:`host_snapshot`) and the state ``got``: a
    tensor missing, not a DTensor where one was (or another mesh, placements or global
    shape), another local shape or dtype, other bytes; with ``on_host``, a local tensor
    that is not in host memory. Empty when they agree."""
    dtensor = _dtensor_cls()
    flat = _flat(got)
    problems = []
    for path, leaf in expected.items():
        value = flat.get(path)
        if not isinstance(value, torch.Tensor):
            problems.append(f"{path}: missing ({type(value).__name__})")
            continue
        if isinstance(value, dtensor) != leaf.is_dtensor:
            problems.append(f"{path}: {'not ' if leaf.is_dtensor else ''}a DTensor")
            continue
        if leaf.is_dtensor and (value.device_mesh != leaf.mesh
                                or tuple(value.placements) != leaf.placements
                                or tuple(value.shape) != leaf.shape):
            problems.append(f"{path}: mesh, placements or global shape differ "
                            f"({tuple(value.placements)} {tuple(value.shape)}, expected "
                            f"{leaf.placements} {leaf.shape})")
        local = _local(value)
        if on_host and local.device.type != "cpu":
            problems.append(f"{path}: staged on {local.device}, not on the host")
        if local.shape != leaf.local.shape or local.dtype != leaf.local.dtype:
            problems.append(f"{path}: local {tuple(local.shape)} {local.dtype}, expected "
                            f"{tuple(leaf.local.shape)} {leaf.local.dtype}")
            continue
        if local.device.type == "meta":
            continue  # no bytes to compare
        if not torch.equal(_bytes(local.to("cpu")), _bytes(leaf.local)):
            problems.append(f"{path}: bytes differ from the source's")
    return problems


def held_device_bytes(before: int) -> int | None:
    """GPU memory allocated now beyond ``before`` (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before


def _allocated() -> int:
    """GPU memory allocated now (the allocator's count: no synchronisation, so work queued
    stays queued)."""
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def held_memory_problems(held: int | None, staged_bytes: int) -> list[str]:
    """The staged copy lives on the host: at most 1 MiB (or 1 %) more on the device."""
    if held is None or held <= max(MiB, staged_bytes // 100):
        return []
    return [f"{held / MiB:.1f} MiB more GPU memory allocated while the staged copy "
            f"({staged_bytes / MiB:.1f} MiB) is alive: it is (partly) on the device"]


# -- the models --------------------------------------------------------------------------------
def _fsdp_model(mesh, device: torch.device) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    # 1023 and 2047 rows: shards of unequal size on 2 ranks. ~17 MiB of fp32 parameters.
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2047), torch.nn.GELU(),
                                torch.nn.Linear(2047, 1023), torch.nn.GELU(),
                                torch.nn.Linear(1023, 1024)).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Linear(1024, 4096, bias=False)
        self.w2 = torch.nn.Linear(4096, 1024, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.gelu(self.w1(x)))


def _tp_model(mesh, device: torch.device) -> torch.nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = _Mlp().to(device=device, dtype=torch.bfloat16)  # ~16 MiB of bf16 parameters
    return parallelize_module(model, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})


def _trained(model: torch.nn.Module, device: torch.device, dtype: torch.dtype):
    """One AdamW step, so the optimizer holds state (DTensors like the parameters)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 1024, device=device, generator=torch.Generator(device).manual_seed(1),
                    dtype=dtype)
    model(x).float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def _state(model, optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _busy(device: torch.device) -> None:
    """~50 ms of GPU work queued on the training stream (as the stall section's): the
    copies start after it, so a change of the parameters that did not wait for them would
    land first."""
    if device.type != "cuda":
        return
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(32):
        a.matmul(a)


# -- one rank ----------------------------------------------------------------------------------
def _check_layout(name: str, model, dtype, device, work: Path) -> dict[str, Any]:
    from ckpt.dcp import StagingBuffers
    from ckpt.job import CheckpointManager, KeepLast, ManagerOptions

    optimizer = _trained(model, device, dtype)
    state = _state(model, optimizer)
    out: dict[str, Any] = {}

    # stage, while the training stream changes every parameter right after
    before_change = host_snapshot(state)
    buffers = StagingBuffers()
    _busy(device)
    allocated = _allocated()
    staged, nbytes = buffers.stage(state)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    copy_seconds = buffers.wait_ready()
    held = held_device_bytes(allocated)
    problems = compare(before_change, staged, on_host=True) + held_memory_problems(held, nbytes)
    pinned = all(_local(v).is_pinned() for v in _flat(staged).values()
                 if isinstance(v, torch.Tensor)) if torch.cuda.is_available() else None
    out["stage"] = {"problems": problems[:MAX_PROBLEMS], "num_problems": len(problems),
                    "staged_bytes": nbytes, "held_gpu_bytes": held, "pinned": pinned,
                    "copy_seconds": copy_seconds, "num_tensors": len(before_change)}
    del staged
    buffers = None

    # a real manager's save, then the checkpoint loaded back
    state = _state(model, optimizer)  # after the change
    saved = host_snapshot(state)
    root = work / name
    manager = CheckpointManager(str(root), ManagerOptions(use_lease=False),
                                retention=[KeepLast(2)])
    try:
        allocated = _allocated()
        manager.save(1, state, block=True)
        held = held_device_bytes(allocated)
        copy = manager.last_staged
        problems = (["no staged copy"] if copy is None else compare(saved, copy.staged,
                                                                      on_host=True))
        problems += held_memory_problems(held, copy.nbytes if copy else 0)
        out["manager"] = {"problems": problems[:MAX_PROBLEMS], "num_problems": len(problems),
                          "held_gpu_bytes": held}
        target = _zeroed(state)
        manifest = manager.load_latest(target)
        problems = (["nothing loaded"] if manifest is None else
                    compare(saved, target, on_host=False))
        out["loaded"] = {"problems": problems[:MAX_PROBLEMS], "num_problems": len(problems)}
    finally:
        manager.close()
    out["ok"] = all(not out[k]["num_problems"] for k in ("stage", "manager", "loaded"))
    return out


def _zeroed(state: Any) -> Any:
    """The same structure with every tensor zeroed (DTensors stay DTensors)."""
    if isinstance(state, dict):
        return {k: _zeroed(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_zeroed(v) for v in state]
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return state


def check_rank(rank: int, world: int, device_type: str, work: str) -> dict[str, Any]:
    """Both layouts on this rank (the process group over ``world`` ranks exists)."""
    from torch.distributed.device_mesh import init_device_mesh

    device = (torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda"
              else torch.device("cpu"))
    mesh = init_device_mesh(device_type, (world,))
    out: dict[str, Any] = {"rank": rank, "world": world, "device": str(device), "layouts": {}}
    layouts = (("fsdp2", _fsdp_model, torch.float32), ("tp", _tp_model, torch.bfloat16))
    for name, build, dtype in layouts:
        try:
            out["layouts"][name] = _check_layout(name, build(mesh, device), dtype, device,
                                                 Path(work))
        except Exception as exc:  # noqa: BLE001 - reported, the other layout still runs
            out["layouts"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["ok"] = all(r["ok"] for r in out["layouts"].values())
    return out


def main(argv: list[str]) -> int:
    """Under torchrun: ``OUT_DIR DEVICE``; writes ``OUT_DIR/rank{R}.json``."""
    sys.path.insert(0, str(ROOT))
    from trainer.distributed import init_distributed

    out_dir, device_type = Path(argv[0]), argv[1]
    env = init_distributed(device_type, timeout_seconds=300)
    work = tempfile.mkdtemp(prefix="dtensor_", dir=out_dir)
    if env.distributed:  # every rank saves under rank 0's folder
        import torch.distributed as dist

        shared = [work]
        dist.broadcast_object_list(shared, src=0, group=None,
                                   device=env.device if device_type == "cuda" else None)
        work = shared[0]
    result = check_rank(env.rank, env.world_size, device_type, work)
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(result, indent=1, default=str))
    code = 0 if result["ok"] else 1
    from trainer.distributed import shutdown

    shutdown(env, code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
