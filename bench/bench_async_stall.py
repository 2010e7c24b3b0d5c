"""Why does ``dcp.async_save`` stall 1.0x the copy in one set-up and ~6x in another?

The stall of ``dcp.async_save`` is the copy of the state into CPU memory that it allocates
on every save (DCP's default stager, no caching). Whether that memory has to be faulted in
again each time decides the result: when the allocator hands back pages that a previous
save already touched, the stall is a plain copy; when it maps fresh memory, every 4 KiB
page costs a fault (about as much as copying it again several times here).

This program measures, for each set-up in its own fresh process (so that no allocator
state is inherited), one interleaved series per round: the copy floor (into preallocated,
already-touched buffers), ``CheckpointManager.save()`` returning, and ``dcp.async_save``
returning; plus the minor page faults taken inside each call (``getrusage``). The set-ups
change one factor at a time from the independent measurement's (equal tensors, no
non-tensor values, no cache flushing) towards ``bench_ckpt.py``'s (varied shapes, a few
non-tensor values, CPU caches flushed before every sample, other contenders' allocations
between two async saves).

    python3 bench/bench_async_stall.py --size-gib 0.25 --rounds 5
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

SETUPS = {
    # name: (shapes, non-tensor values, flush caches, churn between saves)
    "independent: equal tensors, tensors only, no flush": ("equal", False, False, False),
    "+ non-tensor values": ("equal", True, False, False),
    "+ cache flush before each sample": ("equal", False, True, False),
    "+ varied shapes": ("varied", False, False, False),
    "+ other contenders' allocations between saves": ("equal", False, False, True),
    "bench_ckpt.py: varied, values, flush, churn": ("varied", True, True, True),
    "bench_ckpt.py's set-up, one DefaultStager reused by every async_save": (
        "varied", True, True, True, "reuse"),
    "independent, one DefaultStager reused by every async_save": (
        "equal", False, False, False, "reuse"),
}


def _state(total: int, shapes: str, values: bool):
    import torch
    from _common import make_state

    if shapes == "varied":
        state = make_state(total, 64)
        if not values:
            del state["extra"]
        return state
    n = total // 4 // 64
    model = {f"layers.{i}.weight": torch.randn(n) for i in range(64)}
    return {"model": model, **({"extra": {"step": 1, "lr": 3e-4}} if values else {})}


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def child(args) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    from _common import scrub_cpu_caches, tensors_of

    from ckpt.job import CheckpointManager, KeepLast

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    shapes, values, flush, churn, *stager = SETUPS[args.setup]
    reused = None
    if stager:
        # One stager for the job, passed to every async_save: its StateDictStager keeps the
        # CPU copy of each storage (keyed by the source storage) between saves.
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        reused = DefaultStager(StagingOptions(False, False, False, False))
    total = int(args.size_gib * (1 << 30))
    state = _state(total, shapes, values)
    src = tensors_of(state)
    work = tempfile.mkdtemp(dir=args.dir)
    mgr = CheckpointManager(os.path.join(work, "ours"), retention=[KeepLast(1)])
    mgr.save(0, state)
    mgr.wait()
    dst = list(mgr.staging._buffers.values())  # private: the floor's target
    out: dict[str, list] = {}
    step = [0]

    def floor():
        t0 = _now()
        for d, s in zip(dst, src):
            d.copy_(s)
        return _now() - t0

    def ours():
        step[0] += 1
        t0 = _now()
        mgr.save(step[0], state)
        t = _now() - t0
        mgr.wait()
        return t

    def dcp_async():
        step[0] += 1
        writer = dcp.FileSystemWriter(os.path.join(work, f"dcp{step[0]}"), sync_files=True)
        t0 = _now()
        fut = dcp.async_save(state, storage_writer=writer, no_dist=True,
                             **({"async_stager": reused} if reused is not None else {}))
        t = _now() - t0
        fut.result()
        return t

    def churn_allocations():
        # What other contenders do between two async saves in bench_ckpt.py: torch.save's
        # buffers, dcp.save's, the readers' scratch.
        junk = [torch.empty(t.numel() + 1024, dtype=t.dtype).fill_(1) for t in src[::3]]
        del junk

    contenders = [("floor", floor), ("ours", ours), ("dcp_async", dcp_async)]
    for r in range(args.rounds):
        k = r % len(contenders)
        for name, fn in contenders[k:] + contenders[:k]:
            gc.collect()
            if churn:
                churn_allocations()
            if flush:
                scrub_cpu_caches()
            f0 = _faults()
            t = fn()
            out.setdefault(name, []).append(t)
            out.setdefault(name + "_faults", []).append(_faults() - f0)
    mgr.close()
    return out


def _now() -> float:
    import time

    return time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=0.25)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="scratch folder (default: the temp folder)")
    ap.add_argument("--setup", help=argparse.SUPPRESS)
    ap.add_argument("--out", help="write the samples as JSON")
    ap.add_argument("--only", default="", help="comma-separated set-up numbers (1-based)")
    args = ap.parse_args()
    if args.setup:
        print(json.dumps(child(args)))
        return
    import statistics

    results = {}
    print(f"{args.size_gib} GiB in 64 float32 tensors, {args.rounds} interleaved rounds "
          f"(round 1 = first save of each contender), torch threads 1, a fresh process per "
          f"set-up\n")
    print("| set-up | dcp.async_save / floor, round 1 | later rounds (median) | "
          "ours / floor, later | page faults per async_save, round 1 / later (MiB of 4 KiB "
          "pages) |")
    print("|---|---:|---:|---:|---:|")
    chosen = [int(x) for x in args.only.split(",") if x] or range(1, len(SETUPS) + 1)
    for setup in [list(SETUPS)[i - 1] for i in chosen]:
        proc = subprocess.run([sys.executable, __file__, "--setup", setup,
                               f"--size-gib={args.size_gib}", f"--rounds={args.rounds}",
                               *(["--dir", args.dir] if args.dir else [])],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode:
            print(f"| {setup} | failed: {proc.stderr[-300:]!r} |")
            continue
        s = json.loads(proc.stdout.strip().splitlines()[-1])
        results[setup] = s
        ratio = [a / f for a, f in zip(s["dcp_async"], s["floor"])]
        ours = [a / f for a, f in zip(s["ours"], s["floor"])]
        fl = s["dcp_async_faults"]
        mib = lambda n: n * 4096 / (1 << 20)  # noqa: E731
        print(f"| {setup} | {ratio[0]:.2f}x | {statistics.median(ratio[1:]):.2f}x | "
              f"{statistics.median(ours[1:]):.2f}x | {mib(fl[0]):.0f} / "
              f"{mib(statistics.median(fl[1:])):.0f} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
