"""The two-tier store (``ckpt.job.tiers``): a local tier saved often under the durable one.

Real gloo processes, tiny states. Two ranks act as two nodes (each its own local root) to
check that a local step counts only when every node has it and it verifies on every rank.
FSDP across nodes with copies on the next node, and partial versions in one process (the
tools), are in ``test_tiers_fsdp.py``.
"""

from __future__ import annotations

import pytest

from tests.ckpt.job import _tier_workers as w
from tests.dist import run_ranks


def test_two_nodes_cadences_resume_order_and_fall_back(tmp_path):
    root, local = str(tmp_path / "durable"), str(tmp_path / "local-{node}")
    out = run_ranks(w.nodes_body, 2, root, local, timeout=240)
    for rank, r in enumerate(out):
        # Local every 2 (keep 2), durable every 4 (keep 3).
        assert r["local"] == [8, 10] and r["durable"] == [4, 8]
        # The newest step (10) is local only; the local tier is tried first.
        assert r["resume1"] == (10, "local", 10)
        assert r["after_resume"] == ([10, 12], [4, 8, 12])
        # Node 1 lost its local tier: the local steps of node 0 alone are not usable.
        assert r["resume_wiped"] == (12, "durable", 12)
        # Both nodes saved local 14 after the resume at 12 (node 0 still has its 12).
        assert r["after_wiped"] == ([14] if rank else [12, 14])
        # A flipped byte in node 1's local file of step 14: every rank falls back, together,
        # past local 12 (node 0 only) to durable 12; the newer local steps are deleted.
        assert r["resume_damaged"] == (12, "durable", 12)
        assert r["fallbacks"] == [(14, "local")]
        assert r["local_after_damaged"] == ([] if rank else [12])
    assert out[0]["resume_damaged"] == out[1]["resume_damaged"]


def test_one_stall_when_both_tiers_are_due(tmp_path):
    root, local = str(tmp_path / "durable"), str(tmp_path / "local")
    out = run_ranks(w.one_node_body, 2, root, local, timeout=240)
    for r in out:
        # Steps 3 and 6 are due on both tiers: the durable tier stages, the local one reuses.
        for step, durable_copies, local_copies in r["copies"]:
            assert durable_copies + local_copies == 1, r["copies"]
            assert durable_copies == (1 if step % 3 == 0 else 0)
        reused = [(s, t) for s, t, again in r["staged"] if again]
        assert reused == [(3, "local"), (6, "local")]
        assert [c for c in r["committed"] if c[0] in (3, 6)] == [
            (3, "durable"), (3, "local"), (6, "durable"), (6, "local")]
        assert r["local"] == [5, 6] and r["durable"] == [3, 6]


def test_local_root_must_differ_from_root(tmp_path):
    from ckpt.job import TieredCheckpointManager

    with pytest.raises(ValueError, match="local_root .* is the durable root"):
        TieredCheckpointManager(str(tmp_path / "a"), str(tmp_path / "a") + "/")


def test_a_tensor_sharded_across_nodes_is_saved_as_each_nodes_share(tmp_path):
    """FSDP2 over 2 "nodes" x 1 rank, no copies: each node's local version holds its share
    (its ``span``); the job resumes from local step 6 bit for bit; a partial version is
    refused in one line on another node's ranks and into a state sharded otherwise; after
    node 1 is wiped, the job falls back to durable step 4, bit for bit (no partial load)."""
    root, local = str(tmp_path / "durable"), str(tmp_path / "local-{node}")
    out = run_ranks(w.fsdp_nodes_body, 2, root, local, 1, 1, timeout=240)
    w.assert_refused_where_partial(out, per_node=1)
    for r in out:
        assert r["intact"][:2] == (6, "local")
        step, tier, events = r["wiped"]
        assert (step, tier) == (4, "durable"), r
        assert events["copy_restored"] == []


def test_hsdp_within_nodes_resumes_from_each_nodes_local_tier(tmp_path):
    root, local = str(tmp_path / "durable"), str(tmp_path / "local-{node}")
    out = run_ranks(w.hsdp_nodes_body, 4, root, local, timeout=300)
    # Local 6 is newer than durable 4; each node's manifest counts its own 2 ranks.
    assert out == [{"step": 6, "tier": "local", "world_size": 2}] * 4


def test_a_time_based_local_interval_saves_the_same_steps_on_every_node(tmp_path):
    root, local = str(tmp_path / "durable"), str(tmp_path / "local-{node}")
    node0, node1 = run_ranks(w.timed_nodes_body, 2, root, local, timeout=240)
    assert node0 == node1 and len(node0) == 2, (node0, node1)
