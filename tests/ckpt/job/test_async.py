"""The asynchronous save pipeline of CheckpointManager, in one process.

stage (the only stall) -> background persist -> commit. Checks that ``save()`` returns while
the data is still being written, that staging reuses its buffers (no allocation in steady
state, about one copy of the state), that the persisted data is the data at staging time even
though training mutates it right away, that a busy pipeline skips or waits but never silently,
that failures are reported (events, log, ``wait()``, ``raise_on_failure``) without killing
training and that transient ones are retried, and how ``close`` flushes or abandons.
"""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ckpt
from ckpt.events import SAVE_COST_PHASES
from ckpt.errors import CheckpointError, SaveAbandoned
from ckpt.job import CheckpointManager, ManagerOptions
from tests.ckpt._helpers import assert_same, flip_byte, snapshot
from tests.ckpt._mgr_util import FaultyStorage, lease_released, marker_names, wait_for

pytestmark = pytest.mark.timeout(120)


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g),
                      "steps": torch.tensor(3, dtype=torch.int64),
                      "half": torch.randn(5, generator=g).to(torch.bfloat16)},
            "layers": [torch.randn(4, generator=g), torch.randn(2, 2, generator=g)],
            "step": 3, "meta": {"lr": 0.1, "tag": "t"}}


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _train_step(state: dict) -> None:
    """Mutate every tensor in place, as an optimizer step would."""
    with torch.no_grad():
        for t in (*state["model"].values(), *state["layers"]):
            t.add_(1)
    state["step"] += 1
    state["meta"]["lr"] *= 0.5


def _manifest_exists(root, step: int) -> bool:
    return os.path.exists(os.path.join(str(root), f"step_{step:09d}", "manifest.json"))


class _AllocationRecorder(TorchDispatchMode):
    """Records every aten op run under it; allocation shows up as factory/copying ops."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


_ALLOCATING = ("empty", "zeros", "ones", "full", "clone", "_to_copy", "new_", "empty_like",
               "contiguous", "rand", "cat", "stack")


def test_save_stalls_only_for_staging_and_buffers_are_reused(tmp_path):
    storage = FaultyStorage(str(tmp_path / "root"), delay_seconds=0.3)
    state = _state()
    with CheckpointManager(storage, busy="wait", retention=[]) as mgr:
        assert mgr.save(1, state)
        # Returned while the data is still being written: persisting runs in the background.
        assert mgr.in_flight() and not _manifest_exists(tmp_path / "root", 1)
        assert mgr.wait() is not None and _manifest_exists(tmp_path / "root", 1)
        stall = mgr.events.of_kind("save_staged")[-1].fields["stall_seconds"]
        persist = mgr.events.of_kind("save_committed")[-1].fields["persist_seconds"]
        assert persist >= 0.3 and stall < persist  # training waited for the copy only
        storage.delay_seconds = 0.0

        allocs = mgr.staging.num_allocations
        assert allocs == 1  # one arena for the whole state, allocated by the first save
        # About one copy of the state: exactly the tensors' bytes.
        assert mgr.staging.nbytes == _tensor_bytes(state)
        ptrs = sorted(b.data_ptr() for b in mgr.staging._buffers.values())
        for step in range(2, 22):  # 20 more saves
            _train_step(state)
            assert mgr.save(step, state)
            mgr.wait()
            assert mgr.staging.num_allocations == allocs, f"allocated at save {step}"
        assert sorted(b.data_ptr() for b in mgr.staging._buffers.values()) == ptrs
        assert mgr.staging.nbytes == _tensor_bytes(state)

        # Steady-state staging runs no allocating op at all: only views and copy_.
        rec = _AllocationRecorder()
        with rec:
            staged, nbytes = mgr.staging.stage(state)
        assert nbytes == _tensor_bytes(state)
        bad = [op for op in rec.ops if op.startswith(_ALLOCATING)]
        assert not bad, f"staging allocated: {bad} (ops: {sorted(set(rec.ops))})"
        assert "copy_" in rec.ops
        assert mgr.staging.num_allocations == allocs
        assert len(mgr.events.of_kind("save_committed")) == 21


def test_persisted_data_is_the_data_at_staging_time(tmp_path):
    root = str(tmp_path / "root")
    storage = FaultyStorage(root, delay_seconds=0.2)
    state = _state(1)
    with CheckpointManager(storage, retention=[]) as mgr:
        mgr.save(5, state)
        expected = snapshot(state)
        # Training goes on at once and mutates the parameters while they are persisting.
        for _ in range(3):
            _train_step(state)
        assert mgr.in_flight()
        mgr.wait()
        # And the next save sees the new values (the buffers are refilled, not stale).
        mgr.save(6, state)
        expected6 = snapshot(state)
        _train_step(state)
        mgr.wait()
    for step, want in ((5, expected), (6, expected6)):
        fresh = _state(99)
        ckpt.load(fresh, root, step)
        assert_same(want, snapshot(fresh), f"step {step}")


def test_busy_skip_is_counted_and_reported(tmp_path, caplog):
    root = str(tmp_path / "root")
    gate = threading.Event()
    storage = FaultyStorage(root, block=gate)
    state = _state()
    with CheckpointManager(storage, busy="skip", retention=[]) as mgr:
        assert mgr.save(1, state)
        with caplog.at_level(logging.WARNING, logger="ckpt.job.manager"):
            assert mgr.save(2, state) is False
            assert mgr.save(3, state) is False
        assert mgr.num_skipped == 2
        skipped = mgr.events.of_kind("save_skipped")
        assert [e.step for e in skipped] == [2, 3]
        assert skipped[-1].fields["reason"] == "previous save in flight"
        assert skipped[-1].fields["in_flight_step"] == 1
        assert skipped[-1].fields["num_skipped"] == 2
        assert any("step 3 skipped" in r.getMessage() for r in caplog.records)
        # force=True waits instead of skipping.
        threading.Timer(0.2, gate.set).start()
        assert mgr.save(4, state, force=True)
        assert mgr.events.of_kind("save_waited")[-1].step == 4
        mgr.wait()
    assert ckpt.CheckpointStore(root).committed_steps() == [1, 4]


def test_busy_wait_waits_and_reports(tmp_path):
    root = str(tmp_path / "root")
    storage = FaultyStorage(root, delay_seconds=0.2)
    state = _state()
    with CheckpointManager(storage, busy="wait", retention=[]) as mgr:
        assert mgr.save(1, state)
        assert mgr.in_flight()
        assert mgr.save(2, state)
        waited = mgr.events.of_kind("save_waited")
        assert len(waited) == 1 and waited[0].step == 2
        assert waited[0].fields["wait_seconds"] > 0 and waited[0].fields["in_flight_step"] == 1
        assert mgr.num_skipped == 0
    assert ckpt.CheckpointStore(root).committed_steps() == [1, 2]


def test_background_failure_is_reported_not_fatal(tmp_path, caplog):
    root = str(tmp_path / "root")
    storage = FaultyStorage(root, fail_attempts=-1)
    state = _state()
    mgr = CheckpointManager(storage, ManagerOptions(max_attempts=2, retry_backoff_seconds=0.01),
                            retention=[])
    with caplog.at_level(logging.ERROR, logger="ckpt.job.manager"):
        assert mgr.save(1, state)  # returns: the failure happens in the background
        assert mgr.wait(raise_errors=False) is None
    failed = mgr.events.of_kind("save_failed")
    assert [(e.fields["attempt"], e.fields["final"], e.fields["outcome"]) for e in failed] == \
        [(1, False, "retrying"), (2, True, "failed")]
    assert "no space left" in failed[-1].fields["error"]
    assert failed[-1].fields["retries"] == 1 and failed[-1].fields["bytes"] > 0
    assert any("save of step 1 failed (attempt 2/2)" in r.getMessage() for r in caplog.records)
    # No committed-but-broken checkpoint: no manifest, and the attempt's files are removed.
    assert not _manifest_exists(root, 1)
    assert not os.path.exists(os.path.join(root, "step_000000001"))
    assert ckpt.CheckpointStore(root).committed_steps() == []
    # wait() re-raises when asked, once.
    with pytest.raises(ckpt.RankFailuresError, match="no space left"):
        mgr.wait()
    mgr.wait()
    # Training was not killed: the next saves run, and commit once storage heals.
    _train_step(state)
    assert mgr.save(2, state)
    mgr.wait(raise_errors=False)
    storage.fail_attempts = 0
    assert mgr.save(3, state, block=True)
    assert mgr.wait() is not None
    mgr.close()
    assert ckpt.CheckpointStore(root).committed_steps() == [3]


def test_raise_on_failure_reraises_on_next_call(tmp_path):
    root = str(tmp_path / "root")
    storage = FaultyStorage(root, fail_attempts=-1)
    state = _state()
    mgr = CheckpointManager(storage, ManagerOptions(max_attempts=1, raise_on_failure=True),
                            retention=[])
    assert mgr.save(1, state)
    assert wait_for(lambda: not mgr.in_flight())
    with pytest.raises(ckpt.RankFailuresError, match="no space left"):
        mgr.save(2, state)
    # Raised once; the next save runs (and fails again in the background).
    assert mgr.save(3, state)
    assert wait_for(lambda: not mgr.in_flight())
    with pytest.raises(ckpt.RankFailuresError):
        mgr.maybe_save(4, state)  # no cadence: nothing to save, but the failure surfaces
    storage.fail_attempts = 0
    assert mgr.save(5, state, block=True)
    mgr.close()
    assert ckpt.CheckpointStore(root).committed_steps() == [5]


def test_transient_failures_are_retried_then_commit(tmp_path):
    root = str(tmp_path / "root")
    storage = FaultyStorage(root, fail_attempts=2)
    state = _state()
    with CheckpointManager(storage, ManagerOptions(max_attempts=3, retry_backoff_seconds=0.01),
                           retention=[]) as mgr:
        mgr.save(7, state)
        manifest = mgr.wait()
    assert manifest is not None and manifest.step == 7
    assert len(storage.failed_save_ids) == 2 and len(storage.ok_save_ids) == 1
    outcomes = [e.fields["outcome"] for e in mgr.events.recent
                if e.kind in ("save_failed", "save_committed")]
    assert outcomes == ["retrying", "retrying", "committed"]
    committed = mgr.events.of_kind("save_committed")[-1]
    assert committed.fields["attempts"] == 3 and committed.fields["retries"] >= 2
    # Only the successful attempt's files remain, and they load.
    step_dir = os.path.join(root, "step_000000007")
    assert all(storage.ok_save_ids[0] in n for n in os.listdir(step_dir) if n.endswith(".bin"))
    fresh = _state(5)
    ckpt.load(fresh, root, 7)
    assert_same(snapshot(state), snapshot(fresh))


def test_close_flush_commits_in_flight_save(tmp_path):
    root = str(tmp_path / "root")
    storage = FaultyStorage(root, delay_seconds=0.3)
    mgr = CheckpointManager(storage, retention=[])
    mgr.save(1, _state())
    assert mgr.in_flight()
    mgr.close(flush=True)
    assert _manifest_exists(root, 1)
    assert lease_released(root)
    with pytest.raises(RuntimeError, match="after close"):
        mgr.save(2, _state())


def test_close_abandon_leaves_nothing_committed_and_next_start_cleans_up(tmp_path):
    root = str(tmp_path / "root")
    storage = FaultyStorage(root, delay_seconds=0.3)
    mgr = CheckpointManager(storage, retention=[])
    mgr.save(1, _state(), block=True)
    storage.writing.clear()
    mgr.save(2, _state())
    assert storage.writing.wait(10)  # data files are being written
    mgr.close(flush=False)
    assert not _manifest_exists(root, 2)
    ev = mgr.events.of_kind("save_failed")[-1]
    assert ev.step == 2 and ev.fields["outcome"] == "abandoned" and ev.fields["final"]
    step2 = os.path.join(root, "step_000000002")
    markers = marker_names(os.listdir(step2))
    assert len(markers) == 1
    with open(os.path.join(step2, markers[0])) as f:
        assert json.load(f)["owner"] == mgr.owner
    # A folder without a pending marker is not ours to judge: it must survive.
    foreign = os.path.join(root, "step_000000003")
    os.makedirs(foreign)
    with open(os.path.join(foreign, "notes.txt"), "w") as f:
        f.write("someone else's")

    mgr2 = CheckpointManager(root, retention=[])
    try:
        assert [e.step for e in mgr2.events.of_kind("cleanup_aborted")] == [2]
        assert not os.path.exists(step2)
        assert os.path.exists(os.path.join(foreign, "notes.txt"))
        assert _manifest_exists(root, 1)
    finally:
        mgr2.close()


def test_abandon_before_writing_is_final_without_retry(tmp_path):
    storage = FaultyStorage(str(tmp_path / "root"))
    mgr = CheckpointManager(storage, ManagerOptions(max_attempts=3), retention=[])
    mgr._abandon.set()  # as close(flush=False) does, before the persist thread starts
    mgr.save(1, _state())
    with pytest.raises(SaveAbandoned):
        mgr.wait()
    assert [e.fields["attempt"] for e in mgr.events.of_kind("save_failed")] == [1]
    assert storage.num_data_writes == 0
    mgr.close(flush=False)


def test_save_and_load_events(tmp_path):
    root = str(tmp_path / "root")
    seen = []
    mgr = CheckpointManager(root, retention=[])
    mgr.events.subscribe(seen.append)
    state = _state()
    for step in (1, 2):
        mgr.save(step, state, user_metadata={"loss": 1.0 / step})
        mgr.wait()
        _train_step(state)
    assert mgr.save(2, state) is False  # already committed
    mgr.close()
    kinds = [e.kind for e in seen]
    assert kinds == ["save_staged", "save_committed", "save_cost"] * 2 + ["save_skipped"]
    staged = [e for e in seen if e.kind == "save_staged"]
    assert staged[0].fields["first"] and not staged[1].fields["first"]
    assert all(e.fields["stall_seconds"] >= 0 and e.fields["bytes"] == _tensor_bytes(state)
               for e in staged)
    for e in (e for e in seen if e.kind == "save_committed"):
        f = e.fields
        assert f["outcome"] == "committed" and f["persist_seconds"] > 0
        assert f["stall_seconds"] >= 0 and f["bytes"] == _tensor_bytes(state)
        assert f["bytes_per_second"] > 0 and f["retries"] == 0 and f["attempts"] == 1
        assert f["total_bytes"] >= f["bytes"]
        json.dumps(e.to_json())  # events serialise for logs
    for e in (e for e in seen if e.kind == "save_cost"):
        f = e.fields
        assert set(f["wall_seconds"]) == set(SAVE_COST_PHASES) == set(f["cpu_seconds"])
        assert all(v >= 0 for v in [*f["wall_seconds"].values(), *f["cpu_seconds"].values()])
        for phase in ("plan", "write", "fsync", "commit"):  # each really timed
            assert f["wall_seconds"][phase] > 0, phase
        assert f["background_cpu_seconds"] == pytest.approx(
            f["persist_thread_cpu_seconds"] + f["helper_cpu_seconds"], abs=1e-5)
        # The persist thread's own phases do not overlap: they add up to at most its time.
        on_thread = sum(f["wall_seconds"][k] for k in
                        ("plan", "collective", "commit", "bookkeep", "retention"))
        assert 0 < on_thread <= f["total_wall_seconds"] + 1e-3
        json.dumps(e.to_json())
    assert seen[-1].fields == {"reason": "already committed", "outcome": "skipped"}

    # Loading: load_done; a corrupt newest checkpoint: load_fallback, then load_done.
    flip_byte(next(os.path.join(root, "step_000000002", n)
                   for n in sorted(os.listdir(os.path.join(root, "step_000000002")))
                   if n.endswith(".bin")))
    mgr2 = CheckpointManager(root, retention=[])
    fresh = _state(9)
    manifest = mgr2.load_latest(fresh)
    assert manifest.step == 1
    fallback = mgr2.events.of_kind("load_fallback")
    assert [e.step for e in fallback] == [2] and "step 2" in fallback[0].fields["reason"]
    done = mgr2.events.of_kind("load_done")
    assert [e.step for e in done] == [1]
    assert done[0].fields["outcome"] == "loaded" and done[0].fields["bytes"] > 0
    assert done[0].fields["seconds"] > 0 and done[0].fields["num_fallbacks"] == 1
    assert mgr2.load_latest(_state(9), step=1).step == 1
    assert [e.step for e in mgr2.events.of_kind("load_done")] == [1, 1]
    mgr2.close()


def test_manager_creates_missing_root_and_validates_arguments(tmp_path):
    root = tmp_path / "a" / "b" / "root"
    mgr = CheckpointManager(str(root), retention=[])
    try:
        assert root.is_dir() and (root / "_lease.json").exists()
        assert mgr.load_latest(_state()) is None  # a fresh start
    finally:
        mgr.close()
    with pytest.raises(ValueError, match="busy"):
        CheckpointManager(str(root), ManagerOptions(busy="later"))
    with pytest.raises(ValueError, match="max_attempts"):
        CheckpointManager(str(root), ManagerOptions(max_attempts=0))


def test_wait_without_save_and_closed_twice(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "r"), ManagerOptions(use_lease=False))
    assert mgr.wait() is None
    mgr.close()
    mgr.close()
    assert issubclass(SaveAbandoned, CheckpointError)


def test_staging_memory_follows_the_state():
    from ckpt.dcp import StagingBuffers

    staging = StagingBuffers()
    state = {"a": torch.ones(64), "b": torch.ones(32)}
    staging.prepare(state)
    assert staging.num_allocations == 1 and staging.nbytes == 96 * 4
    staging.stage(state)
    assert staging.num_allocations == 1  # prepare() already allocated: the save only copies
    # A tensor changes shape and another disappears: at most one copy of the current state.
    state = {"a": torch.ones(16)}
    staged, nbytes = staging.stage(state)
    assert nbytes == 64 and staging.nbytes == 64 and staging.num_allocations == 2
    assert torch.equal(staged["a"], state["a"]) and staged["a"] is not state["a"]
