"""CheckpointManager on real gloo processes (2 ranks): async saves of DDP + FSDP2 state and a
bit-exact resume, a failure on one rank failing the save everywhere, lease loss, agreement of
a non-deterministic cadence, and flushing or abandoning at exit. Plus the single-process
behaviour of cadence-driven saves.
"""

from __future__ import annotations

import os

import pytest
import torch

from ckpt.job import CheckpointManager, ManagerOptions
from ckpt.root import CheckpointStore
from tests.ckpt import _mgr_workers as workers
from tests.ckpt._mgr_util import EveryN, lease_released, marker_names
from tests.dist import run_ranks

pytestmark = pytest.mark.timeout(240)


def test_async_saves_fsdp2_and_ddp_resume_bit_exact(tmp_path):
    root = str(tmp_path / "root")
    results = run_ranks(workers.async_resume_body, 2, root, timeout=180)
    assert results[0]["layout"] == {"dp": 2}
    assert all(r["user_metadata"] == {"loss": 1.0 / 6} for r in results)
    assert CheckpointStore(root).committed_steps() == [2, 4, 6]
    assert lease_released(root)


def test_failure_on_one_rank_fails_everywhere_and_lease_loss_stops_saves(tmp_path):
    root = str(tmp_path / "root")
    results = run_ranks(workers.failure_body, 2, root, timeout=180)
    assert results[0]["committed"] == [2, 3]
    assert results[0]["lease_holder"] == "intruder"
    assert not os.path.exists(os.path.join(root, "step_000000001"))


def test_exit_flush_and_abandon_on_two_ranks_then_next_job_cleans_up(tmp_path):
    root = str(tmp_path / "root")
    results = run_ranks(workers.exit_body, 2, root, timeout=180)
    assert all(r["flushed"] == [1] for r in results)
    leftover = results[0]["leftover"]
    assert marker_names(leftover) and "manifest.json" not in leftover
    assert any(n.endswith(".bin") for n in leftover)
    assert results[0]["cleaned"] == [2] and results[1]["cleaned"] == []
    assert results[0]["after"] == ["step_000000001"]
    assert CheckpointStore(root).committed_steps() == [1]


def test_maybe_save_follows_the_cadence_and_retention(tmp_path):
    root = str(tmp_path / "root")
    cadence = EveryN(3)
    state = {"w": torch.zeros(3), "step": 0}
    with CheckpointManager(root, busy="wait", cadence=cadence) as mgr:
        started = []
        for step in range(1, 13):
            state["w"].add_(1)
            state["step"] = step
            if mgr.maybe_save(step, state):
                started.append(step)
            mgr.wait()
    assert started == [3, 6, 9, 12] and cadence.saved == [3, 6, 9, 12]
    # Default retention: the last 3 plus pinned ones.
    assert CheckpointStore(root).committed_steps() == [6, 9, 12]
    assert [e.step for e in mgr.events.of_kind("retention_deleted")] == [3]
    fresh = {"w": torch.zeros(3), "step": 0}
    with CheckpointManager(root) as mgr2:
        assert mgr2.load_latest(fresh).step == 12
    assert fresh["step"] == 12 and torch.equal(fresh["w"], torch.full((3,), 12.0))


def test_maybe_save_without_cadence_and_sync_mode(tmp_path):
    root = str(tmp_path / "root")
    with CheckpointManager(root, ManagerOptions(async_save=False), retention=[]) as mgr:
        assert mgr.maybe_save(1, {"w": torch.ones(2)}) is False
        assert mgr.save(1, {"w": torch.ones(2)}) is True
        assert not mgr.in_flight()  # synchronous: committed on return
        assert mgr.last_committed.step == 1
    assert CheckpointStore(root).committed_steps() == [1]


def test_string_cadence_uses_ckpt_cadence(tmp_path):
    pytest.importorskip("ckpt.cadence.policies")
    from ckpt.cadence import policies as cad

    if not hasattr(cad, "parse_interval"):
        pytest.skip("ckpt.cadence.policies.parse_interval not written yet")
    with CheckpointManager(str(tmp_path / "root"), cadence="2", retention=[]) as mgr:
        saved = [s for s in range(1, 7) if mgr.maybe_save(s, {"w": torch.ones(1)}) and
                 mgr.wait() is not None]
    assert saved == [2, 4, 6]


def test_close_and_exit_leave_no_gloo_thread_behind(tmp_path):
    results = run_ranks(workers.groups_freed_body, 2, str(tmp_path / "root"), timeout=120)
    for r in results:
        assert r["closed"] == r["before"], r
        assert r["opened"] > r["before"] and r["at_exit"] == r["before"], r
        assert r["tiers_opened"] > r["before"] and r["tiers_at_exit"] == r["before"], r
