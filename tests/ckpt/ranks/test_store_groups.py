"""Which process groups the store's collectives run on (``ckpt.ranks.groups``): never the default
group. Real processes (2 ranks) under a "cuda:gloo" default group, which, like NCCL's, has no
CPU backend: a CPU collective on it raises "No backend type associated with device type
cpu". Plus the store's world group being freed at exit.
"""

from __future__ import annotations

import pytest

from tests.ckpt.ranks import _group_workers as w
from tests.dist import run_ranks

pytestmark = pytest.mark.timeout(300)


def test_save_load_and_load_latest_without_a_group_under_a_default_group_without_cpu(tmp_path):
    root = str(tmp_path / "root")
    out = run_ranks(w.api_body, 2, root, str(tmp_path / "filestore"), backend="cuda:gloo",
                    timeout=240)
    for r in out:
        assert r["load"] == (1, 1) and r["load_latest"] == (2, 2), r
        assert r["whole"] == (3, 3) and r["one_world_group"], r
        assert r["gloo_subgroup"] == (1, 1), r
        assert "has no CPU backend" in r["nocpu_subgroup"], r
        assert "backend='gloo'" in r["nocpu_subgroup"], r
        assert r["new_world_group"] and r["after_reinit"] == (4, 4), r


def test_checkpoint_manager_under_a_default_group_without_cpu(tmp_path):
    out = run_ranks(w.manager_body, 2, str(tmp_path / "root"), backend="cuda:gloo",
                    timeout=240)
    for r in out:
        assert r["started"] == [2, 4] and r["resumed"] == (5, 5), r
        assert r["subgroup"] == (1, 1, 1), r


def test_tiered_manager_on_two_nodes_under_a_default_group_without_cpu(tmp_path):
    root, local = str(tmp_path / "durable"), str(tmp_path / "local-{node}")
    out = run_ranks(w.tiers_body, 2, root, local, backend="cuda:gloo", timeout=240)
    for r in out:
        assert r["num_nodes"] == 2 and r["local_world"] == 1, r
        assert r["local"] == [4, 6] and r["durable"] == [4], r
        assert r["resumed"] == (6, "local", 6), r


def test_trainer_builds_its_managers_under_a_default_group_without_cpu(tmp_path):
    out = run_ranks(w.trainer_managers_body, 2, str(tmp_path / "root"),
                    str(tmp_path / "local"), backend="cuda:gloo", timeout=240)
    for r in out:
        # The trainer's saves skip while one persists: the tier resumed from may vary.
        assert r["plain"] == (2, "durable", 2) and r["tiered"][0::2] == (2, 2), r


def test_the_store_world_group_is_freed_at_exit(tmp_path):
    for r in run_ranks(w.world_group_freed_body, 2, str(tmp_path / "root"), timeout=120):
        assert r["opened"] > r["before"] and r["at_exit"] == r["before"], r
        assert r["again"] > r["before"] and r["after"] == r["before"], r
