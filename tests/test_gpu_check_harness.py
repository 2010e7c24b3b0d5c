"""bench/gpu_check.py's train, dtensor and devices sections, run on CPU (gloo) as their own
harness.

Without a GPU only the harness can be checked: the trainer killed after its first commit and
resumed bit for bit under torchrun, every process group on the backend it should have (the
checkpoint store's found wherever the package creates them), the staged FSDP2 and TP
shards of 1 and 2 ranks equal to the live ones, and the 2-rank saves of the devices section
(with and without ``prepare()``, and through a writer process that sees no GPU)
committed. The GPU run is docs/performance.md's "GPU".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(420)


def test_train_dtensor_and_devices_sections_pass_on_cpu(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--only", "train,dtensor,devices",
         "--train-device", "cpu", "--dtensor-device", "cpu", "--devices-device", "cpu",
         "--steps", "20",
         "--interval", "5", "--dir", str(tmp_path), "--out", str(tmp_path / "results")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    report = (tmp_path / "results" / "gpu_check.json")
    results = json.loads(report.read_text()) if report.exists() else {}
    assert proc.returncode == 0, (json.dumps(results.get("train"), indent=1)
                                  + proc.stdout[-4000:] + proc.stderr[-4000:])
    train = results["train"]
    assert train["bit_for_bit"] and train["losses_equal"] and train["resume_line"]
    assert train["training_backends"] == ["gloo"] and train["manager_backends"] == ["gloo"]
    assert train["backends_ok"]
    assert [e["world"] for e in results["dtensor"]] == [1, 2]
    for entry in results["dtensor"]:
        assert entry["ok"] and len(entry["ranks"]) == entry["world"]
        for rank in entry["ranks"]:
            assert set(rank["layouts"]) == {"fsdp2", "tp"}
    devices = results["devices"]
    assert devices["ok"] and devices["skipped"] is None
    assert [e["scenario"] for e in devices["scenarios"]] == ["maybe_save", "prepare",
                                                             "writer_process"]
    for entry in devices["scenarios"]:
        assert [r["rank"] for r in entry["ranks"]] == [0, 1]
        assert all(r["ok"] and not r["problems"] for r in entry["ranks"]), entry
    md = (tmp_path / "results" / "gpu_check.md").read_text()
    assert "| 2 | 1 | tp |" in md and "| maybe_save | 1 | cpu | PASS |" in md
