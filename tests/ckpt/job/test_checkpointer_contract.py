"""The one contract (``ckpt.Checkpointer``): both managers implement every public member with
the base's signature and meaning; ``ReadOnlyCheckpointer`` implements its read half.

One process, local disk: each manager runs the same script, and only what docs/store.md
("One contract, two managers") says differs between the tiers is told apart here.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import ckpt
from ckpt import (
    Checkpointer,
    CheckpointManager,
    CheckpointReader,
    ReadOnlyCheckpointer,
    ResumeInfo,
    TieredCheckpointManager,
)
from ckpt.root import Trajectory, read_runs


def _public(cls) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")} | {
        n for c in cls.__mro__ for n in getattr(c, "__annotations__", {}) if not n.startswith("_")}


def _make(kind: str, tmp_path):
    root = str(tmp_path / "root")
    if kind == "plain":
        return CheckpointManager(root, cadence="2", busy="wait", retention=[])
    return TieredCheckpointManager(root, str(tmp_path / "local"), cadence="2",
                                   local_cadence="2", busy="wait", retention=[],
                                   local=ckpt.LocalTierOptions(retention=[]))


def _state(value: float) -> dict:
    return {"w": torch.full((4,), value), "progress": {"step": int(value)}}


@pytest.mark.parametrize("cls", [CheckpointManager, TieredCheckpointManager])
def test_every_member_of_the_base_has_the_bases_signature(cls):
    assert issubclass(cls, Checkpointer) and not inspect.isabstract(cls)
    for name in sorted(_public(Checkpointer)):
        assert hasattr(cls, name) or name in cls.__init__.__code__.co_names, (cls, name)
        base = getattr(Checkpointer, name, None)
        if inspect.isfunction(base):
            assert inspect.signature(getattr(cls, name)) == inspect.signature(base), (cls, name)
    # What one manager lacks the other cannot silently lack: the contract is the base.
    assert {"latest_step", "all_steps", "resumed", "lineage", "history", "lease_lost",
            "check_lease", "uncommit_newer", "maybe_save", "save", "wait", "load_latest",
            "close", "prepare", "in_flight", "newest_committed_step", "start_run"} \
        <= _public(Checkpointer)


@pytest.mark.parametrize("kind", ["plain", "tiered"])
def test_both_managers_keep_the_contract(kind, tmp_path):
    mgr = _make(kind, tmp_path)
    with mgr:
        assert isinstance(mgr, Checkpointer)
        assert mgr.latest_step() is None and mgr.all_steps() == [] and mgr.resumed is None
        assert mgr.load_latest(_state(0.0)) is None and mgr.resumed is None  # fresh start
        mgr.prepare(_state(0.0))
        assert mgr.cadence is not None and mgr.lineage is not None
        assert [mgr.maybe_save(s, _state(float(s))) for s in (1, 2, 3, 4)] == \
            [False, True, False, True]
        assert mgr.wait().step == 4 and not mgr.in_flight()
        assert mgr.save(5, _state(5.0), block=True) is True
        assert mgr.save(5, _state(5.0)) is False  # committed: skipped, never overwritten
        assert mgr.save(5, _state(5.0), force=True, block=True) is True  # this run's state
        assert mgr.all_steps() == [2, 4, 5] and mgr.latest_step() == 5
        assert mgr.newest_committed_step == 5
        assert mgr.check_lease() is False and mgr.lease_lost is False
        assert mgr.lease_lost_url is None
        mgr.history.add_uptime(1.0)
        mgr.save_history()
        assert isinstance(mgr.storage, ckpt.Storage) and mgr.store.committed_steps() == [2, 4, 5]

    with _make(kind, tmp_path) as again:
        # An earlier run's step: a forced save refuses to overwrite it.
        with pytest.raises(FileExistsError, match="committed by an earlier run"):
            again.save(5, _state(9.0), force=True)
        state = _state(-1.0)
        assert again.load_latest(state).step == 5
        assert torch.equal(state["w"], torch.full((4,), 5.0))
        # Where it resumed from: the two-tier manager tries its local tier first.
        tier = "local" if kind == "tiered" else "durable"
        assert again.resumed.step == 5 and again.resumed.tier == tier
        assert again.resumed.where == (str(tmp_path / "local") if kind == "tiered"
                                       else again.storage.url)
        assert again.save(5, _state(5.0), force=True) is True  # resumed from it: done
        # A given step rewinds the run to it: the newer ones are un-committed.
        assert again.load_latest(state, step=2).step == 2 and again.all_steps() == [2]
        assert again.resumed == ResumeInfo(2, "durable", again.storage.url)
        assert again.uncommit_newer(-1) == [2] and again.latest_step() is None


@pytest.mark.parametrize("kind", ["plain", "tiered"])
def test_start_run_records_the_run_in_the_jobs_log_and_every_tier_saves_as_it(kind, tmp_path):
    with _make(kind, tmp_path) as mgr:
        for step in (2, 4):
            mgr.save(step, _state(float(step)), block=True)
        parent = mgr.store.read_manifest(2)
        before = mgr.lineage
        lineage = mgr.start_run(parent, tier="durable")
        assert lineage == mgr.lineage and lineage.run != before.run
        assert lineage.parent is not None
        # The job's one run log (two tiers: the durable root's) names the run, its parent's
        # tier and the step it goes back past.
        runs = read_runs(mgr.storage)
        assert runs[-1]["run"] == lineage.run and runs[-1]["tier"] == "durable"
        assert [a["step"] for a in runs[-1]["abandoned"]] == [4]
        # Every version saved from now on records it, in every tier.
        mgr.save(6, _state(6.0), block=True)
        assert mgr.store.read_manifest(6).lineage == lineage
        if kind == "tiered":
            assert mgr.local.store.read_manifest(6).lineage == lineage
            assert read_runs(mgr.local.storage) == []  # one log per job: the durable root's
        # The step the run went back past is abandoned; the new run's are live.
        trajectory = Trajectory(read_runs(mgr.storage))
        m4, m6 = mgr.store.read_manifest(4), mgr.store.read_manifest(6)
        assert trajectory.why_abandoned(4, m4.save_id, m4.lineage) is not None
        assert trajectory.why_abandoned(6, m6.save_id, m6.lineage) is None
    with _make(kind, tmp_path) as again:
        assert again.load_latest(_state(0.0)).step == 6


@pytest.mark.parametrize("kind", ["plain", "tiered"])
def test_a_deliberate_fresh_start_leaves_nothing_of_the_old_trajectory_in_any_tier(
        kind, tmp_path):
    """A caller that starts over on purpose (the trainer, every checkpoint damaged and a
    fresh start allowed) records a run from nothing, then un-commits everything: every
    tier saves those steps again as the new run, and no resume takes the old ones (the
    two-tier job's local steps used to stay: its saves of them were skipped as committed
    by an earlier run, and they stayed the resume's first candidates)."""
    with _make(kind, tmp_path) as a:
        a.load_latest(_state(0.0))  # records run A
        for step in (2, 4):
            a.save(step, _state(float(step)), block=True)
    with _make(kind, tmp_path) as b:
        lineage = b.start_run(None)
        b.uncommit_newer(-1)
        assert b.all_steps() == []
        assert b.save(2, _state(20.0), block=True)
        stores = [b.store] + ([b.local.store] if kind == "tiered" else [])
        for store in stores:
            assert store.committed_steps() == [2], store.storage.url
            assert store.read_manifest(2).lineage == lineage, store.storage.url
    assert Trajectory(read_runs(b.storage)).tip == lineage.run
    with _make(kind, tmp_path) as c:
        state = _state(-1.0)
        assert c.load_latest(state).step == 2
        assert torch.equal(state["w"], torch.full((4,), 20.0))


def test_a_read_only_checkpointer_loads_and_changes_nothing(tmp_path):
    root = str(tmp_path / "root")
    with CheckpointManager(root, retention=[]) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(float(step)), block=True)
    reader = ReadOnlyCheckpointer(root)
    assert isinstance(reader, CheckpointReader) and not isinstance(reader, Checkpointer)
    state = _state(0.0)
    assert reader.load_latest(state).step == 3 and reader.resumed.tier == "durable"
    assert reader.load_latest(state, step=1).step == 1
    assert torch.equal(state["w"], torch.full((4,), 1.0))
    assert reader.all_steps() == [1, 2, 3] and reader.latest_step() == 3  # nothing rewound
    reader.close()
    with CheckpointManager(root, retention=[]) as mgr:  # no lease was left behind
        assert mgr.latest_step() == 3
