"""The two edges of a commit: a confirmation that fails after the manifest exists is
resolved by reading back (never by a second attempt that reports the step as not
committed), and "is the final step committed" reads the manifest as readers do."""

from __future__ import annotations

import torch

import ckpt
from ckpt.job import CheckpointManager, ManagerOptions
from ckpt.root import CheckpointStore, Fence, Lease, Lifecycle
from trainer.ft.writer import _committed


def _events(mgr):
    out = []
    mgr.events.subscribe(out.append)
    return out


def test_storage_errors_while_confirming_a_commit_are_read_back(tmp_path, monkeypatch):
    """The lease renewal after the manifest exists, and the first fence read, fail with a
    storage error: the commit is still confirmed (read back), not retried and skipped."""
    failures = {"confirm": 2, "fence": 1}
    confirm, doc = Lease.confirm, Fence.doc

    def flaky_confirm(self, *a, **kw):
        if failures["confirm"] > 0:
            failures["confirm"] -= 1
            raise OSError("connection reset (injected)")
        return confirm(self, *a, **kw)

    def flaky_doc(self, *a, **kw):
        if failures["fence"] > 0:
            failures["fence"] -= 1
            raise OSError("connection reset (injected)")
        return doc(self, *a, **kw)

    mgr = CheckpointManager(str(tmp_path),
                            ManagerOptions(async_save=False, retry_backoff_seconds=0.01),
                            retention=[])
    events = _events(mgr)
    monkeypatch.setattr(Lease, "confirm", flaky_confirm)
    monkeypatch.setattr(Fence, "doc", flaky_doc)
    assert mgr.save(10, {"w": torch.ones(3)}, block=True)
    mgr.close()
    kinds = [e.kind for e in events]
    assert "save_committed" in kinds and "save_skipped" not in kinds, kinds
    assert not [e for e in events if e.kind == "save_failed"]
    assert CheckpointStore(str(tmp_path)).committed_steps() == [10]


def test_an_attempt_that_failed_after_its_manifest_existed_counts_as_committed(
        tmp_path, monkeypatch):
    """The first attempt's commit raises once its manifest exists (an error the commit
    cannot resolve itself): the retry finds the step committed by that attempt and reports
    it committed, where it used to report "already committed" and count nothing."""
    confirm = Lifecycle._confirm_after_commit
    calls = {"n": 0}

    def failing_once(self, manifest):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("response lost after the manifest was created (injected)")
        return confirm(self, manifest)

    monkeypatch.setattr(Lifecycle, "_confirm_after_commit", failing_once)
    mgr = CheckpointManager(str(tmp_path),
                            ManagerOptions(async_save=False, retry_backoff_seconds=0.01),
                            retention=[])
    events = _events(mgr)
    assert mgr.save(10, {"w": torch.ones(3)}, block=True)
    assert mgr.newest_committed_step == 10
    assert mgr.save(10, {"w": torch.ones(3)}, force=True)  # this run's own step: done
    mgr.close()
    assert [e.kind for e in events].count("save_committed") == 1
    assert "save_skipped" not in [e.kind for e in events]


def test_the_final_step_check_reads_the_manifest_as_readers_do(tmp_path):
    root = str(tmp_path)
    ckpt.save({"w": torch.ones(3)}, root, 5)
    store = CheckpointStore(root)
    assert _committed(store, 5)
    p = tmp_path / "step_000000005" / "manifest.json"
    data = bytearray(p.read_bytes())
    data[-5] ^= 0xFF
    p.write_bytes(bytes(data))
    assert 5 in store.committed_steps()  # a manifest file exists...
    assert not _committed(store, 5)  # ...but it is no checkpoint
    assert not _committed(store, 6)


def test_a_root_that_became_a_file_fails_saves_never_skips_them(tmp_path):
    """"File exists" from anything but a committed step (the root's link now points at a
    file, as when a mount goes away) is a failed save, reported as one, not "already
    committed"."""
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real)
    mgr = CheckpointManager(str(link),
                            ManagerOptions(async_save=False, use_lease=False,
                                           retry_backoff_seconds=0.01), retention=[])
    mgr.save(1, {"w": torch.ones(2)})
    blocker, new = tmp_path / "blocker", tmp_path / "new"
    blocker.write_text("")
    new.symlink_to(blocker)
    new.replace(link)
    events = _events(mgr)
    mgr.save(2, {"w": torch.ones(2)})
    mgr.close(flush=False)
    kinds = [e.kind for e in events]
    assert "save_skipped" not in kinds and kinds.count("save_failed") == 3, kinds
