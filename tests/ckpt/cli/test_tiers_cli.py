"""`ckpt list --local` and `ckpt plan --local-bandwidth`: both tiers from the command line;
also a single-process TieredCheckpointManager (no process group) end to end."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ckpt.cli import main as cli_main


def cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli_main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def tiers(tmp_path):
    from ckpt.job import TieredCheckpointManager

    root, local = str(tmp_path / "durable"), str(tmp_path / "local")
    with TieredCheckpointManager(root, local, busy="wait", cadence="4",
                                 local_cadence="2") as mgr:
        for step in range(1, 9):
            mgr.maybe_save(step, {"w": torch.full((4,), float(step))},
                           user_metadata={"loss": 1.0 / step})
        mgr.wait()
        # One process: the tier logic without a process group.
        assert mgr.local.num_stages + mgr.durable.num_stages == 4  # steps 2, 4, 6, 8
    with TieredCheckpointManager(root, local, busy="wait", cadence="4",
                                 local_cadence="2") as mgr:
        state = {"w": torch.zeros(4)}
        assert mgr.load_latest(state).step == 8 and mgr.resumed.tier == "local"
        assert torch.equal(state["w"], torch.full((4,), 8.0))
    return root, local


def test_list_shows_both_tiers(tiers, capsys):
    root, local = tiers
    rc, out, _ = cli(capsys, "list", root, "--local", local)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["TIER", "STEP", "ID"]
    assert [tuple(line.split()[:2]) for line in lines[1:]] == [
        ("durable", "4"), ("local", "6"), ("durable", "8"), ("local", "8")]
    rc, out, _ = cli(capsys, "list", root, "--local", local, "--json")
    assert [(r["tier"], r["step"]) for r in json.loads(out)] == [
        ("durable", 4), ("local", 6), ("durable", 8), ("local", 8)]
    rc, out, _ = cli(capsys, "list", root)  # without --local: as before, no tier column
    assert out.splitlines()[0].split()[0] == "STEP"


def test_list_local_errors_are_one_line(tiers, tmp_path, capsys):
    root, _ = tiers
    rc, _, err = cli(capsys, "list", root, "--local", root)
    assert rc == 2 and "is the durable root itself" in err and err.count("\n") == 1
    rc, _, err = cli(capsys, "list", root, "--local", tmp_path / "nope")
    assert rc == 2 and "nope does not exist" in err and err.count("\n") == 1


def test_plan_advises_both_tiers(capsys):
    rc, out, _ = cli(capsys, "plan", "--size", "14GB", "--bandwidth", "2GB/s",
                     "--local-bandwidth", "40GB/s", "--mtbf", "6h", "--node-mtbf", "48h",
                     "--step-time", "1.2s")
    assert rc == 0
    assert "local tier (all failures)" in out and "durable tier (node losses)" in out
    local = int(out.split('checkpoint.local_interval = "')[1].split('"')[0])
    durable = int(out.split('checkpoint.interval = "')[1].split('"')[0])
    assert local < durable  # cheaper saves, more frequent failures
    rc, out, _ = cli(capsys, "plan", "--size", "14GB", "--bandwidth", "2GB/s",
                     "--local-bandwidth", "40GB/s", "--mtbf", "6h", "--json")
    plans = json.loads(out)
    # No --node-mtbf: every failure loses the node, both tiers use the same MTBF.
    assert plans["local"]["mtbf_seconds"] == plans["durable"]["mtbf_seconds"] == 21600
    assert 0 < plans["goodput"] < 1


def test_plan_shows_what_copies_on_the_next_node_change(capsys):
    argv = ["plan", "--size", "1TB", "--bandwidth", "2GB/s", "--local-bandwidth", "100GB/s",
            "--stall", "10s", "--mtbf", "4h", "--node-mtbf", "48h", "--step-time", "5s"]
    rc, one, _ = cli(capsys, *argv)
    rc2, two, _ = cli(capsys, *argv, "--local-copies", "2", "--nodes", "16")
    assert rc == rc2 == 0
    assert "durable tier (node losses)" in one and "local copies" not in one
    assert "durable tier (a node lost with a neighbour" in two
    assert "local copies: 2 (each node's also on the next of 16 nodes)" in two
    assert "checkpoint.local_copies = 2" in two

    def interval(out):
        return int(out.split('checkpoint.interval = "')[1].split('"')[0])

    assert interval(two) > interval(one)  # the durable tier guards against rarer losses
    rc, out, _ = cli(capsys, *argv, "--local-copies", "2", "--nodes", "16", "--json")
    plans = json.loads(out)
    assert plans["copies"] == 2 and plans["num_nodes"] == 16
    assert plans["durable"]["mtbf_seconds"] == pytest.approx(
        48 * 3600 / plans["second_loss_probability"])


@pytest.mark.parametrize("argv, message", [
    (["--node-mtbf", "48h"], "--node-mtbf needs --local-bandwidth"),
    (["--local-copies", "2", "--nodes", "4"], "--local-copies and --nodes need "
                                                "--local-bandwidth"),
    (["--local-bandwidth", "40GB/s", "--local-copies", "2"],
     "--local-copies 2 needs --nodes N"),
    (["--local-bandwidth", "40GB/s", "--local-copies", "2", "--nodes", "1"],
     "copies=2 needs the number of nodes (>= 2), got 1"),
    (["--local-bandwidth", "40GB/s", "--mtbf", "6h", "--node-mtbf", "1h"],
     "node losses are a subset of all failures"),
])
def test_plan_tier_errors_are_one_line(capsys, argv, message):
    rc, _, err = cli(capsys, "plan", "--size", "1GB", "--bandwidth", "1GB/s", *argv)
    assert rc == 2 and message in err and err.count("\n") == 1


def test_each_tier_has_its_own_lease(tmp_path):
    """A second job on the same local root (another durable root) is refused by the local
    tier's lease, naming the holder; the durable root's lease is released on the way out."""
    from ckpt.errors import LeaseHeldError
    from ckpt.job import TieredCheckpointManager

    local = str(tmp_path / "local")
    with TieredCheckpointManager(str(tmp_path / "a"), local, local_cadence="1"):
        with pytest.raises(LeaseHeldError, match="local"):
            TieredCheckpointManager(str(tmp_path / "b"), local)
    # The refused job's durable lease was not left behind: b is free again.
    with TieredCheckpointManager(str(tmp_path / "b"), local):
        pass


def test_a_failure_the_local_tier_survived_is_no_node_loss(tmp_path, monkeypatch):
    """A restart that resumes from the local tier is taken back from the durable tier's
    failure history (its MTBF is the node-loss rate); the local tier keeps it."""
    from ckpt.job import TieredCheckpointManager

    root, local = str(tmp_path / "durable"), str(tmp_path / "local")
    with TieredCheckpointManager(root, local, busy="wait", cadence="4",
                                 local_cadence="2") as mgr:
        for step in range(1, 5):
            mgr.maybe_save(step, {"w": torch.full((2,), float(step))})
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted attempt
    with TieredCheckpointManager(root, local, busy="wait", cadence="4",
                                 local_cadence="2") as mgr:
        assert mgr.durable.history.num_failures == mgr.local.history.num_failures == 1
        assert mgr.load_latest({"w": torch.zeros(2)}).step == 4
        assert mgr.resumed.tier == "local"
        assert mgr.durable.history.num_failures == 0 and mgr.local.history.num_failures == 1
        assert mgr.events.of_kind("failure_reclassified")
    shutil.rmtree(local)  # a lost node: the next restart resumes from the durable tier
    with TieredCheckpointManager(root, local, busy="wait", cadence="4",
                                 local_cadence="2") as mgr:
        assert mgr.load_latest({"w": torch.zeros(2)}).step == 4
        assert mgr.resumed.tier == "durable" and mgr.durable.history.num_failures == 1
