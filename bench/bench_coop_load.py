"""Cooperative loads: bytes read from storage per resume, and the resume's time, when ranks
need the same bytes.

    python3 bench/bench_coop_load.py --mib 64 --repeats 3

Four processes on loopback, joined in a gloo group, load from one store: local disk behind
a bandwidth limit of ``--gbps`` (default 0.5 GB/s) that every process's reads share
(``bench/_throttled.py``, ``shared=``: the store's bandwidth, which every reader of a job
shares). Cases, each a checkpoint saved once (untimed) and loaded every round:

* ``dp=1``, ``dp=2``, ``dp=4``: a replicated state of ``--mib`` MiB (DDP's), saved and
  loaded by the first 1, 2 or 4 processes (a gloo subgroup; the others wait);
* ``HSDP 2x2``: DTensors on a (replicate 2, shard 2) mesh: each shard held by 2 replicas;
* ``4 -> 2``: DTensors sharded over 4 ranks (``Shard(0)``) loaded on 2, so saved chunks
  straddle the loading ranks' shards.

Contenders per case, interleaved round by round (the order rotating): ``coop`` (``ckpt.load``
as it is: each byte range read by one rank and sent to the others) and ``each reads``
(the same load with the sharing turned off, each rank reading every byte it needs: the
load before cooperative reads). Per sample: the bytes read from storage summed over the
ranks (``on_bytes_read``) over the checkpoint's data bytes, the seconds of the slowest
rank, and the CPU seconds of the ranks' processes (every thread), summed. Every load is checked bit for bit. Prints a table of medians and ratios (per round,
then the median); ``--json FILE`` writes every sample. A program, not a test: see
docs/performance.md ("Cooperative loads").
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for p in (HERE, REPO):
    if p not in sys.path:
        sys.path.insert(0, p)

WORLD = 4
CASES = ("dp=1", "dp=2", "dp=4", "HSDP 2x2", "4 -> 2")
CONTENDERS = ("coop", "each reads")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD)
        queue.put((rank, "ok", _run(rank, args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)


@contextmanager
def _each_reads():
    """Loads inside read every byte each rank needs themselves: the reader is given no
    group to share reads over (the load as it was before cooperative reads)."""
    from ckpt.dcp import reader

    real = reader.CkptReader.__init__

    def alone(self, *a, **kw):
        kw["group"] = None
        real(self, *a, **kw)

    reader.CkptReader.__init__ = alone
    try:
        yield
    finally:
        reader.CkptReader.__init__ = real


def _run(rank: int, args: argparse.Namespace) -> dict:
    import warnings

    import torch
    import torch.distributed as dist
    from _common import make_state
    from _throttled import register
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import ckpt
    from ckpt.root import CheckpointStore

    warnings.filterwarnings("ignore")
    register(args.gbps * 1e9, shared=os.path.join(args.work, "bucket"))
    world = dist.new_group(backend="gloo")
    subgroups = {k: dist.new_group(list(range(k)), backend="gloo") for k in (1, 2)}
    groups = {"dp=1": subgroups[1], "dp=2": subgroups[2], "dp=4": world, "HSDP 2x2": world,
              "4 -> 2": subgroups[2]}
    members = {"dp=1": 1, "dp=2": 2, "dp=4": 4, "HSDP 2x2": 4, "4 -> 2": 2}
    hsdp = DeviceMesh("cpu", torch.arange(WORLD).reshape(2, 2),
                      mesh_dim_names=("replicate", "shard"))
    fsdp4 = DeviceMesh("cpu", list(range(WORLD)))
    fsdp2 = DeviceMesh("cpu", [0, 1])
    full = make_state(args.mib << 20, args.tensors, seed=1)
    blank_full = make_state(args.mib << 20, args.tensors, seed=2)

    def sharded(state, mesh, placements):
        return {"model": {k: distribute_tensor(v, mesh, placements)
                          for k, v in state["model"].items()}, "extra": dict(state["extra"])}

    def saved_and_blank(case):
        if case.startswith("dp="):
            return full, blank_full
        if case == "HSDP 2x2":
            p = [Replicate(), Shard(0)]
            return sharded(full, hsdp, p), sharded(blank_full, hsdp, p)
        return None, sharded(blank_full, fsdp2, [Shard(0)]) if rank < 2 else None

    roots, data_bytes = {}, {}
    for case in CASES:
        roots[case] = f"throttled://{args.work}/{case.replace(' ', '_').replace('>', '')}"
        if case == "4 -> 2":
            ckpt.save(sharded(full, fsdp4, [Shard(0)]), roots[case], 1, process_group=world)
        elif rank < members[case]:
            ckpt.save(saved_and_blank(case)[0], roots[case], 1, process_group=groups[case])
        dist.barrier(group=world)
        m = CheckpointStore(roots[case]).read_manifest(1)
        data_bytes[case] = sum(r.size for n, r in m.files.items() if n.endswith(".bin"))
    expected = {case: saved_and_blank(case)[0] for case in CASES}
    expected["4 -> 2"] = sharded(full, fsdp2, [Shard(0)]) if rank < 2 else None
    blanks = {case: saved_and_blank(case)[1] for case in CASES}  # loaded into, every round

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    def scramble(state):
        for v in state["model"].values():
            local(v).fill_(-1.0)

    def check(case, state):
        want = expected[case]
        for k, v in want["model"].items():
            assert torch.equal(local(v), local(state["model"][k])), f"{case}: {k} differs"
        assert state["extra"] == want["extra"], case

    def one(case: str, contender: str) -> dict:
        nbytes = [0]
        state = blanks[case] if rank < members[case] else None
        if state is not None:
            scramble(state)
        dist.barrier(group=world)
        t0, cpu0 = time.perf_counter(), time.process_time()
        if state is not None:

            def count(n: int) -> None:
                nbytes[0] += n

            if contender == "coop":
                ckpt.load(state, roots[case], 1, process_group=groups[case],
                          on_bytes_read=count)
            else:
                with _each_reads():
                    ckpt.load(state, roots[case], 1, process_group=groups[case],
                              on_bytes_read=count)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            check(case, state)
        else:
            seconds = cpu = 0.0
        t = torch.tensor([seconds, float(nbytes[0]), cpu], dtype=torch.float64)
        dist.all_reduce(t[:1], op=dist.ReduceOp.MAX, group=world)
        dist.all_reduce(t[1:], op=dist.ReduceOp.SUM, group=world)
        per_rank = torch.zeros(WORLD, dtype=torch.float64)
        per_rank[rank] = float(nbytes[0])
        dist.all_reduce(per_rank, op=dist.ReduceOp.SUM, group=world)
        return {"seconds": float(t[0]), "cpu_seconds": float(t[2]),
                "read_ratio": float(t[1]) / data_bytes[case],
                "max_rank_share": float(per_rank.max()) * members[case] / data_bytes[case]}

    samples = {f"{case} / {c}": [] for case in CASES for c in CONTENDERS}
    names = [(case, c) for case in CASES for c in CONTENDERS]
    for r in range(args.warmup + args.repeats):
        k = r % len(names)
        for case, c in names[k:] + names[:k]:
            out = one(case, c)
            if r >= args.warmup:
                samples[f"{case} / {c}"].append(out)
        if rank == 0:
            print(f"  round {r + 1}/{args.warmup + args.repeats}"
                  f"{' (warm-up, discarded)' if r < args.warmup else ''}", flush=True)
    return {"samples": samples, "data_bytes": data_bytes}


def _spawn(args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, args, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    try:
        while len(results) < WORLD:
            rank, status, payload = queue.get(timeout=args.timeout)
            results[rank] = (status, payload)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [f"rank {r}:\n{payload}" for r, (status, payload) in sorted(results.items())
              if status != "ok"]
    if errors:
        raise SystemExit("\n".join(errors))
    return results[0][1]


def _med(rows: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def _ratio(a: list[dict], b: list[dict], key: str) -> float:
    return statistics.median(x[key] / y[key] for x, y in zip(a, b) if y[key] > 0)


def report(out: dict, args: argparse.Namespace) -> str:
    s = out["samples"]
    lines = [f"{WORLD} processes on loopback (gloo), a store of local disk throttled to "
             f"{args.gbps:g} GB/s shared by every reader, {args.mib} MiB of state in "
             f"{args.tensors} tensors, {args.repeats} rounds (medians; ratios per round, "
             f"then the median)", "",
             "| case | contender | bytes read / checkpoint bytes | busiest rank / its share "
             "| seconds (slowest rank) | / coop | CPU seconds (all ranks) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for case in CASES:
        coop = s[f"{case} / coop"]
        for c in CONTENDERS:
            rows = s[f"{case} / {c}"]
            lines.append(f"| {case} | {c} | {_med(rows, 'read_ratio'):.3f} | "
                         f"{_med(rows, 'max_rank_share'):.2f} | {_med(rows, 'seconds'):.3f} | "
                         f"{_ratio(rows, coop, 'seconds'):.2f} | "
                         f"{_med(rows, 'cpu_seconds'):.3f} |")
    four, one_ = s["dp=4 / coop"], s["dp=1 / coop"]
    before4 = s["dp=4 / each reads"]
    lines += ["", f"dp=4 / dp=1 resume time, replicated, per round: coop "
                  f"x{_ratio(four, one_, 'seconds'):.2f}, each rank reading "
                  f"x{_ratio(before4, one_, 'seconds'):.2f}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="state size (MiB)")
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--gbps", type=float, default=0.5,
                    help="the store's read bandwidth, shared by every reader (GB/s)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--work", default=None, help="folder for the roots (default: a temp dir)")
    ap.add_argument("--json", metavar="FILE", help="write every sample to FILE")
    args = ap.parse_args(argv)
    made = args.work is None
    if made:
        args.work = tempfile.mkdtemp(prefix="bench_coop_load_")
    try:
        out = _spawn(args)
    finally:
        if made:
            shutil.rmtree(args.work, ignore_errors=True)
    print(report(out, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
