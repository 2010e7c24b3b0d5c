"""Shared pieces of the benchmark: the synthetic state, interleaved timing, machine facts.

Noise on these machines is large (the same copy can take 47 ms or 405 ms a minute apart),
so contenders are never timed in separate blocks: :func:`interleave` runs one sample of
every contender per round (A B C, then B C A, ...), and ratios are taken per round
(``A_i / B_i``, both measured within seconds of each other) before the median.
"""

from __future__ import annotations

import gc
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

GiB = 1 << 30
MiB = 1 << 20
WARMUP_ROUNDS = 1  # set from --warmup


# -- the state -------------------------------------------------------------------------------
def make_state(total_bytes: int, num_tensors: int, seed: int = 0) -> dict[str, Any]:
    """A model-like state dict of ~``total_bytes`` in ``num_tensors`` float tensors.

    Shapes vary like a transformer's: a few large matrices, many mid-sized ones of different
    widths, and small 1-D vectors (norms, biases). Values are random (not zeros) so every
    page is really touched. Plus two small non-tensor entries (as a scheduler or step
    counter would add).
    """
    num_tensors = max(1, num_tensors)
    gen = torch.Generator().manual_seed(seed)
    elem = 4  # float32
    total_elems = max(num_tensors, total_bytes // elem)
    widths = [4096, 1024, 3072, 2048, 512, 8192]
    # One in four tensors is a small vector; the others share the bytes with varied weights.
    num_vectors = num_tensors // 4
    num_mats = num_tensors - num_vectors
    vec_elems = [min(4096, max(1, total_elems // (64 * num_tensors))) for _ in range(num_vectors)]
    weights = [1.0 + 7.0 * ((i * 2654435761) % 1000) / 1000.0 for i in range(num_mats)]
    budget = total_elems - sum(vec_elems)
    shapes: list[tuple[int, ...]] = []
    for i, w in enumerate(weights):
        n = max(1, int(budget * w / sum(weights)))
        cols = min(widths[i % len(widths)], n)
        shapes.append((max(1, n // cols), cols))
    model: dict[str, torch.Tensor] = {}
    vi = mi = 0
    for i in range(num_tensors):
        if (i % 4 == 3 and vi < num_vectors) or mi >= num_mats:
            model[f"layers.{i // 4}.norm_{i}.weight"] = torch.randn(vec_elems[vi], generator=gen)
            vi += 1
        else:
            model[f"layers.{i // 4}.proj_{i}.weight"] = torch.randn(shapes[mi], generator=gen)
            mi += 1
    return {"model": model, "extra": {"step": 1, "lr": 3e-4, "note": "bench"}}


def tensors_of(state: dict[str, Any]) -> list[torch.Tensor]:
    """Every tensor of ``state`` in state-dict traversal order."""
    out: list[torch.Tensor] = []

    def visit(v):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                visit(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)

    visit(state)
    return out


def state_nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


# -- timing ----------------------------------------------------------------------------------
@dataclass
class Contender:
    """One way of doing something. ``run()`` returns seconds, or a dict of named seconds."""

    name: str
    run: Callable[[], float | dict[str, float]]
    after: Callable[[], None] | None = None  # untimed cleanup after each sample
    samples: dict[str, list[float | None]] = field(default_factory=dict)
    error: str | None = None


def _metrics(result: float | dict[str, float], name: str) -> dict[str, float]:
    if isinstance(result, dict):
        return {f"{name}.{k}" if k else name: float(v) for k, v in result.items()}
    return {name: float(result)}


def interleave(contenders: list[Contender], repeats: int, *, log=print,
               before_each: Callable[[], None] | None = None,
               warmup: int | None = None) -> dict[str, list[float | None]]:
    """Run every contender once per round, rotating the order each round.

    ``warmup`` rounds (default ``WARMUP_ROUNDS``) run first and are discarded: the first
    samples pay for thread pools, imports, file-system metadata and allocator growth.
    Returns ``{metric: [sample per round or None]}``; aligned by round so per-round ratios
    compare samples taken moments apart. A contender that raises is reported once and
    dropped from later rounds; the others go on.
    """
    warmup = WARMUP_ROUNDS if warmup is None else warmup
    if warmup:
        log(f"  ({warmup} warm-up round(s), discarded)")
        interleave(contenders, warmup, log=lambda *_: None, before_each=before_each, warmup=0)
        for c in contenders:
            if c.error is not None:
                log(f"  ! {c.name} failed in the warm-up: {c.error}")
    out: dict[str, list[float | None]] = {}
    alive = list(contenders)
    for r in range(repeats):
        k = r % max(1, len(alive))
        order = alive[k:] + alive[:k]
        for c in order:
            if c.error is not None:
                continue
            gc.collect()
            if before_each is not None:
                before_each()
            try:
                res = _metrics(c.run(), c.name)
            except Exception as exc:  # noqa: BLE001 - one contender must not stop the run
                c.error = f"{type(exc).__name__}: {exc}"
                log(f"  ! {c.name} failed: {c.error}")
                log("    " + traceback.format_exc().strip().replace("\n", "\n    ")[-1500:])
                res = {}
            finally:
                if c.after is not None:
                    try:
                        c.after()
                    except Exception as exc:  # noqa: BLE001
                        log(f"  ! cleanup after {c.name} failed: {exc}")
            for key, v in res.items():
                out.setdefault(key, [None] * repeats)[r] = v
        done = ", ".join(f"{k}={v[r]:.3f}s" for k, v in out.items() if v[r] is not None)
        log(f"  round {r + 1}/{repeats}: {done}")
    return out


def median(xs) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else None


def paired_ratio(a: list[float | None], b: list[float | None]) -> float | None:
    """Median over rounds of ``a_i / b_i`` (rounds where both were measured)."""
    rs = [x / y for x, y in zip(a, b) if x is not None and y is not None and y > 0]
    return statistics.median(rs) if rs else None


def round_min(*series: list[float | None]) -> list[float | None]:
    """Per-round minimum of several series (e.g. the best of two floors, round by round)."""
    out = []
    for vals in zip(*series):
        vals = [v for v in vals if v is not None]
        out.append(min(vals) if vals else None)
    return out


_SCRUB: list = []


def scrub_cpu_caches(nbytes: int = 96 * MiB) -> None:
    """Evict the CPU caches (read and write a buffer larger than any L3), so that no
    contender inherits a warm cache from the one before it."""
    if not _SCRUB:
        _SCRUB.append(torch.ones(nbytes // 4))
    _SCRUB[0].add_(1.0)


# -- the machine -----------------------------------------------------------------------------
def drop_page_cache() -> bool:
    """Flush dirty pages and drop the page cache; False when not allowed here."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def mem_available() -> int:
    return _meminfo().get("MemAvailable", 0)


def _disk_of(path: str) -> dict[str, Any]:
    usage = shutil.disk_usage(path)
    dev, fstype = "?", "?"
    best = ""
    try:
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and real.startswith(parts[1]) and len(parts[1]) >= len(best):
                    best, dev, fstype = parts[1], parts[0], parts[2]
    except OSError:
        pass
    rotational = None
    name = os.path.basename(dev)
    for cand in (name, name.rstrip("0123456789")):
        p = f"/sys/block/{cand}/queue/rotational"
        if os.path.exists(p):
            with open(p) as f:
                rotational = f.read().strip() == "1"
            break
    return {"path": path, "device": dev, "fstype": fstype, "mount": best,
            "total_gib": round(usage.total / GiB, 1), "free_gib": round(usage.free / GiB, 1),
            "rotational": rotational}


def machine_info(work_dir: str) -> dict[str, Any]:
    cpu_model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = _meminfo()
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("fsspec", "s3fs", "moto", "numpy", "crc32c", "botocore"):
        try:
            versions[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception:  # noqa: BLE001
            versions[mod] = "missing"
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {
        "cpu_model": cpu_model, "cpu_count": os.cpu_count(), "cpus_usable": affinity,
        "torch_threads": torch.get_num_threads(),
        "mem_total_gib": round(mem.get("MemTotal", 0) / GiB, 1),
        "mem_available_gib": round(mem.get("MemAvailable", 0) / GiB, 1),
        "disk": _disk_of(work_dir), "kernel": platform.release(),
        "loadavg_start": list(os.getloadavg()), "versions": versions,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "git_commit": _git_commit(),
    }


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except Exception:  # noqa: BLE001
        return None


def fmt_bytes(n: float) -> str:
    if n >= GiB:
        return f"{n / GiB:.3g} GiB"
    return f"{n / MiB:.3g} MiB"


def rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def now() -> float:
    return time.perf_counter()
