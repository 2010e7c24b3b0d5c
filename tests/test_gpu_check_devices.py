"""The devices section of bench/gpu_check.py (bench/_gpu_devices.py), checked without a GPU.

On 2 GPUs it shows that a rank's save leaves no CUDA context and no memory of its process
on the other GPU, and that a writer process sees no GPU. Here: its reading of NVML's
process list, its verdict on each kind of thing left behind (and on nothing), and that a
machine with one GPU skips it and says so.
tests/test_gpu_check_harness.py runs its 2-rank saves on CPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def devices():
    sys.path.insert(0, str(BENCH))
    try:
        import _gpu_devices
    finally:
        sys.path.remove(str(BENCH))
    return _gpu_devices


_LISTING = ("GPU:0\n"
            "process       4242 uses     1024.000 MB GPU memory\n"
            "process        777 uses      514.500 MB GPU memory")


def test_nvml_memory_of_one_process(devices):
    assert devices.process_memory_mb(_LISTING, 777) == 514.5
    assert devices.process_memory_mb(_LISTING, 77) == 0.0  # another pid: not a prefix match
    assert devices.process_memory_mb("GPU:1\nno processes are running", 777) == 0.0
    assert devices.process_memory_mb("pynvml module not found, please install nvidia-ml-py",
                                     777) is None


def _snap(contexts: dict[int, bool], memory: dict[int, float | None]) -> dict:
    return {"context": contexts, "memory_mb": memory}


def test_the_verdict_names_what_a_rank_left_on_another_gpu(devices):
    clean = _snap({0: False, 1: True}, {0: 0.0, 1: 600.0})  # rank 1: only its own GPU
    assert devices.foreign_device_problems(1, {"start": clean, "closed": clean}) == []
    context = _snap({0: True, 1: True}, {0: None, 1: None})  # NVML blind, the driver not
    memory = _snap({0: False, 1: True}, {0: 312.0, 1: 600.0})
    problems = devices.foreign_device_problems(
        1, {"start": clean, "prepared": context, "saved": memory})
    assert problems == ["after prepared: a CUDA context of this process on GPU 0",
                        "after saved: 312 MB of GPU 0 used by this process"]
    # Read back from a rank's JSON file, the GPU indices are strings.
    loaded = json.loads(json.dumps({"saved": memory}))
    assert devices.foreign_device_problems(1, loaded) == [
        "after saved: 312 MB of GPU 0 used by this process"]
    # Rank 0 holds GPU 0 itself: nothing of that is a problem.
    assert devices.foreign_device_problems(0, {"saved": _snap({0: True}, {0: 900.0})}) == []


@pytest.mark.parametrize("visible,problem", [
    ("", None),
    ("0,1", "the writer process {pid} sees GPUs (CUDA_VISIBLE_DEVICES=b'0,1')"),
    (None, "the writer process {pid} sees GPUs (CUDA_VISIBLE_DEVICES=None)")])
def test_the_verdict_on_a_writer_process_that_may_see_a_gpu(devices, visible, problem):
    """The writer_process scenario: a writer must be started with no GPU visible (read
    from its environment; NVML's memory of its pid is asked on CUDA only)."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    # Its environment is its own once it runs (a line on stdout says so), not its parent's.
    proc = subprocess.Popen(["sh", "-c", "echo up; exec sleep 30"], env=env,
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"up\n"
        found = devices._writer_problems(proc.pid, cuda=False)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert found == ([] if problem is None else [problem.format(pid=proc.pid)])
    assert devices._writer_problems(None, cuda=False) == ["no writer process is running"]


def test_one_gpu_skips_the_section_and_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(BENCH))  # gpu_check and its section modules
    import gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "one GPU")
    (tmp_path / "work").mkdir()
    code = gpu_check.main(["--only", "devices", "--dir", str(tmp_path / "work"),
                           "--out", str(tmp_path / "results")])
    assert code == 0
    assert "== devices: skipped: needs 2 GPUs, this machine has 1" in capsys.readouterr().out
    results = json.loads((tmp_path / "results" / "gpu_check.json").read_text())
    assert results["devices"]["skipped"] == "needs 2 GPUs, this machine has 1"
    assert results["devices"]["scenarios"] == [] and results["ok"]
    md = (tmp_path / "results" / "gpu_check.md").read_text()
    assert "Skipped: needs 2 GPUs, this machine has 1." in md
