"""Benchmark the checkpoint store against torch.save, DCP and the machine's own limits.

    python bench/bench_ckpt.py --sizes 0.25,1,4 --repeats 5 --out results.json
    python bench/bench_ckpt.py --quick          # < 1 min smoke run

Sections (``--only``): ``local`` (stall, persist, first save, loads on local disk), ``s3``
(moto on loopback), ``train`` (step-time overhead in the real trainer under torchrun) and
``rss`` (peak and steady memory, each in a fresh process). Contenders are interleaved round
by round and every ratio is a median of per-round ratios, because these machines are noisy.
Prints the machine, Markdown tables and PASS/MISS per target; ``--out`` writes every sample
as JSON. A program, not a test: see docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for p in (HERE, REPO):
    if p not in sys.path:
        sys.path.insert(0, p)

from _common import GiB, fmt_bytes, machine_info, make_state, mem_available, rmtree  # noqa: E402
from _report import Report, local_section, rss_section, s3_section, train_section  # noqa: E402

SECTIONS = ("local", "s3", "train", "rss")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_ckpt.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", type=_floats, default=_floats("0.25,1,4"),
                   help="state sizes in GiB, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds per size")
    p.add_argument("--warmup", type=int, default=1,
                   help="discarded warm-up rounds before each interleaved measurement")
    p.add_argument("--tensors", type=int, default=64, help="tensors the state is split into")
    p.add_argument("--only", default=",".join(SECTIONS), help="sections to run: "
                   + ",".join(SECTIONS))
    p.add_argument("--out", default=None, help="write all samples and results as JSON here")
    p.add_argument("--dir", default=None, help="scratch folder (default: a new temp folder; "
                   "it must be on the disk you want to measure)")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few repeats: a "
                   "< 1 min smoke run of every section")
    p.add_argument("--render", metavar="JSON", default=None,
                   help="measure nothing: print the tables of an earlier --out file again")
    p.add_argument("--profile", action="store_true",
                   help="also break one save/load of the first size down per function")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads in the bench processes (0: torch's default). "
                   "1 by default: on a busy 2-core machine a 2-thread copy_ waits for a "
                   "descheduled OpenMP worker and takes 10-50x longer, for every contender "
                   "alike; torchrun also runs the trainer with OMP_NUM_THREADS=1")
    g = p.add_argument_group("local")
    g.add_argument("--threads", type=int, default=4, help="ours: writer/reader threads")
    g.add_argument("--dcp-threads", type=_ints, default=_ints("1,2,4"),
                   help="dcp.save FileSystemWriter thread counts to try (best is reported)")
    g.add_argument("--dcp-async-threads", type=int, default=4)
    g.add_argument("--cache", default="cold,warm",
                   help="page-cache states for loads (cold needs /proc/sys/vm/drop_caches)")
    g = p.add_argument_group("s3")
    g.add_argument("--s3-sizes", type=_floats, default=None,
                   help="GiB; default: the --sizes up to 1 GiB (moto is slow and in memory)")
    g.add_argument("--s3-repeats", type=int, default=None, help="default: --repeats")
    g.add_argument("--s3-dcp-threads", type=_ints, default=_ints("4"),
                   help="dcp.save FsspecWriter thread counts (4 is the 2x target's baseline; "
                   "1 takes ~14 s a round at 1 GiB)")
    g.add_argument("--s3-raw-threads", type=int, default=16)
    g.add_argument("--s3-ours-threads", type=_ints, default=_ints("4"),
                   help="also time ckpt.save with these num_threads (files per rank)")
    g = p.add_argument_group("train")
    g.add_argument("--train-config", default="configs/tiny.toml")
    g.add_argument("--train-args", default="",
                   help="extra trainer overrides, e.g. '--model.dim=256 --model.n_layers=4'")
    g.add_argument("--train-steps", type=int, default=500)
    g.add_argument("--train-warmup", type=int, default=20, help="steps excluded at the start")
    g.add_argument("--train-every", type=int, default=20, help="the every-k-steps variant")
    g.add_argument("--train-ranks", type=int, default=2)
    g.add_argument("--train-repeats", type=int, default=5)
    g.add_argument("--train-timeout", type=float, default=600)
    g = p.add_argument_group("rss")
    g.add_argument("--rss-sizes", type=_floats, default=None,
                   help="GiB; default: the largest of --sizes up to 1 GiB")
    g.add_argument("--rss-saves", type=int, default=20)
    g.add_argument("--rss-modes",
                   default="ours,ours_load,dcp_load,dcp_save,dcp_async,torch_save")
    g.add_argument("--rss-timeout", type=float, default=1800)
    a = p.parse_args(argv)
    if a.quick:
        a.sizes = [1 / 32]
        a.repeats = min(a.repeats, 2)
        a.tensors = min(a.tensors, 16)
        a.train_every, a.train_repeats = 10, 1
        a.rss_saves = min(a.rss_saves, 5)
        a.rss_modes = "ours,ours_load"
        a.train_steps, a.train_warmup, a.train_ranks = 40, 10, 1
        a.warmup = 0
        a.s3_dcp_threads, a.s3_ours_threads = [4], []
        a.dcp_threads = [1, 4]
    a.only = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = set(a.only) - set(SECTIONS)
    if bad:
        p.error(f"--only: unknown section(s) {sorted(bad)}; choose from {SECTIONS}")
    if a.s3_sizes is None:
        a.s3_sizes = [s for s in a.sizes if s <= 1] or [min(a.sizes)]
    if a.rss_sizes is None:
        a.rss_sizes = [max([s for s in a.sizes if s <= 1] or [min(a.sizes)])]
    a.s3_repeats = a.s3_repeats or a.repeats
    a.cache_modes = [m.strip() for m in a.cache.split(",") if m.strip()]
    a.train_args = shlex.split(a.train_args)
    a.rss_modes = [m.strip() for m in a.rss_modes.split(",") if m.strip()]
    if a.repeats < 1 or a.tensors < 1:
        p.error("--repeats and --tensors must be >= 1")
    return a


_T0 = time.monotonic()


def _log(msg: str) -> None:
    stamp = f"[{time.monotonic() - _T0:6.1f}s] " if msg.startswith("==") else ""
    print(stamp + msg, file=sys.stderr, flush=True)


def _label(size_gib: float, tensors: int) -> str:
    return f"{fmt_bytes(size_gib * GiB)} in {tensors} tensors"


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.render:
        with open(opts.render) as f:
            results = json.load(f)
        rep = Report()
        _render(rep, results, argparse.Namespace(**results["options"]))
        print(rep.text())
        return 0
    import _common

    _common.WARMUP_ROUNDS = max(0, opts.warmup)
    if opts.torch_threads > 0:
        import torch

        torch.set_num_threads(opts.torch_threads)
        os.environ["BENCH_TORCH_THREADS"] = str(opts.torch_threads)
    work = tempfile.mkdtemp(prefix="ckpt-bench-", dir=opts.dir)
    info = machine_info(work)
    results: dict = {"machine": info, "options": {k: v for k, v in vars(opts).items()},
                     "local": {}, "s3": {}, "train": None, "rss": {}, "profile": None}
    rep = Report()
    t_start = time.monotonic()
    _log(f"scratch folder {work}; sections {opts.only}")
    try:
        for size in opts.sizes if "local" in opts.only else []:
            nbytes = int(size * GiB)
            need = 3 * nbytes
            if mem_available() and need > 0.9 * mem_available():
                _log(f"! {fmt_bytes(nbytes)} needs ~{fmt_bytes(need)} of memory, "
                     f"{fmt_bytes(mem_available())} available: expect swapping or OOM")
            free = shutil.disk_usage(work).free
            if 6 * nbytes > free:
                _log(f"! {fmt_bytes(nbytes)} needs ~{fmt_bytes(6 * nbytes)} of disk in {work}, "
                     f"{fmt_bytes(free)} free")
            _log(f"== local, {_label(size, opts.tensors)}")
            state = make_state(nbytes, opts.tensors)
            from _local import run_local

            results["local"][str(size)] = run_local(state, work, opts.repeats, opts, _log)
            if opts.profile and results["profile"] is None:
                results["profile"] = _profile(state, work, opts)
            del state
        if "s3" in opts.only and opts.s3_sizes:
            from _s3 import MotoServer, run_s3

            server = None
            try:
                server = MotoServer()
                for size in opts.s3_sizes:
                    _log(f"== s3, {_label(size, opts.tensors)}")
                    state = make_state(int(size * GiB), opts.tensors)
                    try:
                        results["s3"][str(size)] = run_s3(state, opts.s3_repeats, opts, _log,
                                                          server)
                    except Exception as exc:  # noqa: BLE001
                        _log(f"! s3 failed: {exc}\n{traceback.format_exc()}")
                        results["s3"][str(size)] = {"error": str(exc)}
                    del state
            except Exception as exc:  # noqa: BLE001
                _log(f"! s3 server failed: {exc}")
                results["s3"]["error"] = str(exc)
            finally:
                if server is not None:
                    server.close()
        if "train" in opts.only:
            from _train import run_train

            _log("== train")
            try:
                results["train"] = run_train(opts, work, _log)
            except Exception as exc:  # noqa: BLE001
                _log(f"! train failed: {exc}")
                results["train"] = {"error": str(exc)}
        if "rss" in opts.only:
            from _rss import run_rss

            for size in opts.rss_sizes:
                _log(f"== rss, {_label(size, opts.tensors)}")
                results["rss"][str(size)] = run_rss(int(size * GiB), opts, work, _log)
    finally:
        rmtree(work)
    info["loadavg_end"] = list(os.getloadavg())
    info["wall_seconds"] = round(time.monotonic() - t_start, 1)
    try:
        _render(rep, results, opts)
        results["targets"] = rep.targets
        print(rep.text())
    finally:  # the samples are kept even when rendering fails (--render retries it)
        if opts.out:
            with open(opts.out, "w") as f:
                json.dump(results, f, indent=1, default=str)
            _log(f"wrote {opts.out}")
    return 0


def _profile(state: dict, work: str, opts) -> dict | None:
    from _profile import profile_ours

    root = os.path.join(work, "profile")
    try:
        _log("== profile (one save and load, per-function thread-seconds)")
        return profile_ours(state, root, opts.threads)
    except Exception as exc:  # noqa: BLE001
        _log(f"! profile failed: {exc}")
        return {"error": str(exc)}
    finally:
        rmtree(root)


def _render(rep: Report, results: dict, opts) -> None:
    m = results["machine"]
    disk = m["disk"]
    rep.add("## Machine")
    rep.add("")
    rep.add(f"- CPU: {m['cpu_model']}, {m['cpus_usable']} usable cores "
            f"(torch threads {m['torch_threads']})")
    rep.add(f"- RAM: {m['mem_total_gib']} GiB ({m['mem_available_gib']} GiB available at start)")
    rep.add(f"- Disk: {disk['device']} ({disk['fstype']}, "
            f"{'rotational' if disk['rotational'] else 'non-rotational'}) at {disk['mount']}, "
            f"{disk['free_gib']} GiB free")
    rep.add(f"- Kernel {m['kernel']}; " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()))
    rep.add(f"- Load average at start {m['loadavg_start'][0]:.1f}, at end "
            f"{m.get('loadavg_end', [0])[0]:.1f}; wall {m.get('wall_seconds')} s; "
            f"commit {m.get('git_commit')}")
    rep.add(f"- Command: `{m['command']}`")
    rep.add("")
    rep.add(f"## Results (median of {opts.repeats} interleaved rounds; ratio = median of "
            f"per-round ratios)")
    rep.add("")
    for size, res in results["local"].items():
        local_section(rep, _label(float(size), opts.tensors), int(float(size) * GiB), res)
    for size, res in results["s3"].items():
        if isinstance(res, dict) and "series" in res:
            s3_section(rep, _label(float(size), opts.tensors), int(float(size) * GiB), res)
    if results["train"] and "series" in results["train"]:
        train_section(rep, results["train"])
    for size, res in results["rss"].items():
        rss_section(rep, _label(float(size), opts.tensors), res)
    if results.get("profile") and "error" not in results["profile"]:
        rep.add("**Where the time goes (one run each, thread-seconds summed over threads)**")
        rep.add("")
        for name, r in results["profile"].items():
            parts = ", ".join(f"{k} {v:.3f}" for k, v in list(r["thread_seconds"].items())[:8])
            rep.add(f"- {name}: wall {r['wall_seconds']:.3f} s; {parts}")
        rep.add("")
    rep.targets_table()


if __name__ == "__main__":
    sys.exit(main())
