"""The hardware and communication series: what a CPU rank serves (memory known, the GPU
unknown, never an error), a GPU source's readings (a recorded NVML reading: no GPU here),
the host's memory from /proc or a memory cgroup, and the collectives the trainer measures on
real gloo ranks (DDP, FSDP2, a pipeline, expert parallelism's all-to-alls), counted by the
exporter from the step events."""

from __future__ import annotations

import math
import socket

import pytest
import torch

from ckpt.events import COMM_KINDS, EventBus
from monitoring import Metrics
from monitoring.hardware import GpuReading, NvmlGpu, host_memory
from tests.dist import run_ranks
from tests.monitoring.test_metrics import _samples, _value


class _Gpu:
    """A GPU source replaying recorded NVML readings (``monitoring.hardware.GpuSource``)."""

    identity = {"Hostname": "gpu-node-0", "gpu": "3", "UUID": "GPU-0000aaaa-bbbb",
                "modelName": "NVIDIA H100 80GB HBM3"}

    def __init__(self, reading):
        self.reading = reading

    def read(self):
        if isinstance(self.reading, Exception):
            raise self.reading
        return self.reading


def _info(m: Metrics) -> dict[str, str]:
    (labels,) = [dict(labels) for name, labels in _samples(m) if name == "train_gpu_info"]
    return labels


def test_a_cpu_rank_serves_every_series_memory_known_the_gpu_unknown():
    m = Metrics(rank=1)
    for name in ("train_device_memory_allocated_bytes", "train_device_memory_reserved_bytes",
                 "train_device_memory_peak_bytes", "train_gpu_temperature_celsius",
                 "train_gpu_power_watts", "train_gpu_utilization_ratio",
                 "train_gpu_memory_used_bytes"):
        assert math.isnan(_value(m, name)), name
    assert math.isnan(_value(m, "train_memory_used_bytes", memory="device"))
    assert math.isnan(_value(m, "train_memory_limit_bytes", memory="device"))
    assert _value(m, "train_gpu_known") == 0
    assert _info(m) == {"rank": "1", "Hostname": socket.gethostname(), "gpu": "", "UUID": "",
                        "modelName": ""}
    rss, peak = _value(m, "train_host_memory_rss_bytes"), _value(m, "train_host_memory_peak_bytes")
    assert 10 << 20 < rss <= peak
    used, limit = (_value(m, name, memory="host") for name in ("train_memory_used_bytes",
                                                               "train_memory_limit_bytes"))
    assert 0 < used < limit


def test_resident_memory_follows_a_growing_allocation():
    m = Metrics()
    before = _value(m, "train_host_memory_rss_bytes")
    kept = bytearray(b"\x01") * (256 << 20)  # written: resident
    grown = _value(m, "train_host_memory_rss_bytes") - before
    # At least half of it: pages the process freed earlier (other tests in this worker)
    # may already be resident and be reused.
    assert grown >= 128 << 20, grown
    assert _value(m, "train_host_memory_peak_bytes") >= before + grown
    del kept


def test_a_gpu_source_is_served_and_a_failing_one_reads_unknown():
    gpu = _Gpu(GpuReading(temperature_celsius=71.0, power_watts=float("nan"),
                          utilization_ratio=0.93, memory_used_bytes=70e9))
    m = Metrics(rank=0, gpu=gpu)
    assert _value(m, "train_gpu_known") == 1
    assert _value(m, "train_gpu_temperature_celsius") == 71.0
    assert math.isnan(_value(m, "train_gpu_power_watts"))  # one field NVML cannot read
    assert _value(m, "train_gpu_utilization_ratio") == 0.93
    assert _value(m, "train_gpu_memory_used_bytes") == 70e9
    assert _info(m) == {"rank": "0", **_Gpu.identity}
    gpu.reading = None  # no answer now
    assert _value(m, "train_gpu_known") == 0
    assert math.isnan(_value(m, "train_gpu_temperature_celsius"))
    gpu.reading = RuntimeError("NVML: GPU is lost")  # a scrape never fails on it
    assert _value(m, "train_gpu_known") == 0
    assert _info(m)["UUID"] == _Gpu.identity["UUID"]


def test_without_nvidia_ml_py_or_nvml_the_gpu_is_unknown_not_an_error():
    """NvmlGpu.open never raises: nvidia-ml-py absent (as here), or NVML without a GPU."""
    assert NvmlGpu.open(torch.device("cuda", 0)) is None


def _cgroup_tree(tmp_path, *, v2: bool, limit: str, usage: int, inactive: int,
                 total_kib: int = 64 << 20):
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       {total_kib} kB\n"
                                  f"MemFree:        1000 kB\nMemAvailable:   {total_kib // 2} kB\n")
    if v2:
        (proc / "self" / "cgroup").write_text("0::/job.slice/step_0\n")
        d = cg / "job.slice" / "step_0"
        d.mkdir(parents=True)
        (d / "memory.max").write_text(limit + "\n")
        (d / "memory.current").write_text(f"{usage}\n")
        (d / "memory.stat").write_text(f"anon 1\ninactive_file {inactive}\nactive_file 5\n")
    else:
        (proc / "self" / "cgroup").write_text("5:cpu:/\n4:memory:/slurm/uid_0/job_7\n")
        d = cg / "memory" / "slurm" / "uid_0" / "job_7"
        d.mkdir(parents=True)
        (d / "memory.limit_in_bytes").write_text(limit + "\n")
        (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (d / "memory.stat").write_text(f"cache 3\ntotal_inactive_file {inactive}\n")
    return str(proc), str(cg)


@pytest.mark.parametrize("v2", [True, False], ids=["cgroup-v2", "cgroup-v1"])
def test_host_memory_is_the_cgroups_when_it_limits_below_the_host(tmp_path, v2):
    gib = 1 << 30
    proc, cg = _cgroup_tree(tmp_path, v2=v2, limit=str(8 * gib), usage=3 * gib,
                            inactive=gib)
    assert host_memory(proc, cg) == (2 * gib, 8 * gib)  # working set: usage - inactive file
    # No limit (v2 "max", v1's huge number): the host's MemTotal - MemAvailable, MemTotal.
    unlimited = "max" if v2 else str(2**63 - 4096)
    proc, cg = _cgroup_tree(tmp_path / "u", v2=v2, limit=unlimited, usage=3 * gib,
                            inactive=gib)
    assert host_memory(proc, cg) == (32 * gib, 64 * gib)


def test_host_memory_unreadable_is_unknown(tmp_path):
    used, limit = host_memory(str(tmp_path / "no-proc"), str(tmp_path / "no-cgroup"))
    assert math.isnan(used) and math.isnan(limit)


def test_collectives_from_the_step_events_are_counted_by_kind():
    bus = EventBus()
    m = Metrics(bus)
    assert set(COMM_KINDS) == {"all_reduce", "reduce_scatter", "all_gather", "send_recv",
                               "all_to_all"}
    for kind in COMM_KINDS:  # every kind from start-up
        assert _value(m, "train_comm_bytes_total", kind=kind) == 0
        assert _value(m, "train_comm_seconds_total", kind=kind) == 0
    for step in (1, 2):
        bus.emit("train_step", step, loss=1.0, step_seconds=0.1,
                 comm_bytes={"all_gather": 1000, "send_recv": 10, "all_to_all": 5,
                             "broadcast": 7},
                 comm_seconds={"all_gather": 0.25, "all_to_all": 0.125})
    assert _value(m, "train_comm_bytes_total", kind="all_gather") == 2000
    assert _value(m, "train_comm_seconds_total", kind="all_gather") == 0.5
    assert _value(m, "train_comm_bytes_total", kind="send_recv") == 20
    assert _value(m, "train_comm_seconds_total", kind="send_recv") == 0
    assert _value(m, "train_comm_bytes_total", kind="all_to_all") == 10
    assert _value(m, "train_comm_seconds_total", kind="all_to_all") == 0.25
    assert not [name for name, labels in _samples(m) if ("kind", "broadcast") in labels]


# -- the trainer's measurements, on real gloo ranks ---------------------------------------------
def _measure(rank: int, world: int, layout: dict) -> dict:
    from tests.trainer._parallel_worker import MODEL, SEED, layout as make_layout
    from trainer.mesh import build_mesh
    from trainer.parallelize import build_parallel_model

    par = make_layout(**layout)
    pm = build_parallel_model(MODEL, par, build_mesh(par, "cpu"), SEED, "cpu")
    x = torch.randint(0, MODEL.vocab_size, (8 // par.dp, 16))
    pm.forward_backward(x, (3 * x + 1) % MODEL.vocab_size)
    nbytes, seconds = pm.comm.take()
    again = pm.comm.take()
    params = sum(p.numel() * p.element_size() for part in pm.model_parts
                 for p in part.parameters())
    full = sum(p.numel() * p.element_size() for p in _full_params(pm))
    return {"bytes": nbytes, "seconds": seconds, "again": again, "local_param_bytes": params,
            "full_param_bytes": full}


def _full_params(pm):
    from torch.distributed.tensor import DTensor

    for part in pm.model_parts:
        for p in part.parameters():
            yield p.full_tensor() if isinstance(p, DTensor) else p


def test_ddp_bucket_all_reduces_are_measured():
    for r in run_ranks(_measure, 2, dict(dp=2, dp_mode="ddp")):
        # Every gradient once, in DDP's buckets; timed; nothing else; taken once.
        assert r["bytes"] == {"all_reduce": r["local_param_bytes"]}, r
        assert set(r["seconds"]) == {"all_reduce"} and r["seconds"]["all_reduce"] > 0
        assert r["again"] == ({}, {})


def test_fsdp_all_gathers_and_reduce_scatters_are_measured():
    for r in run_ranks(_measure, 2, dict(dp=2)):
        # Each parameter gathered whole at least once (forward; resharded blocks again in
        # backward) and its gradient reduce-scattered from the whole (shards may be padded).
        assert r["bytes"]["all_gather"] >= r["full_param_bytes"], r
        assert r["full_param_bytes"] <= r["bytes"]["reduce_scatter"] \
            < 1.1 * r["full_param_bytes"], r
        assert set(r["seconds"]) == {"all_gather", "reduce_scatter"}
        assert all(v > 0 for v in r["seconds"].values())


def _measure_experts(rank: int, world: int) -> dict:
    """ep2 on 2 ranks (the tiny MoE: 4 experts, 2 per rank), one forward and backward, then
    again with every MoE block recomputed: what the meter took, and the router's rows per
    expert on this rank's tokens."""
    from tests.trainer._parallel_worker import MOE, SEED, layout
    from trainer.mesh import build_mesh
    from trainer.parallelize import build_parallel_model

    par = layout(MOE, dp=2, ep=2)
    x = torch.randint(0, MOE.vocab_size, (8 // par.dp, 16), generator=torch.Generator()
                      .manual_seed(rank))
    out, grads = {}, []
    for recomputed in ((), MOE.moe_layer_ids):
        pm = build_parallel_model(MOE, par, build_mesh(par, "cpu"), SEED, "cpu",
                                  recomputed_layers=recomputed)
        loss = pm.forward_backward(x, (3 * x + 1) % MOE.vocab_size)
        nbytes, seconds = pm.comm.take()
        tokens = {layer: stats.tokens_per_expert for part in pm.model_parts
                  for layer, stats in part.take_router_stats().items()}
        out["recomputed" if recomputed else "plain"] = {"bytes": nbytes, "seconds": seconds,
                                                        "tokens": tokens, "loss": loss}
        grads.append([g.to_local() if hasattr(g, "to_local") else g
                      for g in (p.grad for p in pm.parameters())])
    out["same_gradients"] = len(grads[0]) == len(grads[1]) > 0 and all(
        (a is None and b is None) or torch.equal(a, b) for a, b in zip(*grads))
    return out


def test_expert_parallel_all_to_alls_are_measured():
    """Each rank's all_to_all bytes are the rows it sends to the other rank, exactly: in
    dispatch its rows for the other rank's experts, in combine the other rank's rows its
    own experts ran; the same again in backward, and once more for a recomputed block."""
    from tests.trainer._parallel_worker import MOE

    results = run_ranks(_measure_experts, 2)
    row_bytes = MOE.dim * 4  # fp32 activations
    for rank, r in enumerate(results):
        plain = r["plain"]
        mine = range(2 * rank, 2 * rank + 2)  # 4 experts over ep2: rank r holds 2r, 2r+1
        other = results[1 - rank]["plain"]["tokens"]
        sent = sum(sum(n for e, n in enumerate(tokens) if e not in mine)
                   + sum(n for e, n in enumerate(other[layer]) if e in mine)
                   for layer, tokens in plain["tokens"].items())
        assert set(plain["tokens"]) == set(MOE.moe_layer_ids) and sent > 0, plain
        assert plain["bytes"]["all_to_all"] == 2 * sent * row_bytes, (rank, plain, sent)
        assert plain["seconds"]["all_to_all"] > 0
        assert {"all_gather", "reduce_scatter"} <= set(plain["bytes"])  # FSDP2's beside it
        again = r["recomputed"]
        assert again["bytes"]["all_to_all"] == 3 * sent * row_bytes, (rank, again, sent)
        assert again["seconds"]["all_to_all"] > 0
        # The exchanges' backward under recomputation gives the same gradients, bit for bit.
        assert again["loss"] == plain["loss"] and r["same_gradients"]


def test_a_pipelines_sends_are_counted_and_its_gradient_all_reduce_timed():
    for r in run_ranks(_measure, 4, dict(pp=2, dp=2, dp_mode="ddp", pp_schedule="gpipe",
                                         n_microbatches=2)):
        assert r["bytes"]["send_recv"] > 0 and "send_recv" not in r["seconds"], r
        assert r["bytes"]["all_reduce"] == r["local_param_bytes"], r
        assert r["seconds"]["all_reduce"] > 0
