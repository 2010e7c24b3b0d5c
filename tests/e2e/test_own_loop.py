"""The README's own-loop example, run as written under torchrun: resume is bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from ckpt.export._consolidate import consolidate

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "own_loop.py"


def _torchrun(root: Path, steps: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(EXAMPLE), str(root), str(steps)],
        env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_readme_shows_the_example_verbatim():
    code = EXAMPLE.read_text()
    a = code.index("    # --- the checkpointing part")
    b = code.index("    # ------------------------------------------------------------\n")
    snippet = "\n".join(line[4:] for line in code[a:b].rstrip("\n").split("\n"))
    assert snippet in (ROOT / "README.md").read_text()


def test_own_loop_resumes_bit_for_bit(tmp_path):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    _torchrun(straight, 30)
    _torchrun(interrupted, 20)           # stops after step 20 (checkpoints 10 and 20)
    _torchrun(interrupted, 30)           # the same program again: resumes from step 20
    a, ma = consolidate(str(straight), 30)
    b, mb = consolidate(str(interrupted), 30)
    assert ma.step == mb.step == 30
    assert a["progress"]["step"] == b["progress"]["step"] == 30
    for key in ("weight", "bias"):
        wa = a["app"]["model"][f"module.{key}"] if f"module.{key}" in a["app"]["model"] \
            else a["app"]["model"][key]
        wb = b["app"]["model"][f"module.{key}"] if f"module.{key}" in b["app"]["model"] \
            else b["app"]["model"][key]
        assert torch.equal(wa, wb), key
    # The RNG streams were restored too, so the optimizer state matches as well.
    fa = {k: v for k, v in a["app"]["optim"].items()}
    fb = {k: v for k, v in b["app"]["optim"].items()}
    assert fa.keys() == fb.keys()
