"""Mixture of experts: step time and all-to-all bytes per step, ep1 against ep2, in the
same run.

    python bench/bench_moe.py [--ranks 2] [--rounds 3] [--steps 12] [--warmup 4]
                              [--dim 256] [--layers 4] [--experts 8] [--top-k 2]
                              [--seq-len 256] [--batch 16] [--dir DIR]

Each sample is one real training job of the trainer (``trainer.train.Trainer`` in every
rank of ``torchrun --standalone``, gloo on CPU, FSDP2 over the ranks, no checkpoints) on
the tiny config with an MoE block everywhere (``--experts`` experts, top ``--top-k``,
expert hidden size ``2 * dim``), once with ``parallel.ep = 1`` (every rank holds every
expert; FSDP all-gathers them) and once with ``parallel.ep = --ranks`` (each rank holds
``experts / ep`` of them; tokens go to their experts with two all-to-alls per block). The
order alternates by round.

Step time: the median ``step_seconds`` of rank 0's ``train_step`` events after
``--warmup`` steps; the ratio to ep1 is taken per round (both runs of a round minutes apart
at most) before the median, as bench/_common.py does. All-to-all bytes: every rank counts the rows its dispatch and combine
send to the other ranks (``trainer.expert_parallel.exchange_rows``, wrapped in the worker
to count; the per-expert row counts exchanged before each dispatch are left out) times the
row's bytes, in forward; backward sends the same bytes the other way (the gradient of a
dispatch is a combine and back), so a step's total is twice the forward's. The planner's
estimate (``trainer.memory_model.all_to_all_bytes_per_step``, balanced routing) is printed
beside it. docs/performance.md ("Mixture of experts") has the figures.
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
sys.path[:0] = [REPO]

MiB = 1 << 20


def _overrides(args, ep: int, events: str) -> list[str]:
    """The trainer flags of one sample: the tiny config made an MoE, on ``ep``."""
    return [f"--model.dim={args.dim}", f"--model.n_layers={args.layers}", "--model.n_heads=4",
            f"--model.ffn_dim={2 * args.dim}", f"--model.n_experts={args.experts}",
            f"--model.experts_per_token={args.top_k}", f"--model.max_seq_len={args.seq_len}",
            f"--training.seq_len={args.seq_len}", f"--training.global_batch_size={args.batch}",
            f"--training.steps={args.steps}", f"--training.log_every={args.steps}",
            "--parallel.dp_mode=fsdp", f"--parallel.ep={ep}", "--checkpoint.root=",
            f"--metrics.jsonl_path={events}", "--fault.handle_preemption=false"]


def worker(ep: int, out: str, args) -> None:
    """One rank of one sample (under torchrun): train, then append this rank's line."""
    import torch
    import torch.distributed as dist

    import trainer.expert_parallel as expert_parallel
    from trainer.config import load_config
    from trainer.distributed import init_distributed
    from trainer.train import Trainer

    torch.set_num_threads(1)
    sent = {"bytes": 0, "calls": 0}
    all_to_all = expert_parallel.exchange_rows

    def counted(rows, output_split_sizes, input_split_sizes, group, *rest):
        me = dist.get_rank(group)
        row_bytes = rows[0].numel() * rows.element_size() if rows.shape[0] else 0
        sent["bytes"] += sum(n for r, n in enumerate(input_split_sizes) if r != me) * row_bytes
        sent["calls"] += 1
        return all_to_all(rows, output_split_sizes, input_split_sizes, group, *rest)

    expert_parallel.exchange_rows = counted
    events = f"{out}.events-ep{ep}.jsonl"
    cfg = load_config(os.path.join(REPO, "configs", "tiny.toml"), _overrides(args, ep, events))
    env = init_distributed(cfg.training.device, timeout_seconds=300)
    code = Trainer(cfg, env).fit()
    steps = [json.loads(line) for line in open(events)] if env.rank == 0 else []
    line = {"ep": ep, "rank": env.rank, "code": code, "forward_bytes": sent["bytes"],
            "all_to_alls": sent["calls"],
            "step_seconds": [e["step_seconds"] for e in steps if e.get("kind") == "train_step"
                             and e["step"] > args.warmup]}
    with open(out, "a") as f:
        f.write(json.dumps(line) + "\n")
    dist.destroy_process_group()


def _run(ep: int, work: str, args, argv: list[str]) -> list[dict]:
    out = os.path.join(work, f"ep{ep}-{time.monotonic_ns()}.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(args.ranks), os.path.abspath(__file__), "worker", str(ep), out, *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"ep{ep} failed:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        rows = sorted((json.loads(line) for line in f), key=lambda r: r["rank"])
    if len(rows) != args.ranks or any(r["code"] != 0 for r in rows):
        raise RuntimeError(f"ep{ep}: a rank did not finish: {rows}")
    return rows


def _estimate(args, ep: int) -> float:
    """The planner's all-to-all bytes per step and rank for this sample (fp32 activations,
    balanced routing)."""
    from trainer.config import load_config
    from trainer.memory_model import Candidate, Workload, all_to_all_bytes_per_step, \
        shape_from_config

    cfg = load_config(os.path.join(REPO, "configs", "tiny.toml"), _overrides(args, ep, ""))
    work = Workload(shape_from_config(cfg.model), precision="fp32", seq_len=args.seq_len,
                    micro_batch=args.batch // args.ranks)
    return all_to_all_bytes_per_step(work, Candidate.of(1, args.ranks, 1, "fsdp", ep=ep))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="ranks (and the ep of the EP run)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="first steps left out of the time")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="sequences per step, all ranks")
    p.add_argument("--dir", default=None, help="work folder (default: a temp folder)")
    return p


_ARGS = ("steps", "warmup", "dim", "layers", "experts", "top_k", "seq_len", "batch", "ranks")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        worker(int(argv[1]), argv[2], _parser().parse_args(argv[3:]))
        return 0
    args = _parser().parse_args(argv)
    passed = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in _ARGS]
    work = tempfile.mkdtemp(prefix="bench-moe-", dir=args.dir)
    layouts = (1, args.ranks)
    results: dict[int, list[list[dict]]] = {ep: [] for ep in layouts}
    for r in range(args.rounds):
        for ep in (layouts if r % 2 == 0 else layouts[::-1]):
            t = time.perf_counter()
            results[ep].append(_run(ep, work, args, passed))
            print(f"round {r + 1} ep{ep}: {time.perf_counter() - t:.0f}s", flush=True)
    tokens = args.seq_len * args.batch
    print(f"\nMoE: dim {args.dim}, {args.layers} MoE blocks of {args.experts} experts "
          f"(hidden {2 * args.dim}), top-{args.top_k}; {args.batch} x {args.seq_len} tokens "
          f"per step on {args.ranks} gloo ranks (CPU, fp32, FSDP2); median of "
          f"{args.rounds} runs x {args.steps - args.warmup} steps")
    print(f"{'layout':8} {'step ms':>9} {'vs ep1 (per round)':>26} {'tok/s':>8} "
          f"{'a2a MiB/step/rank':>18} {'planner':>8} {'a2a calls/step':>14}")
    step_of = {ep: [statistics.median(rows[0]["step_seconds"]) for rows in results[ep]]
               for ep in layouts}
    for ep in layouts:
        step = statistics.median(step_of[ep])
        ratios = [a / b for a, b in zip(step_of[ep], step_of[1])]
        said = f"{statistics.median(ratios):.2f} ({', '.join(f'{r:.2f}' for r in ratios)})"
        sent = statistics.median(2 * row["forward_bytes"] / args.steps
                                 for rows in results[ep] for row in rows)
        calls = results[ep][0][0]["all_to_alls"] / args.steps
        print(f"ep{ep:<6} {step * 1e3:9.1f} {said:>26} {tokens / step:8.0f} "
              f"{sent / MiB:18.2f} {_estimate(args, ep) / MiB:8.2f} {calls:14.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
