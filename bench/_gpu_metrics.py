"""gpu_check's metrics section: a trainer's hardware and communication series, read from its
ranks' ``/metrics`` while it trains, must be known and non-zero on a GPU.

The trainer (``configs/tiny.toml``, widened so its kernels keep the GPU busy, bf16, FSDP2)
runs under torchrun on ``world`` ranks of ``device`` with metrics on; after its warm-up each
rank's page is read a few times (NVML's utilization is a share of its last sample period:
one reading may fall between kernels), then the job is stopped. On ``cuda`` every rank must
serve ``train_gpu_known`` 1, a GPU with a UUID (``train_gpu_info``), and non-zero
temperature, power, utilization (in one of the readings), NVML memory, the allocator's
allocated, reserved and peak bytes and the device's used and total memory; with 2 ranks
(the model then a mixture of experts split over them, ``parallel.ep`` = 2), non-zero bytes
and seconds of FSDP2's all-gathers and reduce-scatters and of the experts' all-to-alls.
``cpu`` checks the harness: the device and NVML series unknown (NaN, ``train_gpu_known``
0), the host's memory known, the collectives of 2 gloo ranks measured.
"""

from __future__ import annotations

import math
import re
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

_SAMPLE = re.compile(r"^(train_\w+)(?:\{([^}]*)\})? (\S+)$", re.M)
GPU_SERIES = ("train_gpu_temperature_celsius", "train_gpu_power_watts",
              "train_gpu_memory_used_bytes", "train_device_memory_allocated_bytes",
              "train_device_memory_reserved_bytes", "train_device_memory_peak_bytes")
WIDER = ("--model.dim=512", "--model.n_layers=4", "--model.n_heads=8", "--model.ffn_dim=2048",
         "--model.max_seq_len=256", "--training.seq_len=256")
MOE = ("--model.n_experts=4", "--model.experts_per_token=2")  # with parallel.ep = world
COLLECTIVES = ("all_gather", "reduce_scatter", "all_to_all")  # measured on 2 ranks


def parse(page: str) -> dict[tuple[str, tuple], float]:
    """``{(name, sorted label pairs): value}`` of a ``/metrics`` page's ``train_`` samples."""
    out = {}
    for name, labels, value in _SAMPLE.findall(page):
        pairs = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', labels or "")))
        out[(name, pairs)] = float(value)
    return out


def _one(samples: dict, name: str, **labels: str) -> float:
    for (n, pairs), value in samples.items():
        if n == name and all((k, v) in pairs for k, v in labels.items()):
            return value
    return math.nan


def _ports(world: int) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            for p in range(base + 1, base + world):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue


def check_rank(readings: list[dict], device: str, world: int) -> dict[str, Any]:
    """One rank's verdict from its ``readings`` (parsed pages, oldest first)."""
    last = readings[-1]
    problems = []
    info = [dict(pairs) for (n, pairs) in last if n == "train_gpu_info"]
    uuid = info[0].get("UUID", "") if info else ""
    if device == "cuda":
        if _one(last, "train_gpu_known") != 1:
            problems.append("train_gpu_known is not 1 (is nvidia-ml-py installed? pip "
                            "install 'ckpt[nvml]')")
        if not uuid:
            problems.append("train_gpu_info has no UUID")
        for name in GPU_SERIES:
            if not _one(last, name) > 0:
                problems.append(f"{name} = {_one(last, name)}")
        for what in ("used", "limit"):
            value = _one(last, f"train_memory_{what}_bytes", memory="device")
            if not value > 0:
                problems.append(f"train_memory_{what}_bytes{{memory=device}} = {value}")
        util = max((_one(r, "train_gpu_utilization_ratio") for r in readings),
                   key=lambda v: -1 if math.isnan(v) else v)
        if not util > 0:
            problems.append(f"train_gpu_utilization_ratio never above 0 ({util})")
    else:
        if _one(last, "train_gpu_known") != 0:
            problems.append("train_gpu_known is not 0 without a GPU")
        for name in GPU_SERIES:
            if not math.isnan(_one(last, name)):
                problems.append(f"{name} = {_one(last, name)}, not NaN, without a GPU")
    for what in ("used", "limit"):
        if not _one(last, f"train_memory_{what}_bytes", memory="host") > 0:
            problems.append(f"train_memory_{what}_bytes{{memory=host}} is not above 0")
    if not _one(last, "train_host_memory_rss_bytes") > 0:
        problems.append("train_host_memory_rss_bytes is not above 0")
    comm = {}
    if world > 1:
        for kind in COLLECTIVES:
            nbytes = _one(last, "train_comm_bytes_total", kind=kind)
            seconds = _one(last, "train_comm_seconds_total", kind=kind)
            comm[kind] = {"bytes": nbytes, "seconds": seconds,
                          "bytes_per_second": nbytes / seconds if seconds > 0 else None}
            if not (nbytes > 0 and seconds > 0):
                problems.append(f"{kind}: {nbytes} bytes in {seconds} s")
    values = {name: _one(last, name) for name in (*GPU_SERIES, "train_gpu_known",
                                                  "train_gpu_utilization_ratio",
                                                  "train_host_memory_rss_bytes")}
    return {"uuid": uuid, "values": values, "comm": comm, "problems": problems,
            "ok": not problems}


def metrics_check(work: Path, device: str, world: int) -> dict[str, Any]:
    """Run the section (see the module docstring); ``{"ranks": [...], "ok": bool}``."""
    gpu = device == "cuda"
    steps_before, pause = (30, 1.0) if gpu else (10, 0.2)  # the harness: nothing to wait for
    from tests.e2e._jobs import Job, base_env, trainer_argv

    work.mkdir(parents=True, exist_ok=True)
    port, jsonl = _ports(world), work / "events.jsonl"
    argv = trainer_argv(f"--training.device={device}", "--parallel.dp_mode=fsdp",
                        "--training.steps=100000000", "--training.log_every=1000",
                        *(("--training.mixed_precision=bf16", *WIDER) if gpu else ()),
                        *((*MOE, f"--parallel.ep={world}") if world > 1 else ()),
                        f"--metrics.port={port}", "--metrics.host=127.0.0.1",
                        f"--metrics.jsonl_path={jsonl}", nproc=world)
    job = Job(argv, work / "logs", "metrics", jsonl, env=base_env())
    out: dict[str, Any] = {"device": device, "world": world, "ok": False}
    try:
        job.wait_step(steps_before, timeout=300)
        readings: list[list[dict]] = [[] for _ in range(world)]
        for _ in range(5):
            for rank in range(world):
                with urllib.request.urlopen(f"http://127.0.0.1:{port + rank}/metrics",
                                            timeout=10) as r:
                    readings[rank].append(parse(r.read().decode()))
            time.sleep(pause)
        out["ranks"] = [check_rank(r, device, world) for r in readings]
        out["ok"] = all(r["ok"] for r in out["ranks"])
    except AssertionError as exc:
        out["error"] = str(exc)[-3000:]
    finally:
        job.kill_all()
    return out


def rows(result: dict[str, Any]) -> list[str]:
    """The section's lines of gpu_check.md."""
    lines = [f"Hardware and communication metrics, the trainer on {result['world']} rank(s) "
             f"of {result['device']} (each rank's /metrics):", "",
             "| rank | GPU | temperature, C | power, W | utilization | NVML memory | "
             "allocated / reserved / peak | collectives' bandwidth | problems |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rank, r in enumerate(result.get("ranks") or []):
        v = r["values"]
        bw = ", ".join(f"{k} {c['bytes_per_second'] / 1e9:.2f} GB/s"
                       for k, c in r["comm"].items() if c["bytes_per_second"]) or "-"
        lines.append(
            f"| {rank} | {r['uuid'] or '-'} | {v['train_gpu_temperature_celsius']:g} | "
            f"{v['train_gpu_power_watts']:g} | {v['train_gpu_utilization_ratio']:g} | "
            f"{v['train_gpu_memory_used_bytes']:g} | "
            f"{v['train_device_memory_allocated_bytes']:g} / "
            f"{v['train_device_memory_reserved_bytes']:g} / "
            f"{v['train_device_memory_peak_bytes']:g} | {bw} | "
            f"{'; '.join(r['problems']) or 'none'} |")
    if result.get("error"):
        lines.append(f"\n! {result['error'][:500]}")
    lines += ["", f"**{'PASS' if result['ok'] else 'FAIL'}**", ""]
    return lines
