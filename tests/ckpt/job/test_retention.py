"""Retention: policies (KeepLast, KeepEvery, KeepPinned, their union) and the safety rules of
apply_retention: never the newest checkpoint, never one being written, nothing at all when
the newest fails verification, and a failing delete is reported, not raised.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import ckpt
from ckpt.job import (
    CheckpointManager,
    KeepAll,
    KeepEvery,
    KeepLast,
    KeepPinned,
    read_pins,
    set_pinned,
)
from ckpt.job.retention import PINS_NAME, apply_retention
from ckpt.root import CheckpointStore
from tests.ckpt._mgr_util import FaultyStorage

pytestmark = pytest.mark.timeout(120)


class _KeepNothing:
    def keep(self, steps):
        return set()


def _save_steps(root: str, steps) -> CheckpointStore:
    for s in steps:
        ckpt.save({"w": torch.full((4,), float(s)), "step": s}, root, s)
    return CheckpointStore(root)


def _pending(root: str, step: int, owner: str = "someone") -> str:
    d = os.path.join(root, f"step_{step:09d}")
    os.makedirs(d)
    with open(os.path.join(d, "pending.json"), "w") as f:
        json.dump({"owner": owner, "step": step}, f)
    with open(os.path.join(d, "r00000_abc_0.bin"), "wb") as f:
        f.write(b"x" * 16)
    return d


def test_policies():
    steps = [5, 10, 15, 20, 25, 30]
    assert KeepLast(2).keep(steps) == {25, 30}
    assert KeepLast(10).keep(steps) == set(steps)
    assert KeepEvery(10).keep(steps) == {10, 20, 30}
    assert KeepAll().keep(steps) == set(steps)
    with pytest.raises(ValueError, match="k must be >= 1"):
        KeepLast(0)
    with pytest.raises(ValueError, match="n must be >= 1"):
        KeepEvery(0)


def test_union_through_the_manager_with_pins(tmp_path):
    root = str(tmp_path / "root")
    store = CheckpointStore(root)
    policies = [KeepLast(2), KeepEvery(20), KeepPinned(store)]
    state = {"w": torch.zeros(2)}
    with CheckpointManager(root, busy="wait", retention=policies) as mgr:
        for step in range(5, 45, 5):
            state["w"].add_(1)
            mgr.save(step, state)
            mgr.wait()
            if step == 5:
                set_pinned(store, 5)
    assert read_pins(store) == {5}
    # KeepLast(2): 35, 40; KeepEvery(20): 20, 40; pinned: 5.
    assert store.committed_steps() == [5, 20, 35, 40]
    assert sorted(e.step for e in mgr.events.of_kind("retention_deleted")) == [10, 15, 25, 30]
    assert not mgr.events.of_kind("retention_failed")
    assert store.steps() == [5, 20, 35, 40]  # deleted folders are gone entirely
    # Unpinning makes 5 eligible at the next pass.
    set_pinned(store, 5, pinned=False)
    assert apply_retention(store, policies) == [5]


def test_never_the_newest_nor_protected_nor_unfinished(tmp_path):
    root = str(tmp_path / "root")
    store = _save_steps(root, [1, 2, 3, 4])
    older_pending = _pending(root, 0)   # an old incomplete folder: not a checkpoint
    newer_pending = _pending(root, 9)   # a save in flight, newer than every commit
    deleted = apply_retention(store, [_KeepNothing()], protect={2})
    assert deleted == [1, 3]
    assert store.committed_steps() == [2, 4]
    assert os.path.isdir(older_pending) and os.path.isdir(newer_pending)
    # A single checkpoint is never deleted, whatever the policy says.
    store2 = _save_steps(str(tmp_path / "one"), [7])
    assert apply_retention(store2, [_KeepNothing()]) == []
    assert store2.committed_steps() == [7]
    # No policies at all keeps everything.
    assert apply_retention(store, []) == []


def test_nothing_deleted_when_the_newest_fails_verification(tmp_path, caplog):
    root = str(tmp_path / "root")
    store = _save_steps(root, [1, 2, 3])
    newest = os.path.join(root, "step_000000003")
    victim = next(n for n in sorted(os.listdir(newest)) if n.endswith(".bin"))
    with open(os.path.join(newest, victim), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(newest, victim)) - 1)
    with caplog.at_level("WARNING", logger="ckpt.job.retention"):
        assert apply_retention(store, [KeepLast(1)]) == []
    assert store.committed_steps() == [1, 2, 3]
    assert any("deleting nothing" in r.getMessage() for r in caplog.records)


def test_failing_delete_is_reported_not_raised(tmp_path):
    root = str(tmp_path / "root")
    storage = FaultyStorage(root, fail_delete_steps={1})
    with CheckpointManager(storage, retention=[KeepLast(1)]) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((2,), float(step))}, block=True)
        failed = mgr.events.of_kind("retention_failed")
        assert [e.step for e in failed] == [1, 1]
        assert "cannot delete" in failed[0].fields["error"]
        assert [e.step for e in mgr.events.of_kind("retention_deleted")] == [2]
        assert [e.step for e in mgr.events.of_kind("save_committed")] == [1, 2, 3]
        assert mgr.store.committed_steps() == [1, 3]  # 1 is intact, still loadable
        storage.fail_delete_steps.clear()
        mgr.save(4, {"w": torch.full((2,), 4.0)}, block=True)
    assert CheckpointStore(root).committed_steps() == [4]
    # apply_retention on its own reports through on_failed as well.
    storage.fail_delete_steps.add(4)
    ckpt.save({"w": torch.ones(1)}, root, 5)
    seen = []
    assert apply_retention(CheckpointStore(storage), [KeepLast(1)],
                           on_failed=lambda s, e: seen.append((s, type(e).__name__))) == []
    assert seen == [(4, "PermissionError")]


def test_delete_uncommits_first(tmp_path):
    root = str(tmp_path / "root")
    _save_steps(root, [1, 2])
    order = []

    class Recording(FaultyStorage):
        def delete(self, rel, recursive=False):
            order.append(rel)
            return super().delete(rel, recursive=recursive)

    store = CheckpointStore(Recording(root))
    assert apply_retention(store, [KeepLast(1)]) == [1]
    # The manifest first (un-commit), then that version's own files; the empty folder goes.
    assert order[0] == "step_000000001/manifest.json" and len(order) > 1
    assert all(o.startswith("step_000000001/r") for o in order[1:]), order
    assert not os.path.exists(os.path.join(root, "step_000000001"))


def test_damaged_pins_keep_everything_and_are_not_overwritten(tmp_path, caplog):
    root = str(tmp_path / "root")
    store = _save_steps(root, [1, 2, 3])
    with open(os.path.join(root, PINS_NAME), "w") as f:
        f.write("{not json")
    with caplog.at_level("WARNING", logger="ckpt.job.retention"):
        assert apply_retention(store, [KeepLast(1), KeepPinned(store)]) == []
    assert store.committed_steps() == [1, 2, 3]
    assert any("damaged" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="damaged"):
        set_pinned(store, 2)
    with open(os.path.join(root, PINS_NAME)) as f:
        assert f.read() == "{not json"
    assert read_pins(store) == set()  # lenient read for display
    os.unlink(os.path.join(root, PINS_NAME))
    assert set_pinned(store, 2) == {2} and set_pinned(store, 3) == {2, 3}
    assert apply_retention(store, [KeepLast(1), KeepPinned(store)]) == [1]
