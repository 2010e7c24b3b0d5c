"""Host memory under a staging budget: peak resident memory and stall of a manager's saves.

    python3 bench/bench_staging_budget.py --mib 256 --repeats 3

Each sample is a fresh process: it builds a state of ``--mib`` MiB of CPU float32 tensors
(``bench/_common.py``'s model-like shapes), a ``CheckpointManager`` on local disk with
``staging_budget_bytes`` set to a fraction of the state (``--fractions``, ``none``: no
budget), takes its resident memory as the baseline and resets the peak (``/proc/self/
clear_refs``), then saves ``--saves`` steps, each ``save`` then ``wait``. Per sample: the
peak growth (VmHWM - baseline), the stall (the median time ``save`` took to return: with a
budget smaller than the state the save blocks until it is committed) and the whole save
(``save`` + ``wait``). Contenders run one after the other in each round, the order
rotating; the table gives medians, the peak growth over the budget and the stall over the
unbudgeted stall of the same round. A program, not a test: see docs/performance.md
("Host memory under a budget").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * 1024
    return out


def worker(mib: int, tensors: int, budget: int | None, saves: int, work: str) -> dict:
    import gc
    import warnings

    import torch
    from _common import make_state, state_nbytes

    from ckpt.job import CheckpointManager, KeepLast, ManagerOptions

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    state = make_state(mib << 20, tensors)
    mgr = CheckpointManager(os.path.join(work, "root"),
                            ManagerOptions(use_lease=False, staging_budget_bytes=budget),
                            retention=[KeepLast(1)])
    gc.collect()
    base = _status()["VmRSS"]
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    stalls, totals = [], []
    for step in range(1, saves + 1):
        state["extra"]["step"] = step
        t0 = time.perf_counter()
        mgr.save(step, state)
        t1 = time.perf_counter()
        mgr.wait()
        stalls.append(t1 - t0)
        totals.append(time.perf_counter() - t0)
    out = {"state_bytes": state_nbytes(state), "peak_growth": _status()["VmHWM"] - base,
           "peak_reset": reset, "stall": statistics.median(stalls[1:] or stalls),
           "save": statistics.median(totals[1:] or totals),
           "arena_bytes": mgr.staging.arena_bytes}
    mgr.close()
    return out


def _sample(args: argparse.Namespace, fraction: str) -> dict:
    budget = None if fraction == "none" else int(float(fraction) * (args.mib << 20))
    with tempfile.TemporaryDirectory(prefix="bench_budget_", dir=args.dir) as work:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "worker", str(args.mib),
             str(args.tensors), "none" if budget is None else str(budget), str(args.saves),
             work], capture_output=True, text=True, timeout=args.timeout,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, REPO]), OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["budget"] = budget
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="state size (MiB)")
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--fractions", default="none,0.5,0.25",
                    help="budgets as fractions of the state ('none': no budget)")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--dir", default=None, help="work folder (default: a temp dir)")
    ap.add_argument("--json", metavar="FILE", help="write every sample to FILE")
    args = ap.parse_args(argv)
    fractions = [f.strip() for f in args.fractions.split(",") if f.strip()]
    samples: dict[str, list[dict]] = {f: [] for f in fractions}
    for r in range(args.repeats):
        k = r % len(fractions)
        for f in fractions[k:] + fractions[:k]:
            samples[f].append(_sample(args, f))
        print(f"  round {r + 1}/{args.repeats}", flush=True)
    if not all(s["peak_reset"] for rows in samples.values() for s in rows):
        print("note: the peak could not be reset here; peaks include start-up")
    print(f"\n{args.mib} MiB of CPU state in {args.tensors} tensors, local disk, {args.saves} "
          f"saves per sample, {args.repeats} rounds (medians; stall ratio per round against "
          f"no budget, then the median)\n")
    print("| budget | arena | peak RSS growth | growth / budget | stall (save returns) "
          "| save + wait | stall / no budget |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = samples.get("none")
    for f in fractions:
        rows = samples[f]
        growth = statistics.median(s["peak_growth"] for s in rows)
        budget = rows[0]["budget"]
        stall = statistics.median(s["stall"] for s in rows)
        ratio = (statistics.median(a["stall"] / b["stall"] for a, b in zip(rows, base))
                 if base else float("nan"))
        label = "none" if budget is None else f"{float(f):.0%} ({budget / 2**20:.0f} MiB)"
        print(f"| {label} | {statistics.median(s['arena_bytes'] for s in rows) / 2**20:.0f} MiB"
              f" | {growth / 2**20:.1f} MiB | "
              f"{'-' if budget is None else f'{growth / budget:.2f}'} | {stall:.3f} s | "
              f"{statistics.median(s['save'] for s in rows):.3f} s | {ratio:.2f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "samples": samples}, fh, indent=1)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "worker":
        sys.path[:0] = [HERE, REPO]
        print(json.dumps(worker(int(sys.argv[2]), int(sys.argv[3]),
                                None if sys.argv[4] == "none" else int(sys.argv[4]),
                                int(sys.argv[5]), sys.argv[6])), flush=True)
        sys.exit(0)
    sys.exit(main())
