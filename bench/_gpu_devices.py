"""A rank's save touches no GPU but its own: no CUDA context, no memory on GPU 0.

The devices section of bench/gpu_check.py, one process per rank under torchrun, every GPU
visible to every rank (``python bench/_gpu_devices.py OUT_DIR DEVICE SCENARIO``). Each rank
selects its GPU (``torch.cuda.set_device(LOCAL_RANK)``, as the trainer does), starts a gloo
group, builds a state of a few tensors on its GPU and a ``CheckpointManager`` (every two
steps), and saves at step 2:

* scenario ``maybe_save``: no ``prepare()``: the first ``maybe_save`` allocates and
  page-locks the staging buffers on the manager's persist thread (a library user who never
  calls ``prepare``, a standby group that becomes the writer mid-run);
* scenario ``prepare``: ``prepare()`` on the main thread first (the trainer's order);
* scenario ``writer_process``: as ``maybe_save`` with ``ManagerOptions(writer="process")``:
  the shared staging block is page-locked on the persist thread and the copies are waited
  for there before the hand-off; the writer process itself must see no GPU
  (``CUDA_VISIBLE_DEVICES`` empty in its environment) and NVML must list no memory of its
  pid on any GPU.

After each phase (``start``, ``prepared``: the buffers exist, ``saved``: the save committed
and the persist thread waited for the copies, ``closed``: the buffers unlocked) it records,
for every GPU other than its own, whether its process holds a CUDA context there
(``torch._C._cuda_hasPrimaryContext``, asked of the driver inside the process) and the GPU
memory NVML lists for its pid there (``torch.cuda.list_gpu_processes``; not measured where
NVML does not list this process on its own GPU, e.g. in a container whose pids NVML does
not see, or without pynvml). Either one on another GPU is a problem: with 8 ranks, 7 extra
contexts of a few hundred MB each on GPU 0.

On CPU (gloo, ``DEVICE`` cpu) the same save runs as a check of this harness; there is no
device to measure. Each rank writes ``rank{R}.json`` into OUT_DIR.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["SCENARIOS", "PHASES", "process_memory_mb", "foreign_device_problems",
           "check_rank", "main"]

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("maybe_save", "prepare", "writer_process")
PHASES = ("start", "prepared", "saved", "closed")
_NVML_LINE = re.compile(r"process\s+(\d+)\s+uses\s+([0-9.]+)\s+MB GPU memory")


def process_memory_mb(listing: str, pid: int) -> float | None:
    """The GPU memory ``torch.cuda.list_gpu_processes`` lists for ``pid`` (0.0: not listed);
    None when the listing is not NVML's (no pynvml, no driver)."""
    if not listing.startswith("GPU:"):
        return None
    return sum(float(mb) for p, mb in _NVML_LINE.findall(listing) if int(p) == pid)


def _snapshot(own: int) -> dict[str, Any]:
    """This process on every GPU: a CUDA context (bool) and NVML's memory for its pid (MB;
    None when NVML does not see this process on its own GPU, so it cannot tell)."""
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    out: dict[str, Any] = {"context": {}, "memory_mb": {}}
    pid = os.getpid()
    for index in range(torch.cuda.device_count()):
        out["context"][index] = bool(has_context(index)) if has_context else None
        try:
            out["memory_mb"][index] = process_memory_mb(torch.cuda.list_gpu_processes(index),
                                                        pid)
        except Exception:  # noqa: BLE001 - NVML missing or refusing: not measured
            out["memory_mb"][index] = None
    if not out["memory_mb"].get(own):  # NVML does not list this process where it runs
        out["memory_mb"] = {i: None for i in out["memory_mb"]}
    return out


def foreign_device_problems(own: int, phases: dict[str, dict[str, Any]]) -> list[str]:
    """What a rank on GPU ``own`` left on other GPUs, per phase (``_snapshot``s): a CUDA
    context, or memory NVML lists for it. Empty: nothing."""
    problems = []
    for phase, snap in phases.items():
        for index, held in snap["context"].items():
            if int(index) != own and held:
                problems.append(f"after {phase}: a CUDA context of this process on GPU "
                                f"{index}")
        for index, mb in snap["memory_mb"].items():
            if int(index) != own and mb:
                problems.append(f"after {phase}: {mb:.0f} MB of GPU {index} used by this "
                                f"process")
    return problems


def _writer_problems(pid: int | None, cuda: bool) -> list[str]:
    """What the writer process ``pid`` holds of a GPU: a visible GPU in its environment, or
    memory NVML lists for its pid on any GPU (measured on CUDA only)."""
    if pid is None:
        return ["no writer process is running"]
    problems = []
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    if env.get(b"CUDA_VISIBLE_DEVICES") != b"":
        problems.append(f"the writer process {pid} sees GPUs (CUDA_VISIBLE_DEVICES="
                        f"{env.get(b'CUDA_VISIBLE_DEVICES')!r})")
    for index in range(torch.cuda.device_count() if cuda else 0):
        try:
            mb = process_memory_mb(torch.cuda.list_gpu_processes(index), pid)
        except Exception:  # noqa: BLE001 - NVML missing or refusing: not measured
            mb = None
        if mb:
            problems.append(f"{mb:.0f} MB of GPU {index} used by the writer process {pid}")
    return problems


def _state(device: torch.device) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(0)
    model = {f"layers.{i}.weight": torch.randn(1024, 1024, device=device, generator=g)
             for i in range(8)}  # 32 MiB
    return {"model": model, "extra": {"step": 2}}


def check_rank(local_rank: int, device_type: str, scenario: str, root: str) -> dict[str, Any]:
    """One rank's save in ``scenario`` (the default group exists; the rank's GPU selected)."""
    from ckpt.job import CheckpointManager, ManagerOptions

    cuda = device_type == "cuda"
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    phases: dict[str, dict[str, Any]] = {}

    def phase(name: str) -> None:
        if cuda:
            torch.cuda.synchronize(device)
            phases[name] = _snapshot(local_rank)

    state = _state(device)
    phase("start")
    writer = "process" if scenario == "writer_process" else "thread"
    mgr = CheckpointManager(root, ManagerOptions(use_lease=False, writer=writer), cadence="2")
    committed = False
    writer_problems: list[str] = []
    try:
        if scenario == "prepare":
            mgr.prepare(state)
        mgr.maybe_save(1, state)  # not due: without prepare() it starts one in the background
        deadline = time.monotonic() + 60
        while mgr.staging.arena_bytes == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        phase("prepared")
        mgr.maybe_save(2, state)
        mgr.wait()
        committed = bool(mgr.events.of_kind("save_committed"))
        phase("saved")
        if writer == "process":
            writer_problems = _writer_problems(getattr(mgr._persister, "pid", None), cuda)
    finally:
        mgr.close()
    phase("closed")
    problems = foreign_device_problems(local_rank, phases) + writer_problems
    if not committed:
        problems.append("the save at step 2 did not commit")
    return {"rank": local_rank, "device": str(device), "scenario": scenario,
            "phases": phases, "problems": problems, "ok": not problems}


def main(argv: list[str]) -> int:
    """Under torchrun: ``OUT_DIR DEVICE SCENARIO``; writes ``OUT_DIR/rank{R}.json``."""
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist

    from ckpt.ranks import init_distributed

    out_dir, device_type, scenario = Path(argv[0]), argv[1], argv[2]
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)  # before anything else, as the trainer
    init_distributed("gloo", timeout_seconds=300)
    try:
        result = check_rank(local_rank, device_type, scenario, str(out_dir / "ckpt"))
    except Exception as exc:  # noqa: BLE001 - reported in the rank's file
        result = {"rank": local_rank, "scenario": scenario, "ok": False,
                  "problems": [f"{type(exc).__name__}: {exc}"[:2000]]}
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1))
    code = 0 if result["ok"] else 1
    try:
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        os._exit(code)  # a gloo thread releasing a tensor at exit can abort the process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
