"""A saving process for tests/ckpt/dcp/test_staging_budget.py: peak resident memory of saves.

Run as ``python -m tests.ckpt.dcp._budget_child ROOT BUDGET`` (BUDGET in bytes, or ``none``).
It saves a small state once (to ``ROOT-warm-up``: code imported and threads started by a
first save), builds a 64 MiB state of CPU tensors and a ``CheckpointManager`` with that staging
budget, takes its resident memory (VmRSS) as the baseline and resets the peak (``echo 5 >
/proc/self/clear_refs``), saves three steps (each ``save`` then ``wait``), and prints one
JSON line: ``peak_growth`` (VmHWM - baseline), ``committed_on_return`` (whether every
``save`` returned with its step committed), ``arena_bytes``, ``unstaged_bytes`` and
``peak_reset`` (False where the peak could not be reset: it then includes start-up).
"""

from __future__ import annotations

import gc
import json
import sys
import warnings

import torch

STATE_BYTES = 64 << 20
NUM_TENSORS = 16


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = STATE_BYTES // 4 // NUM_TENSORS
    return {"model": {f"w{i}": torch.randn(n, generator=g) for i in range(NUM_TENSORS)},
            "step": seed}


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * 1024
    return out


def main(root: str, budget: str) -> None:
    from ckpt.job import CheckpointManager, KeepLast, ManagerOptions

    warnings.filterwarnings("ignore")
    live = state(1)
    # A small save first, to another root: code a first save imports and the threads it
    # starts are not what the budget bounds.
    warm = CheckpointManager(root + "-warm-up", ManagerOptions(use_lease=False),
                             retention=[KeepLast(1)])
    warm.save(1, {"w": torch.ones(1024)})
    warm.wait()
    warm.close()
    limit = None if budget == "none" else int(budget)
    mgr = CheckpointManager(root, ManagerOptions(use_lease=False, staging_budget_bytes=limit),
                            retention=[KeepLast(1)])
    gc.collect()
    base = _status()["VmRSS"]
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    committed = True
    for step in (1, 2, 3):
        live["step"] = step
        mgr.save(step, live)
        committed = committed and mgr.latest_step() == step
        mgr.wait()
    out = {"peak_growth": _status()["VmHWM"] - base, "committed_on_return": committed,
           "arena_bytes": mgr.staging.arena_bytes, "unstaged_bytes": mgr.staging.unstaged_bytes,
           "peak_reset": reset}
    mgr.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
