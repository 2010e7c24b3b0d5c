"""Storage requests per save: what the fixed steps of a save cost, on a local root and on S3.

    python bench/bench_requests.py                  # local root and moto S3, 10 saves each
    python bench/bench_requests.py --saves 20 --only local --show-log

One process, one rank: a ``CheckpointManager`` (default retention: keep the last 3 plus
the pinned ones) saves a tiny state at steps 1..N, each save waited for. Every storage call
of the manager goes through a counting ``Storage`` (``bench/_requests.py``); on S3 each
HTTP request is counted too (botocore's ``before-send`` event). Steady state: the saves
after the first ``keep_last + 1``, when every save also deletes the oldest checkpoint.
Printed: requests per steady-state save by kind (medians), and apart the data files written
and, where files are deleted one by one (not S3), those deleted (their number follows the
bytes: a few files here). The lease's heartbeat thread is kept quiet
(a long TTL) so every request counted is one a save made. A program, not a test (the test
that holds the count down is ``tests/ckpt/job/test_commit_requests.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for p in (HERE, REPO):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
from _requests import DATA_KINDS, KINDS, CountingStorage, S3RequestLog  # noqa: E402

from ckpt.job import CheckpointManager, KeepLast, KeepPinned, ManagerOptions  # noqa: E402
from ckpt.root import CheckpointStore  # noqa: E402


def _state() -> dict:
    return {"model": {"w": torch.randn(64, 64), "b": torch.zeros(64)}, "step": 0}


def measure(storage: CountingStorage, saves: int, keep_last: int, http: S3RequestLog | None
            ) -> dict:
    """Save steps 1..``saves`` through one manager; per save: counts by kind (and HTTP
    requests by method on S3), wall seconds, and the call log."""
    state = _state()
    rows = []
    store = CheckpointStore(storage)
    with CheckpointManager(storage, ManagerOptions(busy="wait", lease_ttl_seconds=3600.0),
                           retention=[KeepLast(keep_last), KeepPinned(store)]) as mgr:
        for step in range(1, saves + 1):
            state["step"] = step
            state["model"]["w"].add_(1.0)
            snap, h0, t0 = storage.snapshot(), len(http) if http else 0, time.monotonic()
            mgr.save(step, state, block=True)
            seconds = time.monotonic() - t0
            counts, log = storage.since(snap)
            rows.append({"step": step, "counts": dict(counts), "seconds": seconds,
                         "http": dict(http.since(h0)) if http else None, "log": log})
        failed = mgr.events.of_kind("save_failed") + mgr.events.of_kind("retention_failed")
        if failed:
            raise RuntimeError(f"saves failed: {[e.fields for e in failed]}")
    return {"rows": rows, "steady": [r for r in rows if r["step"] > keep_last + 1]}


def summarise(name: str, res: dict) -> dict:
    steady = res["steady"]
    med = {k: statistics.median(r["counts"].get(k, 0) for r in steady) for k in KINDS}
    fixed = [sum(v for k, v in r["counts"].items() if k not in DATA_KINDS) for r in steady]
    out = {"root": name, "saves": len(steady), "by_kind": med,
           "requests_per_save": statistics.median(fixed),
           "data_files_per_save": med["data"], "data_deletes_per_save": med["data_delete"],
           "seconds_per_save": statistics.median(r["seconds"] for r in steady)}
    if steady and steady[0]["http"] is not None:
        out["http_per_save"] = statistics.median(
            sum(v for m, v in r["http"].items() if m != "data") for r in steady)
        methods = sorted({m for r in steady for m in r["http"]})
        out["http_by_method"] = {m: statistics.median(r["http"].get(m, 0) for r in steady)
                                 for m in methods}
    return out


def table(summaries: list[dict]) -> str:
    kinds = [k for k in KINDS if k not in DATA_KINDS and any(s["by_kind"][k] for s in summaries)]
    lines = ["| root | storage calls per save (data files apart) | "
             + " | ".join(kinds) + " | data files written, deleted one by one "
             "| HTTP requests per save, data files apart (S3) | s per save |",
             "|---|---:|" + "---:|" * len(kinds) + "---:|---|---:|"]
    for s in summaries:
        http = "" if "http_per_save" not in s else (
            f"{s['http_per_save']:g} (" + ", ".join(f"{m} {v:g}" for m, v in
                                                   s["http_by_method"].items()) + ")")
        lines.append(f"| {s['root']} | {s['requests_per_save']:g} | "
                     + " | ".join(f"{s['by_kind'][k]:g}" for k in kinds)
                     + f" | {s['data_files_per_save']:g}, {s['data_deletes_per_save']:g} | {http} | "
                     f"{s['seconds_per_save']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_requests.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--saves", type=int, default=10, help="saves per root")
    p.add_argument("--keep-last", type=int, default=3, help="retention: KeepLast(k)")
    p.add_argument("--only", default="local,s3", help="roots to measure: local,s3")
    p.add_argument("--show-log", action="store_true",
                   help="print the calls of the last steady-state save, in order")
    p.add_argument("--json", default=None, help="write the summaries (and logs) here")
    opts = p.parse_args(argv)
    if opts.saves < opts.keep_last + 2:
        p.error(f"--saves must be at least --keep-last + 2 ({opts.keep_last + 2}) to reach "
                f"the steady state")
    torch.set_num_threads(1)
    only = {x.strip() for x in opts.only.split(",") if x.strip()}
    results, summaries = {}, []
    work = tempfile.mkdtemp(prefix="bench-requests-")
    try:
        if "local" in only:
            storage = CountingStorage(os.path.join(work, "root"))
            results["local"] = measure(storage, opts.saves, opts.keep_last, None)
            summaries.append(summarise("local", results["local"]))
        if "s3" in only:
            from _s3 import BUCKET, MotoServer

            server = MotoServer()
            try:
                storage = CountingStorage(f"s3://{BUCKET}/req-{uuid.uuid4().hex[:8]}",
                                          server.storage_options)
                results["s3"] = measure(storage, opts.saves, opts.keep_last,
                                        S3RequestLog(storage))
                summaries.append(summarise("s3 (moto)", results["s3"]))
            finally:
                server.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"Storage requests per steady-state save (median of {summaries[0]['saves']} saves; "
          f"one rank, KeepLast({opts.keep_last}) + KeepPinned):\n")
    print(table(summaries))
    if opts.show_log:
        for name, res in results.items():
            print(f"\n{name}, step {res['steady'][-1]['step']}:")
            for kind, rel in res["steady"][-1]["log"]:
                print(f"  {kind:7s} {rel}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"summaries": summaries,
                       "logs": {k: [r["log"] for r in v["rows"]] for k, v in results.items()}},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
