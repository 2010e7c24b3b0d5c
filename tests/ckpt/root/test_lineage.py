"""Lineage: a resume combines only versions of one trajectory, on every node, tier and copy,
and never takes one a resume went back past, even when it could not be deleted
(ckpt.root.lineage, docs/format.md "Lineage")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.errors import AbandonedCheckpointError, CorruptCheckpointError
from ckpt.format import Lineage, parse_lineage
from ckpt.job import CheckpointManager, ManagerOptions, ReadOnlyCheckpointer
from ckpt.job._tier_layout import UNREADABLE, mixed_steps
from ckpt.root import LINEAGE_NAME, CheckpointStore, Trajectory, read_runs
from tests.ckpt.root._lineage_workers import tier_phase
from tests.dist import run_ranks


def _run(run, parent=None, **kw):
    return {"run": run, "parent": parent, "kind": "resume", "abandoned": [], **kw}


def _at(run, step):
    return {"run": run, "step": step, "save_id": f"id{step}"}


# -- the rule ---------------------------------------------------------------------------------
def test_the_chain_from_the_newest_run_decides_what_is_live():
    a, b, c = "aaaaaa", "bbbbbb", "cccccc"
    # b resumed from a@30, c from b@40: a is live up to 30, b up to 40, c everywhere.
    t = Trajectory([_run(a), _run(b, _at(a, 30)), _run(c, _at(b, 40))])
    live = lambda step, run: t.why_abandoned(step, "x", Lineage(run)) is None  # noqa: E731
    assert live(30, a) and not live(40, a) and not live(50, a)
    assert live(40, b) and not live(50, b)
    assert live(10, c) and live(10 ** 9, c)
    why = t.why_abandoned(50, "x", Lineage(a))
    assert "run bbbbbb resumed from step 30 of run aaaaaa" in why
    # A run the log does not know is live (no evidence against it); a legacy version too,
    # unless a resume went back past it.
    assert live(99, "dddddd") and live(99, None)
    t2 = Trajectory([_run(b, _at(None, 20))])
    assert t2.why_abandoned(20, "x", None) is None and t2.why_abandoned(30, "x", None)
    # An operator's restore re-admits one version.
    t3 = Trajectory([_run(a), _run(b, _at(a, 30)),
                     {"kind": "restore", "run": "eeeeee", "parent": None, "restored": "id50"}])
    assert t3.why_abandoned(50, "id50", Lineage(a)) is None
    assert t3.why_abandoned(40, "id40", Lineage(a)) is not None
    assert t3.tip == b  # a restore record is no run
    with pytest.raises(AbandonedCheckpointError, match="step 50 here is abandoned"):
        t.check(50, "x", Lineage(a), "step 50 here")


def test_versions_of_one_step_from_different_runs_are_mixed():
    assert mixed_steps([[(10, "a1"), (20, "a1")], [(10, "a1"), (20, "b2")]]) == {20: ["a1", "b2"]}
    assert mixed_steps([[(10, None)], [(10, None)], [(10, UNREADABLE)]]) == {}


def test_a_crafted_lineage_is_refused_in_one_line():
    with pytest.raises(CorruptCheckpointError, match=r"lineage\.run must be"):
        parse_lineage({"run": "../x"}, "m.json")
    with pytest.raises(CorruptCheckpointError, match=r"lineage\.parent\.step"):
        parse_lineage({"run": "abcdef", "parent": {"run": None, "step": -1, "save_id": "x"}},
                      "m.json")
    assert parse_lineage(None, "m.json") is None


# -- a plain root ------------------------------------------------------------------------------
def _save(mgr, step):
    mgr.save(step, {"w": torch.full((3,), float(step))}, block=True)


def test_a_version_a_resume_went_back_past_is_never_resumed_even_when_it_is_put_back(tmp_path):
    """Run A saves 10..50; run B resumes at 30 (40 and 50 are un-committed); someone puts
    step 50's manifest back (a backup restored over the root, an un-commit that copied
    but did not delete): no resume takes it, and `ckpt history` names it abandoned."""
    root = str(tmp_path)
    kw = dict(options=ManagerOptions(async_save=False), retention=[])
    with CheckpointManager(root, **kw) as a:
        for s in (10, 20, 30, 40, 50):
            _save(a, s)
        run_a = a.lineage.run
    st = {"w": torch.zeros(3)}
    with CheckpointManager(root, **kw) as b:
        assert b.load_latest(st, step=30).step == 30
        assert b.lineage.parent == {"run": run_a, "step": 30,
                                    "save_id": CheckpointStore(root).read_manifest(30).save_id}
    runs = read_runs(CheckpointStore(root).storage)
    assert [r["run"] for r in runs][-1] != run_a and runs[-1]["parent"]["step"] == 30
    assert sorted(x["step"] for x in runs[-1]["abandoned"]) == [40, 50]
    # Put A's step 50 back as committed (its rolled-back manifest copied over).
    folder = tmp_path / "step_000000050"
    rolled = next(folder.glob("rolled-back-*.json"))
    shutil.copy(rolled, folder / "manifest.json")
    assert 50 in CheckpointStore(root).committed_steps()
    # Before lineage it was resumed from; now it is passed over, with the reason.
    events = []
    with CheckpointManager(root, **kw) as c:
        c.events.subscribe(events.append)
        assert c.load_latest(st).step == 30
    reasons = [e.fields["reason"] for e in events if e.kind == "load_fallback"]
    assert any("abandoned" in r and "step 50" in r for r in reasons), reasons
    assert CheckpointStore(root).latest().step == 30
    assert ckpt.load_latest({"w": torch.zeros(3)}, root).step == 30
    # A standby replica group (torchft) reads the root as the writing group does.
    assert ReadOnlyCheckpointer(root).load_latest({"w": torch.zeros(3)}).step == 30


def test_a_restored_version_counts_again(tmp_path):
    root = str(tmp_path)
    kw = dict(options=ManagerOptions(async_save=False), retention=[])
    with CheckpointManager(root, **kw) as a:
        for s in (10, 20, 30):
            _save(a, s)
    with CheckpointManager(root, **kw) as b:
        b.load_latest({"w": torch.zeros(3)}, step=10)
    store = CheckpointStore(root)
    rolled = [e for e in store.entries(30) if e.status == "rolled-back"][0]
    from ckpt.root import acquire_lease, release_lease
    life = acquire_lease(store.storage)
    try:
        life.restore(rolled.save_id)
    finally:
        release_lease(life)
    st = {"w": torch.zeros(3)}
    assert ckpt.load_latest(st, root).step == 30 and st["w"][0].item() == 30.0


def test_a_damaged_run_log_is_moved_aside_never_lost(tmp_path):
    root = str(tmp_path)
    kw = dict(options=ManagerOptions(async_save=False), retention=[])
    with CheckpointManager(root, **kw) as a:
        _save(a, 10)
        a.load_latest({"w": torch.zeros(3)})
    (tmp_path / LINEAGE_NAME).write_bytes(b'{"format": "ckpt-lineage", "runs": [')
    with CheckpointManager(root, **kw) as b:
        assert b.load_latest({"w": torch.zeros(3)}).step == 10
    aside = list(tmp_path.glob("_lineage.damaged-*.json"))
    assert len(aside) == 1 and aside[0].read_bytes().endswith(b"[")
    assert len(json.loads((tmp_path / LINEAGE_NAME).read_text())["runs"]) == 1


# -- two nodes ---------------------------------------------------------------------------------
def _phase(base, phase):
    return run_ranks(tier_phase, 2, base, phase, timeout=120)


def _damage(base):
    """Node 0's step-40 manifest damaged; node 1's step-50 manifest lost (a crash)."""
    p = Path(base, "local0", "step_000000040", "manifest.json")
    data = bytearray(p.read_bytes())
    data[-5] ^= 0xFF
    p.write_bytes(bytes(data))
    Path(base, "local1", "step_000000050", "manifest.json").unlink()


def test_two_nodes_never_resume_a_mix_of_two_trajectories(tmp_path):
    """The mixed-resume repro, then worse: node 0's abandoned step 50 put back after the
    resume deleted it. Each rank resumes from one trajectory, the current one."""
    base = str(tmp_path)
    _phase(base, "run1")
    _damage(base)
    keep = tmp_path / "node0-step50"
    shutil.copytree(tmp_path / "local0" / "step_000000050", keep)  # trajectory A's
    out = _phase(base, "run2")
    assert [o["resumed"] for o in out] == [30, 30]
    # The resume went on past node 0's damaged step 40 and deleted its step 50, and step
    # 40 (its damaged manifest moved aside) was saved again.
    assert CheckpointStore(f"{base}/local0").committed_steps()[-2:] == [40, 50]
    assert list((tmp_path / "local0" / "step_000000040").glob("damaged-manifest-*.json"))
    out = _phase(base, "run3")
    assert [(o["resumed"], o["trajectory"]) for o in out] == [(50, "B"), (50, "B")], out
    # Node 0's abandoned version of step 50 comes back (from a backup): node 0 holds A's 50,
    # node 1 B's. Never combined: the resume falls back to step 40, B's on both.
    shutil.rmtree(tmp_path / "local0" / "step_000000050")
    shutil.copytree(keep, tmp_path / "local0" / "step_000000050")
    out = _phase(base, "run3")
    assert [(o["resumed"], o["trajectory"]) for o in out] == [(40, "B"), (40, "B")], out


# -- the operator's view -----------------------------------------------------------------------
def test_history_shows_the_tree_and_rollback_names_the_branch_it_abandons(tmp_path, capsys):
    from tests.ckpt.cli.test_cli import cli

    root = str(tmp_path)
    kw = dict(options=ManagerOptions(async_save=False), retention=[])
    with CheckpointManager(root, **kw) as a:
        a.load_latest({"w": torch.zeros(3)})
        for s in (10, 20, 30, 40, 50):
            _save(a, s)
        run_a = a.lineage.run
    with CheckpointManager(root, **kw) as b:
        b.load_latest({"w": torch.zeros(3)}, step=30)
        _save(b, 40)
        run_b = b.lineage.run
    rc, out, _ = cli(capsys, "history", root)
    assert rc == 0
    tree = out[out.index("trajectories"):].splitlines()
    assert tree[1].startswith(f"* run {run_a}: fresh start")
    assert tree[2].split() == ["live:", "10,", "20,", "30"]
    assert tree[3].split()[:5] == ["abandoned:", "40", "rolled", "back,", "50"]
    assert tree[4].startswith(f"  * run {run_b}: resumed from step 30 of run {run_a}")
    assert tree[4].endswith("<- current") and tree[5].split() == ["live:", "40"]
    rc, out, _ = cli(capsys, "history", root, "--json")
    info = json.loads(out)["trajectories"]
    assert info["tip"] == run_b and info["roots"] == [run_a]
    by_run = {r["run"]: r for r in info["runs"]}
    assert by_run[run_a]["children"] == [run_b]
    assert [v["step"] for v in by_run[run_a]["abandoned"]] == [40, 50]
    assert sorted(x["step"] for x in by_run[run_b]["left_behind"]) == [40, 50]
    rc, out, _ = cli(capsys, "rollback", root, "--step", "20")
    assert rc == 0
    assert f"abandons the branch: run {run_a} steps 30; run {run_b} steps 40" in out


def test_a_damaged_manifest_never_blocks_its_step(tmp_path, capsys):
    """A manifest that fails its digest (a resume falls back past it) is moved aside when
    its step is saved again: the save commits (it used to fail at every attempt), and
    `ckpt list --all` shows what was moved aside and why."""
    from tests.ckpt.cli.test_cli import cli

    root = str(tmp_path)
    kw = dict(options=ManagerOptions(async_save=False, retry_backoff_seconds=0.01), retention=[])
    with CheckpointManager(root, **kw) as a:
        _save(a, 10)
        _save(a, 20)
    p = tmp_path / "step_000000020" / "manifest.json"
    data = bytearray(p.read_bytes())
    data[-5] ^= 0xFF
    p.write_bytes(bytes(data))
    st = {"w": torch.zeros(3)}
    with CheckpointManager(root, **kw) as b:
        assert b.load_latest(st).step == 10
        _save(b, 20)
        assert b.newest_committed_step == 20
    assert CheckpointStore(root).read_manifest(20).lineage.parent["step"] == 10
    aside = list((tmp_path / "step_000000020").glob("damaged-manifest-*.json"))
    assert len(aside) == 1 and aside[0].read_bytes() == bytes(data)
    rc, out, _ = cli(capsys, "list", root, "--all")
    row = [line for line in out.splitlines() if "damaged manifest" in line]
    assert rc == 0 and len(row) == 1 and row[0].split()[:3] == ["20", "-", "moved-aside"]


def test_a_run_log_larger_than_any_is_never_read_whole(tmp_path):
    from ckpt.root.lineage import MAX_LOG_BYTES

    with open(tmp_path / LINEAGE_NAME, "wb") as f:  # sparse: no disk
        f.truncate(MAX_LOG_BYTES * 64)
    assert read_runs(CheckpointStore(str(tmp_path)).storage) == []
    st = {"w": torch.zeros(3)}
    with CheckpointManager(str(tmp_path), ManagerOptions(async_save=False), retention=[]) as m:
        _save(m, 10)
        assert m.load_latest(st).step == 10
    assert len(read_runs(CheckpointStore(str(tmp_path)).storage)) == 1


def test_deleting_newer_steps_goes_on_past_one_that_cannot_be_deleted(tmp_path):
    """A resume's node-local deletes (the local tier's own steps and the copies a node holds
    on the next node: ``Lifecycle.delete_newer``, one definition for both): a step whose
    manifest is damaged is reported and left, the newer ones still go (a copy of the
    abandoned step 50 used to stay committed, for a restore to hand to a replaced node)."""
    from ckpt.root import acquire_lease, release_lease

    root = str(tmp_path)
    for step in (30, 40, 50):
        ckpt.save({"w": torch.full((4,), float(step))}, root, step)
    p = tmp_path / "step_000000040" / "manifest.json"
    data = bytearray(p.read_bytes())
    data[-5] ^= 0xFF
    p.write_bytes(bytes(data))
    store = CheckpointStore(root)
    life = acquire_lease(store.storage)
    try:
        out = life.delete_newer(30)
    finally:
        release_lease(life)
    assert [s for s, _ in out] == [40, 50]
    assert isinstance(out[0][1], CorruptCheckpointError) and out[1][1] is None
    assert store.committed_steps() == [30, 40]  # 40: damaged, kept as it is (never read)
    assert not list((tmp_path / "step_000000050").glob("*.bin"))


def test_a_walk_never_takes_a_step_whose_ranks_read_versions_of_two_runs(tmp_path):
    """Job-wide, below every resume: each rank read a version of step 10 (here from roots of
    their own, as nodes do in a node-local tier) and they come from two runs: passed over on
    every rank, in one line; step 5, one version on both, is loaded (it used to load step
    10, a mix of two trajectories, whenever the steps' listing let one through)."""
    from tests.ckpt.root._lineage_workers import walk_two_roots

    out = run_ranks(walk_two_roots, 2, str(tmp_path), timeout=60)
    for r in out:
        assert r["step"] == 5 and r["loaded"] == [5], r
        ((step, why),) = r["failures"]
        assert step == 10 and "come from different runs" in why and "\n" not in why, why
