"""Cost of the replica check: the CRC32C of every plain tensor in the save planner's local plan.

    python bench/bench_replica_check.py --size 0.25 --repeats 5

Before a save, every rank checksums its plain (non-DTensor) tensors so that the coordinator
can refuse a key whose "replicas" differ (ckpt/dcp/planners.py, ``SafeSavePlanner``). This times,
interleaved round by round in one process, on a state of ``--size`` GiB of plain float32
tensors (the worst case: a fully replicated model, nothing sharded):

* ``plan+check``: ``SafeSavePlanner`` local plan (DCP's plan plus the checksums);
* ``plan``: DCP's ``DefaultSavePlanner`` local plan (no checksums);
* ``save``: a whole ``ckpt.save`` of the same state to local disk (fsync'd), for scale.

and prints the check's seconds (``plan+check - plan``), its throughput, and its share of the
save. A program, not a test: see docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for p in (HERE, REPO):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
from _common import (  # noqa: E402
    Contender,
    GiB,
    fmt_bytes,
    interleave,
    make_state,
    median,
    paired_ratio,
    rmtree,
    state_nbytes,
)
from torch.distributed.checkpoint import DefaultSavePlanner  # noqa: E402

import ckpt  # noqa: E402
from ckpt.dcp.planners import SafeSavePlanner  # noqa: E402


def _plan_seconds(planner_cls, state) -> float:
    planner = planner_cls()
    t0 = time.perf_counter()
    planner.set_up_planner(state, None, True)
    planner.create_local_plan()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=float, default=0.25, help="state size in GiB")
    p.add_argument("--tensors", type=int, default=64, help="tensors the state is split into")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    p.add_argument("--dir", default=None, help="scratch folder for the saves")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    state = make_state(int(args.size * GiB), args.tensors)
    nbytes = state_nbytes(state)
    work = tempfile.mkdtemp(prefix="bench-replica-", dir=args.dir)
    step = [0]

    def save() -> float:
        step[0] += 1
        t0 = time.perf_counter()
        ckpt.save(state, work, step[0])
        return time.perf_counter() - t0

    contenders = [Contender("plan+check", lambda: _plan_seconds(SafeSavePlanner, state)),
                  Contender("plan", lambda: _plan_seconds(DefaultSavePlanner, state)),
                  Contender("save", save, after=lambda: rmtree(os.path.join(
                      work, f"step_{step[0]:09d}")))]
    print(f"state: {fmt_bytes(nbytes)} in {len(state['model'])} plain float32 tensors; "
          f"{args.repeats} interleaved rounds")
    try:
        samples = interleave(contenders, args.repeats)
    finally:
        rmtree(work)
    check = [a - b if a is not None and b is not None else None
             for a, b in zip(samples["plan+check"], samples["plan"])]
    check_s, save_s = median(check), median(samples["save"])
    share = paired_ratio(check, samples["save"])
    print()
    print("| what | median seconds |")
    print("|---|---|")
    for name in ("plan+check", "plan", "save"):
        print(f"| {name} | {median(samples[name]):.4f} |")
    print(f"| replica check (plan+check - plan) | {check_s:.4f} |")
    print()
    print(f"replica check: {nbytes / max(check_s, 1e-9) / GiB:.2f} GiB/s, "
          f"{100 * share:.1f}% of a save to local disk ({save_s:.3f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
