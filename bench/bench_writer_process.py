"""What a save takes from the training process: the persist thread against the writer process.

Each sample is one real 2-rank job (gloo, DDP over an MLP with Adam: ``--hidden``, ``--layers``;
a ``CheckpointManager`` saving every ``--every`` steps into a fresh root), run as two
processes of this program, in one of three variants, interleaved round by round: ``never``
(no manager saves), ``thread`` (``writer="thread"``, the default) and ``process``
(``writer="process"``). Rank 0 reports, over the window from step ``--warmup`` to the last:

- the step time (window / steps), and the overhead against ``never`` of the same round;
- the stall's share of the window (the staging copies, ``save_staged``);
- the training process's CPU per save: its background CPU (``save_cost``'s
  ``background_cpu_seconds``: the persist thread and, in thread mode, its writer and
  checksum threads; the stall's copy is not in it) and, as a cross-check, the whole
  process's CPU over the window minus ``never``'s, per save (stall included);
- the writer process's CPU per save (``writer_process_cpu_seconds``; process mode).

Then, for each of ``thread`` and ``process``, one job saves ``--rss-saves`` times (a save
every step, each waited for) and reads the training process's resident memory (and the
writer process's, in process mode) after every save; a ``never`` job takes the same steps
without a manager. Reported: the median of saves 11-20 against the median of the last 10
(flat is +<= 1%), the growth per 100 saves of a least-squares line through the readings
from save 31 on (after the warm-up the training loop shows without a manager too), and the
range of the training process's readings from save 11 on: the training loop alone swings by
several percent from one step to the next (its gradients and activations freed and
allocated again), so one reading at each end would measure that swing, not a growth.

    python bench/bench_writer_process.py --rounds 5
    python bench/bench_writer_process.py --rounds 4 --baseline /tmp/base  # before/after

``--baseline DIR``: a checkout of an earlier version of this project (``git worktree add
/tmp/base <commit>``); its process mode runs from there as a fourth variant,
``baseline``, in every round, and the training CPU per save of process mode is also
reported against it (the median of per-round ratios). Its resident memory is not measured.

Noise on a shared 2-core machine is large: the medians of per-round ratios are reported.
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
sys.path.insert(0, REPO)

VARIANTS = ("never", "thread", "process")


def _rss_kib(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _writer_pids(mgr) -> list[int]:
    """The manager's writer process, in process mode (its ``WriterProcess.pid``)."""
    pid = getattr(mgr._persister, "pid", None)
    return [] if pid is None else [pid]


def worker(args) -> None:
    """One rank of one job (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT`` set)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ckpt.dcp import ModelState
    from ckpt.events import EventBus
    from ckpt.job import CheckpointManager, KeepLast, ManagerOptions

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU()]
    model = DistributedDataParallel(torch.nn.Sequential(*layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = {"app": ModelState(model.module, opt), "extra": {"data_position": 0}}
    x = torch.randn(args.batch, args.hidden)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    bus = EventBus(rank=rank)
    events: list = []
    bus.subscribe(events.append)
    out: dict = {}
    if args.variant in ("never", "thread", "process") and not args.rss:
        mgr = None if args.variant == "never" else CheckpointManager(
            args.root, ManagerOptions(writer=args.variant), cadence=str(args.every),
            retention=[KeepLast(2)], events=bus)
        times = []
        cpu0 = None
        for i in range(args.steps):
            step()
            if i == args.warmup:
                cpu0, t0 = time.process_time(), time.monotonic()
            state["extra"]["data_position"] = i
            if mgr is not None:
                mgr.maybe_save(i, state)
            times.append(time.monotonic())
        cpu = time.process_time() - cpu0
        window = times[-1] - t0
        if mgr is not None:
            mgr.wait(raise_errors=False)
            mgr.close()
        first = args.warmup
        stalls = [e.fields.get("stall_seconds", 0.0) for e in events
                  if e.kind == "save_staged" and e.step is not None and e.step > first]
        costs = [e.fields for e in events if e.kind == "save_cost" and e.step is not None
                 and e.step > first]
        out = {"window": window, "steps": args.steps - 1 - first, "cpu": cpu,
               "saves": len(stalls), "stall": sum(stalls),
               "background_cpu": sum(c["background_cpu_seconds"] for c in costs),
               "writer_cpu": sum(c.get("writer_process_cpu_seconds", 0.0) for c in costs),
               "costs": len(costs),
               "failed": sum(e.kind == "save_failed" for e in events)}
    else:  # resident memory over many saves (never: the same steps without a manager)
        mgr = None if args.variant == "never" else CheckpointManager(
            args.root, ManagerOptions(writer=args.variant), retention=[KeepLast(2)], events=bus)
        rss = {"trainer_kib": [], "writer_kib": []}
        for i in range(1, args.rss_saves + 1):
            step()
            if mgr is not None:
                mgr.save(i, state)
                mgr.wait()
            rss["trainer_kib"].append(_rss_kib())
            rss["writer_kib"].append(sum(_rss_kib(p) for p in _writer_pids(mgr))
                                     if mgr is not None else 0)
        if mgr is not None:
            mgr.close()
        out = {"rss": rss, "state_bytes": sum(
            t.numel() * t.element_size() for t in model.module.state_dict().values()) * 3}
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _job(variant: str, opts, work: str, *, rss: bool = False) -> dict:
    """One 2-rank job of ``variant`` (``baseline``: process mode from ``--baseline``)."""
    from tests.dist import free_port

    repo = os.path.abspath(opts.baseline) if variant == "baseline" else REPO
    run_dir = tempfile.mkdtemp(prefix=f"writer-{variant}-", dir=work)
    out = os.path.join(run_dir, "out.json")
    port = str(free_port())
    cmd = [sys.executable, os.path.join(repo, "bench", os.path.basename(__file__)), "--worker",
           "--variant", "process" if variant == "baseline" else variant,
           "--root", os.path.join(run_dir, "ckpt"), "--out", out,
           "--steps", str(opts.steps), "--warmup", str(opts.warmup),
           "--every", str(opts.every), "--hidden", str(opts.hidden),
           "--layers", str(opts.layers), "--batch", str(opts.batch),
           "--rss-saves", str(opts.rss_saves)] + (["--rss"] if rss else [])
    procs = [subprocess.Popen(cmd, cwd=repo, env=dict(
        os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
        OMP_NUM_THREADS="1", PYTHONPATH=repo)) for r in range(2)]
    codes = [p.wait(timeout=opts.timeout) for p in procs]
    if any(codes):
        raise RuntimeError(f"{variant}: ranks exited {codes}")
    with open(out) as f:
        result = json.load(f)
    subprocess.run(["rm", "-rf", run_dir], check=False)
    return result


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=121)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rss-saves", type=int, default=100)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--baseline", help="a checkout of an earlier version: its process mode "
                                      "as a fourth variant (before/after in one run)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rss", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.rss_saves < 20:
        p.error(f"--rss-saves {opts.rss_saves}: at least 20 (saves 11-20 are the reference)")
    if opts.worker:
        worker(opts)
        return
    if opts.baseline and not os.path.exists(os.path.join(opts.baseline, "bench",
                                                         os.path.basename(__file__))):
        p.error(f"--baseline {opts.baseline}: no bench/{os.path.basename(__file__)} there; "
                f"give a checkout of this project (git worktree add DIR <commit>)")
    variants = VARIANTS + (("baseline",) if opts.baseline else ())
    columns = variants[1:]
    work = tempfile.mkdtemp(prefix="bench-writer-")
    rounds = []
    for r in range(opts.rounds):
        k = r % len(variants)
        res = {v: _job(v, opts, work) for v in variants[k:] + variants[:k]}
        rounds.append(res)
        print(f"round {r + 1}: " + ", ".join(
            f"{v} {res[v]['window'] / res[v]['steps'] * 1e3:.1f} ms/step, "
            f"{res[v]['background_cpu'] / max(1, res[v]['costs']) * 1e3:.2f} ms CPU/save"
            for v in variants), flush=True)
    rows = {}
    for v in columns:
        per = []
        for res in rounds:
            a, n = res[v], res["never"]
            saves = max(1, a["saves"])
            per.append({
                "overhead": a["window"] / n["window"] - 1,
                "stall_share": a["stall"] / a["window"],
                "background_cpu_ms": a["background_cpu"] / max(1, a["costs"]) * 1e3,
                "process_cpu_delta_ms": (a["cpu"] - n["cpu"]) / saves * 1e3,
                "writer_cpu_ms": a["writer_cpu"] / max(1, a["costs"]) * 1e3,
                "saves": a["saves"], "failed": a["failed"]})
        rows[v] = {k: _median([x[k] for x in per]) for k in per[0]}
    rss = {v: _job(v, opts, work, rss=True) for v in VARIANTS}
    print(f"\n2 ranks, MLP {opts.layers}x{opts.hidden} + AdamW, a save every {opts.every} steps, "
          f"{opts.steps - 1 - opts.warmup} steps measured, {opts.rounds} rounds (medians)")
    print(f"{'':28}" + "".join(f"{v:>12}" for v in columns))
    for key, label, scale, unit in (
            ("overhead", "step-time overhead", 100, "%"),
            ("stall_share", "stall share", 100, "%"),
            ("background_cpu_ms", "training CPU/save (bg)", 1, " ms"),
            ("process_cpu_delta_ms", "process CPU/save vs never", 1, " ms"),
            ("writer_cpu_ms", "writer process CPU/save", 1, " ms")):
        cells = [rows[v][key] for v in columns]
        print(f"{label:28}" + "".join(f"{c * scale:>10.2f}{unit:<2}" if c is not None
                                      else f"{'-':>12}" for c in cells))
    if opts.baseline:
        ratios = [(res["process"]["background_cpu"] / max(1, res["process"]["costs"]))
                  / (res["baseline"]["background_cpu"] / max(1, res["baseline"]["costs"]))
                  for res in rounds]
        print(f"training CPU/save, process / baseline: {_median(ratios):.2f} (rounds: "
              + ", ".join(f"{x:.2f}" for x in ratios) + ")")
    for v in VARIANTS:
        r = rss[v]["rss"]
        total = [a + b for a, b in zip(r["trainer_kib"], r["writer_kib"])]
        early, late = _median(total[10:20]), _median(total[-10:])
        swing = (max(r["trainer_kib"][10:]) - min(r["trainer_kib"][10:])) >> 10
        tail = total[30:]
        slope = statistics.linear_regression(range(len(tail)), tail).slope if \
            len(tail) > 1 else 0.0
        print(f"RSS {v:8} saves 11-20 / last 10 (medians): trainer "
              f"{_median(r['trainer_kib'][10:20]) / 1024:.0f} / "
              f"{_median(r['trainer_kib'][-10:]) / 1024:.0f} MiB (swing {swing} MiB), writer "
              f"{_median(r['writer_kib'][10:20]) / 1024:.0f} / "
              f"{_median(r['writer_kib'][-10:]) / 1024:.0f} MiB: {(late / early - 1) * 100:+.2f}%;"
              f" from save 31 on {slope * 100 / statistics.mean(tail) * 100:+.2f}% per 100 saves")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"rounds": rounds, "medians": rows, "rss": rss, "options": vars(opts)},
                      f, indent=1)
    subprocess.run(["rm", "-rf", work], check=False)


if __name__ == "__main__":
    main()
