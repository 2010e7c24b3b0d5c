"""Host memory under a budget: a state larger than ``staging_budget_bytes`` is saved in
pieces, never with more host memory than the budget.

The resident memory of a saving process is measured (VmHWM over the baseline, in a fresh
process per case: ``tests/ckpt/dcp/_budget_child.py``): with a budget of a quarter of a 64 MiB
state, three saves raise the peak by less than the budget plus 4 MiB of allocator slack (one
whole copy without it), each
save returns with its step committed (the stall is the whole save), and the checkpoint loads
bit for bit. A budget that is not a positive number of bytes is refused naming the option.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import ckpt
from ckpt.dcp import StagingBuffers
from tests.ckpt.dcp import _budget_child as child
from tests.ckpt._helpers import assert_same

# What a save allocates besides staging copies (thread stacks, manifest and index bytes,
# allocator arenas a loaded machine leaves unreturned): measured at 2-4 MiB over the arena.
# Without a budget the peak is a whole 64 MiB copy, so the bound still tells the two apart.
ALLOCATOR_SLACK = 4 << 20

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _run(root: str, budget: int | None) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.ckpt.dcp._budget_child", root,
         "none" if budget is None else str(budget)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_state_over_the_budget_never_takes_more_host_memory_than_the_budget(tmp_path):
    budget = child.STATE_BYTES // 4
    out = _run(str(tmp_path / "root"), budget)
    if not out["peak_reset"]:
        pytest.skip("the peak resident memory cannot be reset here (/proc/self/clear_refs)")
    assert out["peak_growth"] <= budget + ALLOCATOR_SLACK, out
    assert out["arena_bytes"] <= budget and out["unstaged_bytes"] > 0, out
    assert out["committed_on_return"], out
    loaded = child.state(0)
    ckpt.load(loaded, str(tmp_path / "root"), 3)
    assert_same(child.state(1)["model"], loaded["model"])
    assert loaded["step"] == 3


def test_without_a_budget_a_save_holds_one_whole_copy(tmp_path):
    """The reference the budget is measured against (and what it bounds)."""
    out = _run(str(tmp_path / "root"), None)
    if not out["peak_reset"]:
        pytest.skip("the peak resident memory cannot be reset here (/proc/self/clear_refs)")
    assert out["peak_growth"] >= child.STATE_BYTES, out
    assert out["unstaged_bytes"] == 0, out


def test_a_state_within_the_budget_is_staged_whole():
    staging = StagingBuffers(budget_bytes=1 << 20)
    state = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(10)}
    staged, nbytes = staging.stage(state)
    assert staging.unstaged_bytes == 0 and staging.window_bytes is None
    assert nbytes == 4040 and staged["a"].data_ptr() != state["a"].data_ptr()


def test_over_the_budget_the_tensors_that_do_not_fit_are_the_live_ones():
    staging = StagingBuffers(budget_bytes=8192)
    state = {"a": torch.zeros(1024), "b": torch.ones(2048), "c": torch.ones(256)}
    staged, nbytes = staging.stage(state)
    # room: 8192 - 8192 // 4 = 6144 bytes: "a" (4096) and "c" (1024) are copied, "b" not.
    assert nbytes == 5120 and staging.unstaged_bytes == 8192, (nbytes, staging.unstaged_bytes)
    assert staged["b"].data_ptr() == state["b"].data_ptr()
    assert staged["a"].data_ptr() != state["a"].data_ptr()
    assert staging.arena_bytes <= 8192 and staging.window_bytes == 2048


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8G"])
def test_a_budget_that_is_not_a_positive_byte_count_is_refused(bad):
    with pytest.raises(ValueError, match="budget_bytes"):
        StagingBuffers(budget_bytes=bad)
