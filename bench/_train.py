"""Training overhead: step time with checkpoints every k steps / ``auto`` vs never.

Each sample is one real run of ``python -m trainer`` under torchrun (``--train-ranks``,
default 2, gloo; one rank runs as a plain process), with the tiny config plus
``--train-args``. With ``--train-ranks 1`` (``--quick``) the trainer runs in this
process instead (``trainer.train.Trainer``, no torchrun start-up per sample). Rank 0 logs every event to a JSONL file; the measured
window runs from the ``train_step`` event of step ``warmup`` to the last step's. A step's
event is emitted after its optimizer step and before its ``maybe_save``, so the window
holds every stall and all background persist work of the saves started in it, while the
start-up, resume, the final blocking save and the exit are outside it. Variants are
interleaved run by run; overhead = median over rounds of (window_variant / window_never) - 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from _common import Contender, interleave, rmtree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_trainer(variant: str, opts, work: str, log) -> dict[str, float]:
    run_dir = tempfile.mkdtemp(prefix=f"train-{variant}-", dir=work)
    events = os.path.join(run_dir, "events.jsonl")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={opts.train_ranks}"]
    args = [*launcher, "-m", "trainer",
            "--config", os.path.join(REPO, opts.train_config),
            f"--training.steps={opts.train_steps}", f"--metrics.jsonl_path={events}",
            *opts.train_args, *_variant_args(variant, opts, run_dir)]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=opts.train_timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"trainer exited {proc.returncode}: {proc.stderr[-2000:]}")
        evs = [json.loads(line) for line in open(events)]
    finally:
        rmtree(run_dir)
    return _summarise(evs, opts)


def _variant_args(variant: str, opts, run_dir: str) -> list[str]:
    if variant == "never":
        return []
    interval = "auto" if variant == "auto" else str(opts.train_every)
    return [f"--checkpoint.root={os.path.join(run_dir, 'ckpt')}",
            f"--checkpoint.interval={interval}"]


def _summarise(evs: list[dict], opts) -> dict[str, float]:
    steps = {e["step"]: e["time"] for e in evs if e["kind"] == "train_step"}
    last = max(steps)
    first = min(opts.train_warmup, last - 1)
    window = steps[last] - steps[first]
    stalls = [e.get("stall_seconds", 0.0) for e in evs
              if e["kind"] == "save_staged" and first <= (e["step"] or 0) < last]
    committed = [e for e in evs if e["kind"] == "save_committed"
                 and first <= (e["step"] or 0) < last]
    # Per step, the time outside train_step (events, agreement, maybe_save, logging): the
    # gap between two step events minus the later step's own step_seconds. Far less noisy
    # than the step time; shows a per-step cost such as a cadence's collective.
    seconds = {e["step"]: e.get("step_seconds", 0.0) for e in evs if e["kind"] == "train_step"}
    order = sorted(s for s in steps if s >= first)
    outside = [steps[b] - steps[a] - seconds[b] for a, b in zip(order, order[1:])]
    costs = [e for e in evs if e["kind"] == "save_cost" and first <= (e["step"] or 0) < last]
    per_save: dict[str, float] = {}
    if costs:  # rank 0's background cost per save, mean over the saves in the window
        for key in ("background_cpu_seconds", "persist_thread_cpu_seconds",
                    "helper_cpu_seconds", "process_cpu_seconds", "total_wall_seconds"):
            per_save[f"cost.{key}"] = sum(e.get(key, 0.0) for e in costs) / len(costs)
        for kind in ("cpu", "wall"):
            for phase in costs[0].get(f"{kind}_seconds", {}):
                per_save[f"cost.{kind}.{phase}"] = sum(
                    e[f"{kind}_seconds"].get(phase, 0.0) for e in costs) / len(costs)
    return {"step": window / (last - first), "outside_mean": sum(outside) / len(outside),
            "window_steps": float(last - first), "stall_share": sum(stalls) / window,
            **per_save,
            "saves": float(len(stalls)),
            "stall_sum": float(sum(stalls)),
            "persist_sum": float(sum(e.get("persist_seconds", 0.0) for e in committed)),
            "save_bytes": float(committed[0].get("bytes", 0)) if committed else 0.0}


def _run_in_process(variant: str, opts, work: str, log) -> dict[str, float]:
    """One rank, no torchrun: ``trainer.train.Trainer`` in this process (``--quick``)."""
    import torch

    from ckpt.events import EventBus
    from trainer.config import config_from_argv
    from trainer.distributed import DistEnv
    from trainer.train import Trainer

    run_dir = tempfile.mkdtemp(prefix=f"train-{variant}-", dir=work)
    evs: list[dict] = []
    bus = EventBus()
    bus.subscribe(lambda ev: evs.append(ev.to_json()))
    try:
        cfg = config_from_argv(["--config", os.path.join(REPO, opts.train_config),
                                f"--training.steps={opts.train_steps}", *opts.train_args,
                                *_variant_args(variant, opts, run_dir)])
        env = DistEnv(0, 1, 0, torch.device("cpu"), None, 0)
        code = Trainer(cfg, env, events=bus).fit()
        if code != 0:
            raise RuntimeError(f"trainer returned {code}")
    finally:
        rmtree(run_dir)
    return _summarise(evs, opts)


def run_train(opts, work: str, log) -> dict[str, Any]:
    fn = _run_in_process if opts.train_ranks == 1 else _run_trainer
    contenders = [Contender(v, (lambda v=v: fn(v, opts, work, log)))
                  for v in ("never", "every", "auto")]
    series = interleave(contenders, opts.train_repeats, log=log, warmup=0)
    return {"series": series,
            "info": {"ranks": opts.train_ranks, "steps": opts.train_steps,
                     "warmup_steps": opts.train_warmup, "every": opts.train_every,
                     "config": opts.train_config, "extra_args": list(opts.train_args),
                     "errors": {c.name: c.error for c in contenders if c.error}}}
