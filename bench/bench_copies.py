"""Copies of the local tier on the next node: the time to resume after a node loss, and what
the copies cost each save.

    python3 bench/bench_copies.py --size-mib 256 --repeats 3

``--nodes`` processes (default 3) on loopback, joined in a gloo group, each a node of its own
with its own local root (local disk) and ``--size-mib`` MiB of float32 state of its own. The
durable root is local disk behind a bandwidth limit of ``--durable-gbps`` (default 0.25 GB/s
per node, reads and writes each: ``bench/_throttled.py``, an fsspec filesystem that
``ckpt.storage`` reaches through its generic backend, as a network store). The processes stay
up for the whole run; contenders are interleaved round by round, the order rotating.

**Resume after a node loss.** Each sample saves step 1 to both tiers, closes, wipes node 1's
local root (a replaced machine comes back empty), then times a new job's resume on every
node: ``TieredCheckpointManager(...)`` and ``load_latest``; the job's time is the slowest
node's.

* ``copies``: ``local_copies=2``: node 1's part comes back from node 2's copy (over gloo on
  loopback), then every node loads from the local tier;
* ``durable``: ``local_copies=1``: node 1 has no local step, so every node loads from the
  durable tier at ``--durable-gbps``;
* ``no loss`` (reference): ``local_copies=1``, nothing wiped (a process crash): every node
  loads its own local step.

**Cost per save.** A manager per contender saves ``--saves`` local steps (local tier only,
each waited for, copies included), with ``local_copies`` 1 and 2; per save: the stall (the
staging copy, the same for both), the local persist, the copy to the next node
(``copy_committed`` seconds: after the persist, in the background), and the CPU seconds of
the process (every thread) per save, whose difference is the copy's CPU (sending this node's
part and receiving its predecessor's).

Prints a table of medians and ratios against the same round's baseline; ``--json FILE``
writes every sample. A program, not a test: see docs/performance.md.
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

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for p in (HERE, REPO):
    if p not in sys.path:
        sys.path.insert(0, p)

RESUME = ("copies", "durable", "no loss")
COST = ("1 copy", "2 copies")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        queue.put((rank, "ok", _run(rank, world, args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)


def _run(rank: int, world: int, args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    from _common import make_state
    from _throttled import register

    from ckpt.job import LocalTierOptions, ManagerOptions, TieredCheckpointManager
    from ckpt.ranks.groups import world_group

    register(args.durable_gbps * 1e9)
    group = world_group()
    state = {f"node{rank}": make_state(args.size_mib << 20, args.tensors, seed=rank)}
    blank = {f"node{rank}": make_state(args.size_mib << 20, args.tensors, seed=100 + rank)}
    base = args.work

    def mgr(tag: str, copies: int) -> TieredCheckpointManager:
        return TieredCheckpointManager(f"throttled://{base}/{tag}/durable",
                                       f"{args.local_dir}/{tag}/local-{{node}}",
                                       ManagerOptions(busy="wait", lease_ttl_seconds=30.0),
                                       local=LocalTierOptions(node_rank=rank, copies=copies),
                                       local_cadence=None, cadence=None)

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t)

    def clear(tag: str) -> None:
        dist.barrier(group=group)
        if rank == 0:
            shutil.rmtree(f"{base}/{tag}", ignore_errors=True)
            shutil.rmtree(f"{args.local_dir}/{tag}", ignore_errors=True)
        dist.barrier(group=group)

    def resume(name: str) -> dict:
        tag = name.replace(" ", "_")
        copies = 2 if name == "copies" else 1
        with mgr(tag, copies) as m:
            m.save(1, state, block=True)
            m.wait()
        dist.barrier(group=group)
        if name != "no loss" and rank == 1:
            shutil.rmtree(f"{args.local_dir}/{tag}/local-1")  # node 1: an empty machine
        dist.barrier(group=group)
        t0 = time.perf_counter()
        m = mgr(tag, copies)
        loaded = m.load_latest(blank)
        seconds = time.perf_counter() - t0
        want = "durable" if name == "durable" else "local"
        assert loaded is not None and loaded.step == 1 and m.resumed.tier == want, \
            (name, loaded and loaded.step, m.resumed)
        fetched = [e.fields["seconds"] for e in m.events.of_kind("copy_restored")]
        m.close()
        assert _equal(state, blank), f"{name}: the state loaded differs from the one saved"
        _scramble(blank)
        clear(tag)
        return {"seconds": slowest(seconds), "fetch_seconds": slowest(sum(fetched))}

    def cost(name: str) -> dict:
        tag = name.replace(" ", "_")
        copies = 2 if name == "2 copies" else 1
        m = mgr(tag, copies)
        m.local.save(1, state, block=True)  # untimed: allocates the arena
        m.wait()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for step in range(2, 2 + args.saves):
            m.local.save(step, state)
            m.wait()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        staged = [e.fields["stall_seconds"] for e in m.events.of_kind("local_save_staged")][1:]
        persist = [e.fields["persist_seconds"]
                   for e in m.events.of_kind("local_save_committed")][1:]
        copied = [e.fields["seconds"] for e in m.events.of_kind("copy_committed")][1:]
        nbytes = [e.fields["bytes"] for e in m.events.of_kind("copy_committed")][1:]
        m.close()
        clear(tag)
        n = args.saves
        return {"stall": slowest(statistics.median(staged)),
                "persist": slowest(statistics.median(persist)),
                "copy": slowest(statistics.median(copied)) if copied else 0.0,
                "copy_bytes": statistics.median(nbytes) if nbytes else 0,
                "cpu_per_save": slowest(cpu / n), "wall_per_save": slowest(wall / n)}

    samples: dict[str, list[dict]] = {name: [] for name in RESUME + COST}
    for r in range(args.warmup + args.repeats):
        for names, run in ((RESUME, resume), (COST, cost)):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                out = run(name)
                if r >= args.warmup:
                    samples[name].append(out)
        if rank == 0:
            print(f"  round {r + 1}/{args.warmup + args.repeats}"
                  f"{' (warm-up, discarded)' if r < args.warmup else ''}", flush=True)
    return samples


def _equal(a, b) -> bool:
    import torch

    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _scramble(state) -> None:
    """Overwrite every tensor of ``state`` so that the next load must fill it again."""
    import torch

    for v in state.values():
        if isinstance(v, dict):
            _scramble(v)
        elif isinstance(v, torch.Tensor):
            v.fill_(-1.0)


def _spawn(args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_node, args=(r, args.nodes, port, args, queue))
             for r in range(args.nodes)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    while len(results) < args.nodes:
        rank, status, payload = queue.get(timeout=args.timeout)
        results[rank] = (status, payload)
    for p in procs:
        p.join(timeout=30)
    errors = [f"node {r}:\n{payload}" for r, (status, payload) in sorted(results.items())
              if status != "ok"]
    if errors:
        raise SystemExit("\n".join(errors))
    return [results[r][1] for r in range(args.nodes)]


def _med(rows: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def _ratio(a: list[dict], b: list[dict], key: str) -> float:
    return statistics.median(x[key] / y[key] for x, y in zip(a, b) if y[key] > 0)


def report(samples: dict[str, list[dict]], args: argparse.Namespace) -> str:
    mib = args.size_mib
    lines = [f"{args.nodes} nodes on loopback, {mib} MiB of state per node, local tier in "
             f"{os.path.dirname(args.local_dir)}, durable tier on {os.path.dirname(args.work)} "
             f"throttled to {args.durable_gbps:g} GB/s per node, {args.repeats} rounds "
             f"(medians; ratios: per round, then the median)", "",
             "Resume after node 1 is replaced by an empty machine (the slowest node: "
             "manager + load_latest):", "",
             "| resume from | seconds | of it, fetching node 1's part back | / durable |",
             "|---|---:|---:|---:|"]
    for name, label in (("copies", "local tier, node 1's part from node 2's copy "
                                   "(`local_copies = 2`)"),
                        ("durable", "durable tier (`local_copies = 1`)"),
                        ("no loss", "local tier, no node lost (reference: a process crash)")):
        rows = samples[name]
        fetch = _med(rows, "fetch_seconds")
        lines.append(f"| {label} | {_med(rows, 'seconds'):.2f} | "
                     f"{f'{fetch:.2f}' if fetch else '-'} | "
                     f"{_ratio(rows, samples['durable'], 'seconds'):.2f} |")
    one, two = samples["1 copy"], samples["2 copies"]
    lines += ["", f"Cost per local save ({args.saves} saves a sample, each waited for):", "",
              "| local_copies | stall | local persist | copy to the next node (background) "
              "| bytes copied | process CPU per save | wall per save |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for n, rows in ((1, one), (2, two)):
        copy = f"{_med(rows, 'copy'):.3f} s" if n == 2 else "-"
        nbytes = f"{_med(rows, 'copy_bytes') / 2**20:.0f} MiB" if n == 2 else "-"
        lines.append(f"| {n} | {_med(rows, 'stall'):.3f} s | {_med(rows, 'persist'):.3f} s | "
                     f"{copy} | {nbytes} | {_med(rows, 'cpu_per_save'):.3f} s | "
                     f"{_med(rows, 'wall_per_save'):.3f} s |")
    copy_vs_persist = statistics.median(row["copy"] / row["persist"] for row in two)
    lines += ["", f"2 copies / 1 copy, per round: stall x{_ratio(two, one, 'stall'):.2f}, "
                  f"process CPU per save x{_ratio(two, one, 'cpu_per_save'):.2f} "
                  f"(+{_med(two, 'cpu_per_save') - _med(one, 'cpu_per_save'):.3f} s); "
                  f"the copy takes x{copy_vs_persist:.2f} the local persist"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=256, help="state per node (MiB)")
    ap.add_argument("--tensors", type=int, default=64, help="tensors per node")
    ap.add_argument("--durable-gbps", type=float, default=0.25,
                    help="the durable tier's read and write bandwidth per node (GB/s)")
    ap.add_argument("--saves", type=int, default=4, help="local saves per cost sample")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--work", default=None,
                    help="folder for the durable root (default: a temp dir on disk)")
    ap.add_argument("--local-dir", default=None,
                    help="folder for the local roots (default: a temp dir in /dev/shm when "
                         "there is one, else beside the durable root)")
    ap.add_argument("--json", metavar="FILE", help="write every sample to FILE")
    args = ap.parse_args(argv)
    if args.nodes < 3:
        ap.error("--nodes must be >= 3 (node 1's copy is on node 2, and node 0 stays)")
    made = []  # temporary folders of this run, removed at the end
    if args.work is None:
        args.work = tempfile.mkdtemp(prefix="bench_copies_")
        made.append(args.work)
    if args.local_dir is None:
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        args.local_dir = tempfile.mkdtemp(prefix="bench_copies_", dir=shm or args.work)
        made.append(args.local_dir)
    try:
        samples = _spawn(args)[0]
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)
    print(report(samples, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "samples": samples}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
