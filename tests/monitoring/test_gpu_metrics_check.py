"""bench/gpu_check.py's metrics section, run on CPU as its own harness: a 2-rank trainer's
pages read while it trains, the GPU series unknown (no GPU here), the host's memory and the
collectives of its gloo ranks measured (a mixture of experts on ep2: FSDP2's and the
experts' all-to-alls). The GPU run (every GPU series non-zero) is
docs/monitoring.md's "On a GPU"; it has not run on a GPU yet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(420)


def test_metrics_section_passes_on_cpu(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--only", "metrics",
         "--metrics-device", "cpu", "--out", str(tmp_path), "--dir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    m = json.loads((tmp_path / "gpu_check.json").read_text())["metrics"]
    assert m["ok"] and m["world"] == 2 and len(m["ranks"]) == 2, m
    for rank in m["ranks"]:
        assert rank["values"]["train_gpu_known"] == 0 and rank["uuid"] == ""
        assert rank["values"]["train_host_memory_rss_bytes"] > 0
        for kind in ("all_gather", "reduce_scatter", "all_to_all"):  # a mixture on ep2
            assert rank["comm"][kind]["bytes"] > 0 and rank["comm"][kind]["seconds"] > 0
    assert "Hardware and communication metrics" in (tmp_path / "gpu_check.md").read_text()


def test_a_gpu_rank_without_nvml_or_with_zeros_fails_the_section():
    """The GPU verdict, on pages as a GPU rank would serve them."""
    sys.path.insert(0, str(ROOT / "bench"))
    from _gpu_metrics import check_rank, parse

    good = "\n".join([
        'train_gpu_known{rank="0"} 1.0',
        'train_gpu_info{Hostname="n0",UUID="GPU-a",gpu="0",modelName="H200",rank="0"} 1.0',
        'train_gpu_temperature_celsius{rank="0"} 41.0', 'train_gpu_power_watts{rank="0"} 180.5',
        'train_gpu_utilization_ratio{rank="0"} 0.6', 'train_gpu_memory_used_bytes{rank="0"} 3e9',
        'train_device_memory_allocated_bytes{rank="0"} 1e9',
        'train_device_memory_reserved_bytes{rank="0"} 2e9',
        'train_device_memory_peak_bytes{rank="0"} 1.5e9',
        'train_memory_used_bytes{memory="device",rank="0"} 3e9',
        'train_memory_limit_bytes{memory="device",rank="0"} 1.4e11',
        'train_memory_used_bytes{memory="host",rank="0"} 1e10',
        'train_memory_limit_bytes{memory="host",rank="0"} 1e11',
        'train_host_memory_rss_bytes{rank="0"} 2e9'])
    assert check_rank([parse(good)], "cuda", 1)["ok"]
    no_nvml = good.replace('train_gpu_known{rank="0"} 1.0', 'train_gpu_known{rank="0"} 0.0') \
        .replace("41.0", "NaN")
    problems = check_rank([parse(no_nvml)], "cuda", 1)["problems"]
    assert any("nvidia-ml-py" in p for p in problems)
    assert any("temperature" in p for p in problems)
    idle = good.replace("0.6", "0.0")
    assert not check_rank([parse(idle)], "cuda", 1)["ok"]
    assert check_rank([parse(idle), parse(good)], "cuda", 1)["ok"]  # busy in one reading
