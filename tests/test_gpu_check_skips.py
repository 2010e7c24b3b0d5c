"""scripts/gpu_check.sh on a machine without CUDA: says it skipped and exits 0 within seconds.

CUDA is hidden (CUDA_VISIBLE_DEVICES="") so the test means the same on a GPU machine; the
full check runs there by hand (docs/performance.md, "GPU").
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(90)


def test_gpu_check_skips_without_cuda(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--out",
                           str(tmp_path / "results")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpu_check: skipped: no CUDA device" in proc.stdout, proc.stdout + proc.stderr
    assert not (tmp_path / "results").exists()  # nothing measured, nothing written


def test_gpu_check_help_lists_its_options():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--help"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    assert "--sizes" in proc.stdout and "--only" in proc.stdout
