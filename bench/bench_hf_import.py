"""Importing a Hugging Face folder into FSDP2 shards: ``ckpt.load_hf`` against
``from_pretrained`` + shard, on 2 ranks, in the same run.

    python bench/bench_hf_import.py [--layers 10] [--dim 2048] [--ranks 2] [--rounds 2]
                                    [--dir DIR] [--folder HF_DIR]

Writes a Llama-shaped folder of random fp32 weights (default ~2.3 GB: dim 2048, 10 layers,
GQA 16/4 heads, vocab 32000, 512 MiB shards with an index), reads it once so both
contenders find it in the page cache, then per round starts each contender in fresh
processes (``torchrun --standalone``, gloo, the order alternating by round):

* ``load_hf``: the reference model built on the meta device, FSDP2-sharded over the ranks,
  materialised (``to_empty``), then ``ckpt.load_hf`` under the export's names: each rank
  reads the rows of its own shards;
* ``from_pretrained``: the same sharded model, plus ``LlamaForCausalLM.from_pretrained``
  of the whole folder on every rank, each rank copying its shard of every tensor out of it
  (what a user does without an import).

Per rank: seconds from building the sharded model to every rank done; peak host RSS above
the rank's RSS before it (``VmHWM`` reset through ``/proc/self/clear_refs``, bench/_rss.py),
against the shard's bytes + 256 MiB; bytes read from storage against the shard's bytes
(``load_hf`` only; target <= 1.1x). The two contenders' shards must be bit-identical
(a digest per rank). docs/performance.md ("Import from Hugging Face") has the figures.
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

MiB, GiB = 1 << 20, 1 << 30
MODES = ("load_hf", "from_pretrained")
BUDGET_BYTES = 256 * MiB  # a rank's RSS during an import: its shard + this, at most


def _model_config(args):
    from trainer.config import ModelConfig

    return ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers,
                       n_heads=args.heads, n_kv_heads=args.kv_heads, ffn_dim=args.ffn_dim,
                       max_seq_len=4096)


def write_folder(folder: str, args) -> int:
    """A Llama folder of random fp32 weights, shard by shard; returns its tensor bytes."""
    import torch
    from safetensors.torch import save_file

    from ckpt.export import HF_CONFIG_NAME, HF_INDEX_NAME
    from trainer.hf import hf_config, hf_names
    from trainer.model import Transformer

    cfg = _model_config(args)
    os.makedirs(folder, exist_ok=True)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(cfg).state_dict().items()}
    names = hf_names(cfg)
    shards: list[list[str]] = [[]]
    size = 0
    for key, shape in shapes.items():
        nbytes = 4 * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > args.shard_mb * MiB:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i, keys in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {names[k]: torch.randn(shapes[k], generator=gen) * 0.02 for k in keys}
        save_file(tensors, os.path.join(folder, file), metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update((n, file) for n in tensors)
        del tensors
    with open(os.path.join(folder, HF_INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(folder, HF_CONFIG_NAME), "w") as f:
        json.dump(hf_config(cfg), f, indent=1)
    return total


def worker(mode: str, folder: str, out: str, args) -> None:
    """One rank of one contender (under torchrun); appends its JSON line to ``out``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from bench._rss import reset_rss_peak, rss_status
    from ckpt.hf import load_hf
    from trainer.hf import hf_names
    from trainer.model import Transformer
    from trainer.parallel_plans import apply_fsdp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    cfg = _model_config(args)
    names = hf_names(cfg)
    if mode == "from_pretrained":
        from transformers import LlamaForCausalLM  # imported before the baseline
    import gc

    gc.collect()
    dist.barrier()
    base = rss_status()["VmRSS"]
    reset = reset_rss_peak()
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = Transformer(cfg)
    apply_fsdp(model, mesh)
    model.to_empty(device="cpu")
    state = model.state_dict()
    shard = sum(v.to_local().nbytes for v in state.values())
    report = None
    if mode == "load_hf":
        report = load_hf(state, folder, names=names)
    else:
        hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
        full = hf.state_dict()
        with torch.no_grad():
            for key, value in state.items():
                piece = DTensor.from_local(full[names[key]], mesh, [Replicate()],
                                           run_check=False)
                value.to_local().copy_(piece.redistribute(mesh, value.placements).to_local())
        del hf, full
    dist.barrier()
    seconds = time.perf_counter() - t0
    peak = rss_status()["VmHWM"]
    digest = sum(float(v.to_local().double().sum()) for v in state.values())
    line = {"mode": mode, "rank": rank, "seconds": seconds, "shard_bytes": shard,
            "baseline_rss": base, "peak_rss": peak, "extra_peak_bytes": peak - base,
            "peak_reset": reset, "digest": digest,
            "bytes_read": report.bytes_read if report else None,
            "tensor_bytes_read": report.tensor_bytes_read if report else None,
            "num_reads": report.num_reads if report else None}
    with open(out, "a") as f:
        f.write(json.dumps(line) + "\n")
    dist.destroy_process_group()


def _run(mode: str, folder: str, work: str, args, argv: list[str]) -> list[dict]:
    out = os.path.join(work, f"{mode}-{time.monotonic_ns()}.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(args.ranks), os.path.abspath(__file__), "worker", mode, folder, out, *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return sorted((json.loads(line) for line in f), key=lambda r: r["rank"])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn-dim", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--shard-mb", type=int, default=512, help="largest file of the folder")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dir", default=None, help="work folder (default: a temp folder)")
    p.add_argument("--folder", default=None, help="an existing folder of this shape")
    return p


_SHAPE_ARGS = ("dim", "layers", "heads", "kv_heads", "ffn_dim", "vocab")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        mode, folder, out, rest = argv[1], argv[2], argv[3], argv[4:]
        worker(mode, folder, out, _parser().parse_args(rest))
        return 0
    args = _parser().parse_args(argv)
    shape_argv = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in _SHAPE_ARGS]
    work = tempfile.mkdtemp(prefix="bench-hf-import-", dir=args.dir)
    try:
        folder = args.folder or os.path.join(work, "hf")
        if args.folder is None:
            t = time.perf_counter()
            total = write_folder(folder, args)
            print(f"wrote {folder}: {total / GiB:.2f} GiB fp32 in "
                  f"{time.perf_counter() - t:.0f}s", flush=True)
        for name in os.listdir(folder):  # both contenders find it in the page cache
            with open(os.path.join(folder, name), "rb") as f:
                while f.read(64 * MiB):
                    pass
        rounds: list[dict[str, list[dict]]] = []
        for r in range(args.rounds):
            row = {}
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                row[mode] = _run(mode, folder, work, args, shape_argv)
                print(f"round {r + 1} {mode}: " + ", ".join(
                    f"rank {x['rank']} {x['seconds']:.2f}s, peak "
                    f"+{x['extra_peak_bytes'] / MiB:.0f} MiB" for x in row[mode]), flush=True)
            rounds.append(row)
        _table(rounds, args)
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0


def _table(rounds: list[dict[str, list[dict]]], args) -> None:
    first = rounds[0]["load_hf"]
    for rank, (ours, theirs) in enumerate(zip(first, rounds[0]["from_pretrained"])):
        assert ours["digest"] == theirs["digest"], f"rank {rank}: the shards differ"
    shard = max(x["shard_bytes"] for x in first)
    print(f"\n{args.ranks} ranks, FSDP2; shard per rank {shard / MiB:.0f} MiB fp32; "
          f"median of {len(rounds)} rounds (per rank: the largest)")
    print("| contender | seconds | ratio to from_pretrained | peak RSS above start "
          "| peak / (shard + 256 MiB) | bytes read / shard |")
    print("|---|---|---|---|---|---|")
    for mode in MODES:
        secs = [max(x["seconds"] for x in row[mode]) for row in rounds]
        ratios = [max(x["seconds"] for x in row[mode])
                  / max(x["seconds"] for x in row["from_pretrained"]) for row in rounds]
        peak = max(x["extra_peak_bytes"] for row in rounds for x in row[mode])
        read = [x["bytes_read"] / x["shard_bytes"] for row in rounds for x in row[mode]
                if x["bytes_read"] is not None]
        print(f"| {mode} | {statistics.median(secs):.2f} | {statistics.median(ratios):.2f}x | "
              f"{peak / MiB:.0f} MiB | {peak / (shard + BUDGET_BYTES):.2f} | "
              f"{f'{max(read):.4f}x' if read else '-'} |")
    reset = all(x["peak_reset"] for row in rounds for xs in row.values() for x in xs)
    print("peak RSS reset per rank before the import: "
          + ("yes" if reset else "NO (the peaks include start-up)"))


if __name__ == "__main__":
    sys.exit(main())
