"""Goodput under failures: a full restart from the store against torchft in-job recovery.

    python bench/bench_ft_goodput.py --seconds 240 --nofail-seconds 120 --rounds 1

Both ways train the tiny config on 2 CPU workers (gloo, loopback) with durable checkpoints
every ``--interval`` steps, and every 30-60 s (``--every``; counted from the moment the job
trains fully again, so that failures do not pile up) a random worker is SIGKILLed:

* ``restart``: today's job: one ``torchrun --standalone --nproc-per-node 2 --max-restarts
  1000`` (DDP over 2 ranks, one bucketed all-reduce per step like the replica groups' one
  flat all-reduce). A dead worker brings the job down; torchrun restarts both workers, which
  resume from the newest checkpoint (what was trained since it is lost);
* ``torchft``: 2 replica groups of 1 worker (``python -m trainer ft-local``: a lighthouse
  and one ``torchrun --max-restarts 1000`` per group). The other group trains on; the dead
  one restarts and receives its peer's state.

plus each without failures (``restart_nofail``, ``torchft_nofail``), for the goodput ratio.
The four run one after another, rotated each round, each for a fixed wall time from its
launch. Reported, per way:

* committed steps per second of wall time (the step the surviving lineage reached at the
  end of the window, over the time since the job's first step: the first start-up is left
  out, every restart after a failure is in), and samples per second (a torchft step with
  one group left trains on half the global batch), against the same way without failures;
* per failure: steps lost (trained, then thrown away: ``restart`` from its last step to the
  step it resumed from; ``torchft``: committed steps that any group lost, and the steps not
  committed because the failure hit them), and seconds from the SIGKILL to training again
  (``restart``: the next step of the restarted job; ``torchft``: the killed group's first
  committed step in a full quorum again);
* the healthy group's longest step while a group was down (``torchft``).

A program, not a test: the table and the command are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for p in (HERE, REPO):
    if p not in sys.path:
        sys.path.insert(0, p)

from _common import machine_info, rmtree  # noqa: E402

from trainer.ft.local import LocalReplicaGroups, free_port, worker_pids  # noqa: E402

TINY = os.path.join(REPO, "configs", "tiny.toml")
BATCH = 16  # tiny.toml's global batch; a replica group trains on half of it


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [REPO, *filter(None, [os.environ.get("PYTHONPATH")])]), OMP_NUM_THREADS="1")
    return env


def _common_args(opts, root: Path) -> list[str]:
    return ["--config", TINY, "--training.steps=1000000", "--training.log_every=200",
            f"--checkpoint.root={root}", f"--checkpoint.interval={opts.interval}",
            "--checkpoint.keep_last=2", "--fault.hang_timeout_seconds=60"]


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by a SIGKILL
    return out


def _wait(pred, until: float, poll: float = 0.2) -> bool:
    while time.time() < until:
        if pred():
            return True
        time.sleep(poll)
    return False


def _failures(rng: random.Random, t_end: float, every, training, kill) -> None:
    """Once training runs (``training()``), call ``kill()`` every ``every`` seconds (drawn
    uniformly), each time also waiting until the job trains fully again, until ``t_end``."""
    if not _wait(training, t_end - 5):
        return
    while True:
        t_next = time.time() + rng.uniform(*every)
        if t_next >= t_end - every[0]:  # leave each failure time to recover in the window
            return
        time.sleep(t_next - time.time())
        if not kill():
            return
        if not _wait(training, t_end - 5):
            return


# -- restart: one torchrun job of 2 workers ------------------------------------------------------
def run_restart(opts, work: Path, seconds: float, fail: bool, rng: random.Random) -> dict:
    events = work / "events.jsonl"
    # DDP: one bucketed all-reduce per step, as the replica groups' one flat all-reduce.
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node=2", "--max-restarts=1000", "--monitor-interval=0.5",
            "-m", "trainer", *_common_args(opts, work / "ckpt"), "--parallel.dp_mode=ddp",
            f"--metrics.jsonl_path={events}"]
    log = open(work / "job.log", "w")
    t0 = time.time()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                            start_new_session=True, cwd=REPO)
    kills: list[dict] = []

    def training() -> bool:  # a step after the last kill
        since = kills[-1]["time"] if kills else 0
        return any(e["kind"] == "train_step" and e["time"] > since for e in _read(events))

    def kill() -> bool:
        pids = worker_pids(proc.pid)
        if len(pids) < 2:
            return False
        rank = rng.choice(sorted(pids))
        steps = [e["step"] for e in _read(events) if e["kind"] == "train_step"]
        os.kill(pids[rank], signal.SIGKILL)
        kills.append({"time": time.time(), "rank": rank,
                      "last_step": steps[-1] if steps else 0})
        return True

    try:
        if fail:
            _failures(rng, t0 + seconds, opts.every, training, kill)
        time.sleep(max(0.0, t0 + seconds - time.time()))
        t_end = time.time()
    finally:
        workers = list(worker_pids(proc.pid).values())
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun stops its workers
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in workers:  # in sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
    evs = _read(events)
    steps = [e for e in evs if e["kind"] == "train_step" and e["time"] <= t_end]
    final = steps[-1]["step"] if steps else 0
    t_first = steps[0]["time"] if steps else t_end
    for i, k in enumerate(kills):
        since = kills[i - 1]["time"] if i else 0.0
        after = [e for e in evs if e["time"] > k["time"]]
        resumed = next((e for e in after if e["kind"] == "resumed"), None)
        back = next((e for e in after if e["kind"] == "train_step"), None)
        # The dead attempt's last step: what rank 0 logged before the new attempt resumed
        # (it may log a step or two after the kill, until its collective fails).
        k["last_step"] = max([k["last_step"]] + [
            e["step"] for e in evs if e["kind"] == "train_step" and
            since < e["time"] < (resumed["time"] if resumed else t_end)])
        k["lost_steps"] = k["last_step"] - (resumed["step"] if resumed else 0)
        k["seconds_to_training"] = back["time"] - k["time"] if back else None
    return {"seconds": t_end - t_first, "final_step": final, "samples": final * BATCH,
            "startup_seconds": t_first - t0, "kills": kills}


# -- torchft: 2 replica groups of 1 worker --------------------------------------------------------
def run_torchft(opts, work: Path, seconds: float, fail: bool, rng: random.Random) -> dict:
    args = [*_common_args(opts, work / "ckpt"),
            f"--fault_tolerance.heartbeat_timeout_seconds={opts.heartbeat}",
            "--fault_tolerance.join_timeout_seconds=1", "--fault_tolerance.timeout_seconds=10",
            "--fault_tolerance.lease_ttl_seconds=10", "--fault_tolerance.lease_retry_steps=5"]
    job = LocalReplicaGroups(args, groups=2, out=work, max_restarts=1000, port=free_port(),
                             env=_env())
    t0 = time.time()
    kills: list[dict] = []

    def training() -> bool:  # both groups committing in a full quorum, after the last kill
        since = kills[-1]["time"] if kills else 0
        return all(any(e["time"] > since and e["quorum_size"] == 2 for e in job.steps(g)[-3:])
                   for g in (0, 1))

    def kill() -> bool:
        victim = rng.choice([0, 1])
        if not job.workers(victim):
            return False
        committed = {g: job.last_step(g) for g in (0, 1)}
        writer = job.writer() == victim
        job.kill_worker(victim)
        kills.append({"time": time.time(), "group": victim, "committed": committed,
                      "writer": writer})
        return True

    try:
        job.start()
        if fail:
            _failures(rng, t0 + seconds, opts.every, training, kill)
        time.sleep(max(0.0, t0 + seconds - time.time()))
        t_end = time.time()
    finally:
        job.stop()
    evs = {g: job.events(g) for g in (0, 1)}
    steps = {g: [e for e in evs[g] if e["kind"] == "ft_step" and e["time"] <= t_end]
             for g in (0, 1)}
    committed = [e for g in (0, 1) for e in steps[g] if e["committed"]]
    final = max((e["step"] for e in committed), default=0)
    t_first = min((e["time"] for e in committed), default=t_end)
    samples = max((e["batches_committed"] for e in committed), default=0) * (BATCH // 2)
    for k in kills:
        victim, other = k["group"], 1 - k["group"]
        after = [e for e in steps[victim] if e["time"] > k["time"] and e["committed"]
                 and e["quorum_size"] == 2]
        back = after[0] if after else None
        k["seconds_to_training"] = back["time"] - k["time"] if back else None
        t_back = back["time"] if back else t_end
        during = [e for e in steps[other] if k["time"] < e["time"] <= t_back]
        k["healthy_committed"] = sum(e["committed"] for e in during)
        k["uncommitted_steps"] = sum(not e["committed"] for e in during)
        # Committed steps lost: the healthy group's first commit after the kill would be
        # at or below what it had committed (its committed steps never go back).
        first = next((e["step"] for e in steps[other] if e["committed"]
                      and e["time"] > k["time"]), None)
        k["lost_steps"] = max(0, k["committed"][other] + 1 - first) if first else 0
        longest = [e["step_seconds"] for e in evs[other] if e["kind"] == "train_step"
                   and k["time"] < e["time"] <= t_back]
        k["healthy_longest_step"] = max(longest, default=None)
    return {"seconds": t_end - t_first, "final_step": final, "samples": samples,
            "startup_seconds": t_first - t0, "kills": kills}


WAYS = {"restart": (run_restart, True), "torchft": (run_torchft, True),
        "restart_nofail": (run_restart, False), "torchft_nofail": (run_torchft, False)}


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _f(x, fmt="{:.2f}"):
    return "–" if x is None else fmt.format(x)


def report(results: dict[str, list[dict]]) -> str:
    rate = {w: _med([r["final_step"] / r["seconds"] for r in rs]) for w, rs in results.items()}
    srate = {w: _med([r["samples"] / r["seconds"] for r in rs]) for w, rs in results.items()}
    lines = ["| way | steps/s | vs no failures | samples/s | vs no failures | failures | "
             "steps lost per failure (median, max) | kill to training again, s (median, "
             "max) | healthy group's longest step during a failure, s (median, max) |",
             "|---|---:|---:|---:|---:|---:|---|---|---|"]
    for way in ("restart", "torchft", "restart_nofail", "torchft_nofail"):
        if way not in results:
            continue
        kills = [k for r in results[way] for k in r["kills"]]
        base = way.replace("_nofail", "") + "_nofail"
        vs = rate[way] / rate[base] if base in rate and rate[base] else None
        svs = srate[way] / srate[base] if base in srate and srate[base] else None
        lost = [k["lost_steps"] for k in kills]
        back = [k["seconds_to_training"] for k in kills]
        longest = [k.get("healthy_longest_step") for k in kills]
        lines.append(
            f"| {way} | {_f(rate[way])} | {_f(vs, '{:.2f}x') if way != base else '–'} | "
            f"{_f(srate[way], '{:.0f}')} | {_f(svs, '{:.2f}x') if way != base else '–'} | "
            f"{len(kills)} | {_f(_med(lost), '{:.0f}')}, {_f(max(lost, default=None), '{:.0f}')}"
            f" | {_f(_med(back), '{:.1f}')}, {_f(max(filter(None, back), default=None), '{:.1f}')}"
            f" | {_f(_med(longest), '{:.1f}')}, "
            f"{_f(max(filter(None, longest), default=None), '{:.1f}')} |")
    ft = [k for r in results.get("torchft", []) for k in r["kills"]]
    if ft:
        lines.append("")
        lines.append(f"torchft: the healthy group committed a median of "
                     f"{_med([k['healthy_committed'] for k in ft]):.0f} steps per failure "
                     f"while the other was down; steps not committed (the failure hit them): "
                     f"{sum(k['uncommitted_steps'] for k in ft)} in {len(ft)} failures; "
                     f"the writing group was the victim {sum(k['writer'] for k in ft)} times.")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=240, help="window with failures")
    ap.add_argument("--nofail-seconds", type=float, default=120, help="window without")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--every", type=float, nargs=2, default=(30.0, 60.0),
                    help="seconds between failures, drawn uniformly")
    ap.add_argument("--interval", type=int, default=20, help="checkpoint every N steps")
    ap.add_argument("--heartbeat", type=float, default=1.0,
                    help="fault_tolerance.heartbeat_timeout_seconds")
    ap.add_argument("--ways", nargs="+", default=list(WAYS), choices=list(WAYS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--dir", default=None, help="work folder (default: a temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep the runs' logs and events")
    opts = ap.parse_args()
    rng = random.Random(opts.seed)
    work = Path(tempfile.mkdtemp(prefix="ftgoodput-", dir=opts.dir))
    results: dict[str, list[dict]] = {}
    try:
        for rnd in range(opts.rounds):
            order = opts.ways[rnd % len(opts.ways):] + opts.ways[:rnd % len(opts.ways)]
            for way in order:
                run, fail = WAYS[way]
                seconds = opts.seconds if fail else opts.nofail_seconds
                d = work / f"{way}-{rnd}"
                d.mkdir()
                print(f"round {rnd + 1}/{opts.rounds}: {way} for {seconds:.0f}s", flush=True)
                r = run(opts, d, seconds, fail, rng)
                results.setdefault(way, []).append(r)
                print(f"  final step {r['final_step']} ({r['final_step'] / r['seconds']:.2f} "
                      f"steps/s), {len(r['kills'])} failures: "
                      f"{[{k: v for k, v in x.items() if k != 'time'} for x in r['kills']]}",
                      flush=True)
                if not opts.keep:
                    rmtree(str(d))
    finally:
        if not opts.keep:
            rmtree(str(work))
    info = machine_info(tempfile.gettempdir())
    print(f"\nmachine: {info['cpu_model']}, {info['cpus_usable']} CPUs; load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    print(report(results))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"opts": vars(opts), "results": results}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
