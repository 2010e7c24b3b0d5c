"""Scale of a save: coordinator time and manifest size against the number of ranks.

No processes and no tensor data: for each simulated world size this program builds the
local ``SavePlan`` every rank would send (what ``ckpt.dcp.planners.SafeSavePlanner`` produces for
the trainer's state: FSDP2 shards on dim 0 over ``dp``, TP column/row splits over ``tp``,
AdamW moments sharded like their parameters, replicated ``step`` tensors and param-group
values, per-rank RNG state, the flatten mappings and replica checksums in ``planner_data``),
then runs what the coordinator runs at a save, timed:

* ``plan``: ``SafeSavePlanner.create_global_plan`` (the replica check, DCP's dedup, global
  plan, mapping merge and validation), with DCP's pieces also timed alone to attribute cost
  (``merge`` is DCP's own ``dict(ChainMap(...))`` of the mappings, which our planner no longer
  calls: it merges them in one pass);
* ``finish``: ``CkptWriter.prepare_global_plan`` and ``CkptWriter.finish`` on per-rank
  ``WriteResult``s as ``write_data`` returns them (4 files per rank; the chunks of sharded
  tensors stay in each rank's part, format version 2): the root manifest built, serialised
  (``Manifest.to_json_bytes``) and committed on a local temp root;
* ``read``: ``Manifest.from_json_bytes`` of the root (digest, parse, validation), and
  ``Part.from_json_bytes`` of rank 0's part (what ``write_data`` writes), which a loading
  rank of an unchanged layout pays: ``load bytes`` is what it reads and parses (the root and
  its own part);
* ``steady``: a save after the first, as a ``CheckpointManager`` makes it (its
  ``SavePlanCache``): every rank sends an empty plan with the cached plan's id and one digest
  per holder set, the coordinator checks them (``create_global_plan`` on the cached path)
  and ``prepare_global_plan``; the manifest build and commit are the first save's (each
  save's offsets and checksums are new). ``coordinator_s_per_save`` is that sum.

The optimizer state is the trainer's: param groups and step counters packed once per group
(``ckpt.dcp.optim_state``); ``--per-parameter-optim`` simulates the form before (every
hyperparameter and ``step`` once per parameter, on every rank).

It fits the log-log slope of each against the number of ranks (1 = linear). Layers are
identical, so both grow linearly in the layer count: ``--layers`` (default 1) keeps the sweep
small and the tables scale the measured numbers to the whole model (``--check-layers``
measures the layer scaling too).

``--sizing`` prints, instead, bytes per rank and per node for 7B/70B/405B on common layouts,
the stall at a host-copy bandwidth, persist time at 1/5/20 GB/s per node and the interval
``ckpt.cadence.policies.optimal_interval`` recommends for an assumed MTBF.

    python3 bench/bench_scale.py                         # 7B and 70B, 8..4096 ranks
    python3 bench/bench_scale.py --models 7b --ranks 8,64,512
    python3 bench/bench_scale.py --sizing --node-mtbf-hours 6000 --copy-gbps 10
    python3 bench/bench_scale.py --models 70b --ranks 1024,4096 --fit-layers --json rows.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
from collections import ChainMap
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans  # noqa: E402
from torch.distributed.checkpoint.default_planner import (  # noqa: E402
    _validate_global_plan,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import (  # noqa: E402
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (  # noqa: E402
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult  # noqa: E402

from ckpt.cadence import make_tier_cadence_plans
from ckpt.cadence.young_daly import optimal_interval
from ckpt.dcp import SavePlanCache
from ckpt.dcp.planners import SafeSavePlanner
from ckpt.dcp.writer import CkptWriter
from ckpt.dcp.planners import _CACHED_KEY  # noqa: E402  (a cached plan's planner_data)
from ckpt.format import (  # noqa: E402
    FileRecord,
    ItemLocation,
    Manifest,
    Part,
    crc32c_of,
    part_name,
    part_sha256,
)
from ckpt.root import Lifecycle  # noqa: E402
from ckpt.storage import Storage  # noqa: E402


@dataclass(frozen=True)
class Model:
    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab: int

    def params(self, n_layers: int | None = None) -> list[tuple[str, tuple[int, ...], str]]:
        """``(name, shape, tp style)``: 'col' splits dim 0 over tp, 'row' dim 1, 'rep'
        replicates; FSDP2 then shards dim 0 of each tp-local piece over dp."""
        hd = self.dim // self.n_heads
        out = [("tok_embeddings.weight", (self.vocab, self.dim), "col")]  # rowwise on vocab
        for i in range(self.n_layers if n_layers is None else n_layers):
            p = f"layers.{i}."
            out += [(p + "attention_norm.weight", (self.dim,), "rep"),
                    (p + "attention.wq.weight", (self.n_heads * hd, self.dim), "col"),
                    (p + "attention.wk.weight", (self.n_kv_heads * hd, self.dim), "col"),
                    (p + "attention.wv.weight", (self.n_kv_heads * hd, self.dim), "col"),
                    (p + "attention.wo.weight", (self.dim, self.n_heads * hd), "row"),
                    (p + "ffn_norm.weight", (self.dim,), "rep"),
                    (p + "feed_forward.w1.weight", (self.ffn_dim, self.dim), "col"),
                    (p + "feed_forward.w2.weight", (self.dim, self.ffn_dim), "row"),
                    (p + "feed_forward.w3.weight", (self.ffn_dim, self.dim), "col")]
        out += [("norm.weight", (self.dim,), "rep"),
                ("output.weight", (self.vocab, self.dim), "col")]
        return out

    def num_params(self) -> int:
        return sum(math.prod(s) for _, s, _ in self.params())


MODELS = {
    "7b": Model("7b", 4096, 32, 32, 32, 11008, 32000),       # Llama 2 7B
    "70b": Model("70b", 8192, 80, 64, 8, 28672, 32000),      # Llama 2 70B (GQA, 8 kv heads)
    "405b": Model("405b", 16384, 126, 128, 8, 53248, 128256),  # Llama 3.1 405B
}
# The values torch's AdamW keeps per parameter group; the trainer's state has one group
# per parameter, flattened to one object each.
_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach",
               "capturable", "differentiable", "fused", "decoupled_weight_decay", "initial_lr")
_MISC_KEYS = ("sched.0.base_lrs", "sched.0.last_epoch", "sched.0._step_count",
              "sched.0._is_initial", "sched.0._get_lr_called_within_step", "sched.0._last_lr",
              "sched.0.lr_lambdas", "data.format", "data.next_batch", "data.samples_consumed",
              "data.global_batch_size", "data.seed", "data.dataset", "trainer.step",
              "trainer.fingerprint", "trainer.guard.window", "trainer.num_skipped")
_F32 = TensorProperties(dtype=torch.float32)
_U8 = TensorProperties(dtype=torch.uint8)
_RNG_BYTES = 5056  # torch's CPU generator state
_FILES_PER_RANK = 4  # CkptWriter's default num_threads on local disk


def _split(n: int, parts: int, i: int) -> tuple[int, int]:
    """``(offset, size)`` of piece ``i`` of ``n`` split like ``torch.chunk`` (DTensor's Shard)."""
    c = -(-n // parts)
    start = min(n, i * c)
    return start, max(0, min(n, start + c) - start)


def _chunk(shape: tuple[int, ...], style: str, d: int, dp: int, t: int, tp: int):
    offs, sizes = [0] * len(shape), list(shape)
    if style == "row" and tp > 1:
        offs[1], sizes[1] = _split(shape[1], tp, t)
    if style == "col" and tp > 1:
        offs[0], sizes[0] = _split(shape[0], tp, t)
    o, s = _split(sizes[0], dp, d)  # FSDP2: dim 0 of the tp-local piece
    # An empty shard (more dp ranks than rows) is placed at the tensor's end, so that its
    # index never equals a neighbour's real chunk (DCP dedups items by fqn and offsets).
    offs[0] = offs[0] + o if s else shape[0]
    sizes[0] = s
    return torch.Size(offs), torch.Size(sizes)


def _crc(*parts) -> int:
    return hash(parts) & 0xFFFFFFFF


def local_plans(model: Model, n_layers: int, dp: int, tp: int,
                per_parameter_optim: bool = False) -> list[SavePlan]:
    """Every rank's local plan as ``SafeSavePlanner.create_local_plan`` returns it (the
    optimizer's param groups packed, ``ckpt.dcp.optim_state``, unless
    ``per_parameter_optim``)."""
    params = model.params(n_layers)
    plans = []
    scalar = torch.Size([])
    for rank in range(dp * tp):
        d, t = divmod(rank, tp)  # mesh ("dp", "tp"): tp innermost
        items, mappings, digests = [], {}, {}
        for name, shape, style in params:
            offs, sizes = _chunk(shape, style, d, dp, t, tp)
            size = torch.Size(shape)
            for fqn in (f"app.model.{name}", f"app.optim.state.{name}.exp_avg",
                        f"app.optim.state.{name}.exp_avg_sq"):
                items.append(WriteItem(MetadataIndex(fqn, offs), WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(
                                           ChunkStorageMetadata(offs, sizes), _F32, size)))
                mappings[fqn] = tuple(fqn.split(".", 2))
            if not per_parameter_optim:
                continue
            fqn = f"app.optim.state.{name}.step"
            items.append(WriteItem(MetadataIndex(fqn, scalar), WriteItemType.TENSOR,
                                   tensor_data=TensorWriteData(
                                       ChunkStorageMetadata(scalar, scalar), _F32, scalar)))
            mappings[fqn] = tuple(fqn.split(".", 2))
            digests[SafeSavePlanner.digest_key(fqn)] = [_crc(fqn), "torch.float32", "[]"]
            for key in _GROUP_KEYS:
                fqn = f"app.optim.param_groups.{name}.{key}"
                items.append(WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO))
                mappings[fqn] = tuple(fqn.split(".", 2))
                digests[SafeSavePlanner.digest_key(fqn)] = [_crc(fqn)]
        if not per_parameter_optim:  # one param group: its hyperparameters, its counters
            group = f"app.optim.groups.app.model.{params[0][0]}"
            fqn = f"{group}.hyper"
            items.append(WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO))
            mappings[fqn] = tuple(fqn.split(".", 2))
            digests[SafeSavePlanner.digest_key(fqn)] = [_crc(fqn)]
            fqn = f"{group}.steps"
            n = torch.Size([len(params)])
            items.append(WriteItem(MetadataIndex(fqn, torch.Size([0])), WriteItemType.TENSOR,
                                   tensor_data=TensorWriteData(
                                       ChunkStorageMetadata(torch.Size([0]), n), _F32, n)))
            mappings[fqn] = tuple(fqn.split(".", 2))
            digests[SafeSavePlanner.digest_key(fqn)] = [_crc(fqn), "torch.float32",
                                                         f"[{len(params)}]"]
        for fqn in _MISC_KEYS:
            items.append(WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO))
            mappings[fqn] = tuple(fqn.split(".", 1))
            digests[SafeSavePlanner.digest_key(fqn)] = [_crc(fqn)]
        # Per-rank state under per-rank keys (ckpt.dcp.stateful.PerRankState).
        fqn = f"rng.rank{rank}.cpu"
        rng = torch.Size([_RNG_BYTES])
        items.append(WriteItem(MetadataIndex(fqn, torch.Size([0])), WriteItemType.TENSOR,
                               tensor_data=TensorWriteData(
                                   ChunkStorageMetadata(torch.Size([0]), rng), _U8, rng)))
        mappings[fqn] = ("rng", f"rank{rank}", "cpu")
        digests[SafeSavePlanner.digest_key(fqn)] = [_crc(rank), "torch.uint8", f"[{_RNG_BYTES}]"]
        fqn = f"rng.rank{rank}.python"
        items.append(WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO))
        mappings[fqn] = ("rng", f"rank{rank}", "python")
        digests[SafeSavePlanner.digest_key(fqn)] = [_crc(rank, "py")]
        plans.append(SavePlan(items, planner_data={**mappings, **digests}))
    return plans


@dataclass(frozen=True)
class _PartRecord:
    """What ``write_data`` reports of a rank's part: its file record and SHA-256."""

    record: FileRecord
    sha256: str


def write_results(final_plans: list[SavePlan], step: int, save_id: str
                  ) -> tuple[list[list[WriteResult]], bytes]:
    """What each rank's ``CkptWriter.write_data`` returns for its final plan, and rank 0's
    part. Every rank keeps the chunks of its shards in its part and reports the part's
    record; only rank 0's part is built here (the coordinator only copies the others'
    records, which reuse its size)."""
    out = []
    part0 = b""
    for rank, plan in enumerate(final_plans):
        prefix = f"r{rank:05d}_{plan.storage_data.save_id}"  # prepare_global_plan's
        offsets = [0] * _FILES_PER_RANK
        results = []
        part = Part(rank)
        for k, item in enumerate(plan.items):
            f = k % _FILES_PER_RANK
            if item.type == WriteItemType.BYTE_IO:
                length = 64
            else:
                length = math.prod(item.tensor_data.chunk.sizes) * (
                    1 if item.tensor_data.properties.dtype == torch.uint8 else 4)
            name = f"{prefix}_{f}.bin"
            loc = ItemLocation(name, offsets[f], length, _crc(rank, k))
            offsets[f] += length
            td = item.tensor_data
            if item.type == WriteItemType.SHARD and (any(td.chunk.offsets)
                                                     or td.chunk.sizes != td.size):
                if rank == 0:
                    part.chunks.setdefault(item.index.fqn, []).append(
                        {"offsets": list(td.chunk.offsets), "sizes": list(td.chunk.sizes),
                         "location": loc})
                continue
            results.append(WriteResult(item.index, length, loc))
        for f, size in enumerate(offsets):
            name = f"{prefix}_{f}.bin"
            results.append(WriteResult(MetadataIndex("__file__:" + name), size,
                                       FileRecord(size, _crc(name), rank)))
        if rank == 0:
            part0 = part.to_json_bytes(step, save_id)
        name = part_name(rank, save_id)
        record = FileRecord(len(part0), crc32c_of([part0]) if rank == 0 else 0, rank)
        sha = part_sha256(part0) if rank == 0 else "0" * 64
        results.append(WriteResult(MetadataIndex("__part__:" + name), len(part0),
                                   _PartRecord(record, sha)))
        out.append(results)
    return out, part0


def _timed(fn, *args):
    """CPU seconds of ``fn(*args)`` (this process; the work is single-threaded, and CPU time
    is far steadier than wall time on a shared machine)."""
    gc.collect()
    t0 = time.process_time()
    value = fn(*args)
    return time.process_time() - t0, value


def _chain_merge(plans: list[SavePlan]) -> dict:
    """DCP's merge of the flatten mappings (``DefaultSavePlanner._create_global_plan``)."""
    return dict(ChainMap(*[p.planner_data for p in plans]))


def _finish_timed(writer: CkptWriter, metadata, results) -> tuple[float, float]:
    """CPU seconds of ``writer.finish``: building the manifest, then serialising and
    committing it (split at ``before_commit``)."""
    marks = {}
    writer.before_commit = lambda: marks.setdefault("built", time.process_time())
    gc.collect()
    t0 = time.process_time()
    writer.finish(metadata, results)
    t1 = time.process_time()
    return marks["built"] - t0, t1 - marks["built"]


def measure(model: Model, n_layers: int, world: int, tp: int, root: str,
            per_parameter_optim: bool = False, repeats: int = 3) -> dict:
    dp = world // tp
    plans = local_plans(model, n_layers, dp, tp, per_parameter_optim)
    num_items = sum(len(p.items) for p in plans)
    row: dict = {"model": model.name, "ranks": world, "dp": dp, "tp": tp, "layers": n_layers,
                 "items": num_items}
    gc.disable()  # the coordinator's allocations would otherwise trigger full collections
    try:
        # DCP's pieces alone, on the plans without our checksums (as our planner hands them on).
        cleaned = [SavePlan(p.items, planner_data={k: v for k, v in p.planner_data.items()
                                                   if not k.startswith("__ckpt")}) for p in plans]
        row["t_dedup"], deduped = _timed(dedup_save_plans, cleaned, False)
        row["t_global"], (gp, md) = _timed(create_default_global_save_plan, deduped)
        row["t_merge"], merged = _timed(_chain_merge, gp)
        row["t_validate"], _ = _timed(_validate_global_plan, gp, md)
        del deduped, gp, md, merged, cleaned
        cache = SavePlanCache()
        planner = SafeSavePlanner(cache=cache)
        row["t_plan"], (global_plans, metadata) = _timed(planner.create_global_plan, plans)
        storage = Storage(root)
        step = int(time.time() * 1e6) % 10**9  # a new step folder every time
        writer = CkptWriter(storage, step, f"step_{step:09d}", lifecycle=Lifecycle(storage),
                            manifest_extra={"world_size": world})
        row["t_prepare"], final = _timed(writer.prepare_global_plan, global_plans)
        row["num_chunks"] = sum(len(md.chunks) for md in metadata.state_dict_metadata.values()
                                if hasattr(md, "chunks"))
        results, part0 = write_results(final, step, writer.save_id)
        row["t_build"], row["t_commit"] = _finish_timed(writer, metadata, results)
        row["t_serialize"], data = _timed(writer.manifest.to_json_bytes)
        row["manifest_bytes"] = len(data)
        row["part_bytes"] = len(part0)
        row["manifest_bytes_per_loading_rank"] = len(data) + len(part0)
        save_id = writer.save_id
        # The steady state: saves after the first, every rank on its cached plan, each with
        # the first save's results (its own offsets and checksums cost the same). The
        # minimum of ``repeats`` saves per phase: CPU time still varies with the load.
        cached = cache.global_plan
        digest = "0" * 32  # equal within each holder set: the replicas agree
        steady: dict[str, list[float]] = {}
        for k in range(repeats):
            cached_plans = [SavePlan([], usable=False, planner_data={
                _CACHED_KEY: [cached.plan_id, {sid: digest for sid in cached.sets_of_rank[r]}]})
                for r in range(world)]
            t, (cached_global, cached_md) = _timed(
                SafeSavePlanner(cache=cache).create_global_plan, cached_plans)
            steady.setdefault("t_plan_cached", []).append(t)
            n = step + 1 + k
            again = CkptWriter(storage, n, f"step_{n:09d}", lifecycle=Lifecycle(storage),
                               manifest_extra={"world_size": world}, save_id=save_id)
            t, _ = _timed(again.prepare_global_plan, cached_global)
            steady.setdefault("t_prepare_cached", []).append(t)
            build, commit = _finish_timed(again, cached_md, results)
            steady.setdefault("t_build_cached", []).append(build)
            steady.setdefault("t_commit_cached", []).append(commit)
            del cached_plans, cached_global, again
        row.update({k: min(v) for k, v in steady.items()})
        del results, final, global_plans, metadata, plans, writer
        row["t_read"], root = _timed(Manifest.from_json_bytes, data, "bench")
        row["t_read_part"], _ = _timed(Part.from_json_bytes, part0, "bench", root,
                                       part_name(0, save_id))
    finally:
        gc.enable()
    row["t_coord"] = row["t_plan"] + row["t_prepare"] + row["t_build"] + row["t_commit"]
    row["t_steady"] = (row["t_plan_cached"] + row["t_prepare_cached"] + row["t_build_cached"]
                       + row["t_commit_cached"])
    return row


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) against log(x)."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(max(y, 1e-9)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return (sum((a - mx) * (b - my) for a, b in zip(lx, ly))
            / sum((a - mx) ** 2 for a in lx))


def _fmt_s(s: float) -> str:
    if s < 0.1:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.1f} s"


def _fmt_b(b: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b:.0f} B"


def _whole_model(r: dict, r2: dict | None, key: str, model: Model, layers: int) -> float:
    """``r[key]`` for the whole model: fitted on ``layers`` and ``_FIT * layers`` (``r2``;
    what grows with the ranks alone is not multiplied by the layers), else scaled by the
    layer count (an upper estimate)."""
    if r2 is None:
        return r[key] * model.n_layers / layers
    per_layer = max(0.0, (r2[key] - r[key]) / ((_FIT - 1) * layers))
    return r[key] + per_layer * (model.n_layers - layers)


_FIT = 4  # --fit-layers measures again at 4x the layers: a 2x fit multiplies CPU-time noise
# of one layer by the model's 80 layers


def run_scale(args) -> None:
    ranks = [int(r) for r in args.ranks.split(",")]
    est = (f"fitted on {args.layers} and {_FIT * args.layers} layers" if args.fit_layers else
           f"x n_layers/{args.layers}, an upper estimate")
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} CPUs; "
          f"CPU seconds; {args.layers} layer(s) simulated (plus embeddings, output and every "
          f"rank's own state); whole model: {est}; tp={args.tp} where ranks >= tp; optimizer "
          f"state {'per parameter' if args.per_parameter_optim else 'packed per group'}\n")
    fits = []
    out_rows = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as root:
        for name in args.models.split(","):
            model = MODELS[name]
            rows = []
            print(f"### {name}: {model.num_params() / 1e9:.1f}B parameters, {model.n_layers} "
                  f"layers\n")
            print("| ranks | layout | write items | chunks | first save: plan | manifest build "
                  "| serialize + commit | coordinator | steady: plan (cached) | coordinator "
                  "| root manifest | read + validate | rank 0's part | read + validate | "
                  "whole model (est.): coordinator first / steady, load bytes |")
            print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
            for world in ranks:
                tp = args.tp if world >= args.tp else 1
                r = measure(model, args.layers, world, tp, root, args.per_parameter_optim,
                            args.repeats)
                r2 = (measure(model, _FIT * args.layers, world, tp, root,
                              args.per_parameter_optim, args.repeats)
                      if args.fit_layers else None)
                whole = {k: _whole_model(r, r2, k, model, args.layers)
                         for k in ("t_coord", "t_steady", "manifest_bytes_per_loading_rank")}
                r["whole"] = whole
                rows.append(r)
                out_rows.append({
                    "model": name, "ranks": world, "dp": r["dp"], "tp": tp,
                    "coordinator_s_per_save": whole["t_steady"],
                    "coordinator_s_first_save": whole["t_coord"],
                    "manifest_bytes_per_loading_rank": whole["manifest_bytes_per_loading_rank"],
                    "estimate": est, "optimizer_state": "per parameter" if
                    args.per_parameter_optim else "packed",
                    "simulated": {k: v for k, v in r.items() if k != "whole"}})
                print(f"| {world} | dp{r['dp']}xtp{tp} | {r['items']:,} | {r['num_chunks']:,} | "
                      f"{_fmt_s(r['t_plan'])} | {_fmt_s(r['t_build'])} | "
                      f"{_fmt_s(r['t_commit'])} | {_fmt_s(r['t_coord'])} | "
                      f"{_fmt_s(r['t_plan_cached'])} | {_fmt_s(r['t_steady'])} | "
                      f"{_fmt_b(r['manifest_bytes'])} | {_fmt_s(r['t_read'])} | "
                      f"{_fmt_b(r['part_bytes'])} | {_fmt_s(r['t_read_part'])} | "
                      f"{_fmt_s(whole['t_coord'])} / {_fmt_s(whole['t_steady'])}, "
                      f"{_fmt_b(whole['manifest_bytes_per_loading_rank'])} |", flush=True)
            if len(rows) >= 2:
                xs = [r["ranks"] for r in rows]
                top = rows[-3:]  # the largest world sizes: where a super-linear term shows
                keys = ("t_coord", "t_steady", "t_plan", "t_plan_cached", "t_build",
                        "t_commit", "manifest_bytes", "t_read")
                fit = {k: (slope(xs, [r[k] for r in rows]),
                           slope([r["ranks"] for r in top], [r[k] for r in top]))
                       for k in keys}
                fit["whole_steady"] = (slope(xs, [r["whole"]["t_steady"] for r in rows]),
                                       slope([r["ranks"] for r in top],
                                             [r["whole"]["t_steady"] for r in top]))
                fits.append((name, fit))
            print()
    if fits:
        print("### Log-log slopes against the number of ranks (1.0 = linear): over all world "
              "sizes / over the three largest\n")
        print("| model | coordinator, first save | steady save | whole model, steady | plan | "
              "plan (cached) | manifest build | serialize + commit | manifest bytes | "
              "read + validate |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, f in fits:
            cells = " | ".join(f"{f[k][0]:.2f} / {f[k][1]:.2f}" for k in (
                "t_coord", "t_steady", "whole_steady", "t_plan", "t_plan_cached", "t_build",
                "t_commit", "manifest_bytes", "t_read"))
            print(f"| {name} | {cells} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out_rows, f, indent=1)
        print(f"\n{len(out_rows)} rows written to {args.json}")
    if args.check_layers:
        print("\n### Layer scaling at 64 ranks (dp8xtp8): time and size per simulated layer\n")
        for name in args.models.split(","):
            a = measure(MODELS[name], 1, 64, 8, tempfile.mkdtemp(), args.per_parameter_optim)
            b = measure(MODELS[name], 4, 64, 8, tempfile.mkdtemp(), args.per_parameter_optim)
            print(f"- {name}: 4 layers / 1 layer: coordinator x{b['t_coord'] / a['t_coord']:.2f}, "
                  f"steady x{b['t_steady'] / a['t_steady']:.2f}, "
                  f"manifest x{b['manifest_bytes'] / a['manifest_bytes']:.2f}")


# -- sizing ---------------------------------------------------------------------------------
LAYOUTS = {
    "7b": [(8, 1), (8, 8), (64, 1), (32, 8)],
    "70b": [(8, 8), (32, 8), (128, 8), (512, 8)],
    "405b": [(16, 8), (64, 8), (256, 8), (1024, 8)],
}
BYTES_PER_PARAM = 12  # fp32 master weights + AdamW exp_avg + exp_avg_sq (what the trainer saves)
LOCAL_KEEP = 2  # local steps kept per node (checkpoint.local_keep_last's default)


def run_sizing(args) -> None:
    gpus = args.gpus_per_node
    print(f"Checkpoint = {BYTES_PER_PARAM} bytes/parameter (fp32 weights + two fp32 AdamW "
          f"moments); {gpus} ranks per node; stall = bytes per rank / {args.copy_gbps:g} GB/s "
          f"host copy (the device-to-host staging copy, per rank, all ranks in parallel); "
          f"persist = bytes per node / node bandwidth; job MTBF = {args.node_mtbf_hours:g} h per "
          f"node / nodes; recommended interval = ckpt.cadence.policies.optimal_interval(delta=stall, "
          f"mtbf=job MTBF, persist_seconds=persist at 5 GB/s per node), no overhead budget.\n")
    print(f"Two tiers (last three columns, ckpt.cadence.plan.make_tier_cadence_plans as `ckpt plan "
          f"--local-bandwidth` computes them): a local tier at {args.local_gbps:g} GB/s per node, "
          f"saved at every failure's MTBF; the durable tier at {args.durable_gbps:g} GB/s per "
          f"node, saved at the "
          f"MTBF of node losses, {args.node_loss_share:g} of all failures (the rest keep "
          f"their node's local tier); restart 60 s. Goodput: both tiers / the durable tier "
          f"alone. With copies on the next node (checkpoint.local_copies = 2, `ckpt plan "
          f"--local-copies 2 --nodes N`): the goodput of both tiers when a node loss is "
          f"survived unless a neighbour is lost too (one node: no next node), and the local "
          f"disk (or /dev/shm memory) per node for the last {LOCAL_KEEP} local steps: its own, "
          f"and with copies its predecessor's too.\n")
    print("| model | layout | ranks | nodes | checkpoint | per rank | per node | stall | "
          "persist @1 GB/s | @5 GB/s | @20 GB/s | job MTBF | interval (bound) | "
          "local tier interval | durable tier interval | goodput 2 tiers / 1 | "
          "goodput 2 tiers, local copies | local disk per node, 1 / 2 copies |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"
          "---:|---:|")
    for name in args.models.split(","):
        model = MODELS[name]
        total = model.num_params() * BYTES_PER_PARAM
        for dp, tp in LAYOUTS[name]:
            world = dp * tp
            nodes = max(1, world // gpus)
            per_rank = total / world
            per_node = per_rank * min(world, gpus)
            stall = per_rank / (args.copy_gbps * 1e9)
            persist = {bw: per_node / (bw * 1e9) for bw in (1, 5, 20)}
            mtbf_s = args.node_mtbf_hours * 3600.0 / nodes
            interval, bound = optimal_interval(stall, mtbf_s, persist_seconds=persist[5])
            tiers = make_tier_cadence_plans(int(per_node), args.durable_gbps * 1e9,
                                            args.local_gbps * 1e9,
                                    node_mtbf_seconds=mtbf_s / args.node_loss_share,
                                    mtbf_seconds=mtbf_s, stall_seconds=stall)
            copied = make_tier_cadence_plans(int(per_node), args.durable_gbps * 1e9,
                                     args.local_gbps * 1e9,
                                     node_mtbf_seconds=mtbf_s / args.node_loss_share,
                                     mtbf_seconds=mtbf_s, stall_seconds=stall, replicas=2,
                                     num_nodes=nodes) if nodes > 1 else None
            layout = f"fsdp{dp}" + (f"xtp{tp}" if tp > 1 else "")
            print(f"| {name} | {layout} | {world} | {nodes} | {_fmt_b(total)} | "
                  f"{_fmt_b(per_rank)} | {_fmt_b(per_node)} | {_fmt_s(stall)} | "
                  f"{_fmt_s(persist[1])} | {_fmt_s(persist[5])} | {_fmt_s(persist[20])} | "
                  f"{mtbf_s / 3600:.1f} h | {interval / 60:.1f} min ({bound}) | "
                  f"{tiers.local.interval_seconds / 60:.1f} min | "
                  f"{tiers.durable.interval_seconds / 60:.1f} min | "
                  f"{100 * tiers.goodput:.2f}% / {100 * tiers.durable_only_goodput:.2f}% | "
                  f"{f'{100 * copied.goodput:.2f}%' if copied else '-'} | "
                  f"{_fmt_b(LOCAL_KEEP * per_node)} / "
                  f"{_fmt_b(2 * LOCAL_KEEP * per_node) if nodes > 1 else '-'} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="7b,70b", help="comma list of 7b, 70b, 405b")
    ap.add_argument("--ranks", default="8,16,32,64,128,256,512,1024,2048,4096")
    ap.add_argument("--tp", type=int, default=8, help="tensor-parallel degree (dp = ranks/tp)")
    ap.add_argument("--layers", type=int, default=1,
                    help="transformer layers simulated (results are scaled to the model's)")
    ap.add_argument("--fit-layers", action="store_true",
                    help="fit the whole model's figures on a second run with 4x the layers "
                         "(what grows with the ranks alone does not grow with the layers)")
    ap.add_argument("--check-layers", action="store_true",
                    help="also measure how cost grows with the layer count")
    ap.add_argument("--per-parameter-optim", action="store_true",
                    help="simulate the optimizer state before packing: every hyperparameter "
                         "and step counter once per parameter")
    ap.add_argument("--repeats", type=int, default=3,
                    help="steady-state saves timed per world size (the minimum counts)")
    ap.add_argument("--json", metavar="FILE",
                    help="also write one row per model and rank count (coordinator_s_per_save, "
                         "manifest_bytes_per_loading_rank, ...) to FILE")
    ap.add_argument("--sizing", action="store_true", help="print the sizing table instead")
    ap.add_argument("--copy-gbps", type=float, default=10.0,
                    help="host-copy bandwidth per rank for the stall (GB/s)")
    ap.add_argument("--durable-gbps", type=float, default=5.0,
                    help="sizing: the durable tier's write bandwidth per node (GB/s) in the "
                         "two-tier columns")
    ap.add_argument("--local-gbps", type=float, default=10.0,
                    help="sizing: the local tier's write bandwidth per node (GB/s)")
    ap.add_argument("--node-loss-share", type=float, default=0.5,
                    help="sizing: the share of failures that lose a node's local tier (0..1]")
    ap.add_argument("--node-mtbf-hours", type=float, default=6000.0,
                    help="mean time between failures of one node (hours); the job's is this "
                         "over the number of nodes")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    args = ap.parse_args(argv)
    if not 0 < args.node_loss_share <= 1:
        ap.error(f"--node-loss-share={args.node_loss_share:g}: pass a share in (0, 1]")
    if args.sizing:
        if args.models == "7b,70b":
            args.models = "7b,70b,405b"
        run_sizing(args)
    else:
        run_scale(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
