"""The save's background work in a writer process (``ManagerOptions(writer="process")``).

Real writer processes, killed or stopped at precise points by tests/ckpt/job/_writer_hooks
(started with the point in their environment): a writer killed at each phase of a save
fails that save as a failed save is reported (the final ``save_failed`` event, ``wait()``
raises, never a hang), or counts it committed when its manifest landed, and the next save
starts a new writer and commits; a writer whose lease was taken over while it was stopped
in the middle of a save does not commit; a writer killed as it deletes for retention is
reported and the next writer deletes what was left; two ranks save DTensor shards bit for
bit, writers of one rank killed at a save's rendezvous (the other rank's fails the save
within the lease TTL) and mid-save, and the coordinator's killed right after its commit
(every rank counts it) included, with the manifest a thread-mode save writes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ckpt
from ckpt.dcp._host_arena import _shared_directory
from ckpt.errors import CheckpointError
from ckpt.job import CheckpointManager, KeepLast, ManagerOptions
from ckpt.root import CheckpointStore, Lifecycle
from ckpt.root.lease import LEASE_NAME
from ckpt.storage import Storage
from tests.ckpt._helpers import assert_same
from tests.ckpt._mgr_util import wait_for
from tests.dist import run_ranks

HOOKS = str(Path(__file__).parent / "_writer_hooks")


@pytest.fixture
def writer_at(monkeypatch):
    """``writer_at(point)``: writers started from now on stop or die at ``point`` (None:
    nowhere)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        HOOKS, os.environ.get("PYTHONPATH")])))

    def at(point: str | None) -> None:
        if point:
            monkeypatch.setenv("CKPT_TEST_WRITER_AT", point)
        else:
            monkeypatch.delenv("CKPT_TEST_WRITER_AT", raising=False)
    return at


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 32, generator=g),
                      "b": torch.randn(16, generator=g).to(torch.bfloat16)},
            "extra": {"step": step, "pair": (step, "a"), "lr": 0.5 / step},
            "buffers": [torch.full((3,), float(step)), torch.arange(5, dtype=torch.int64) + step]}


def _wait(mgr: CheckpointManager, timeout: float = 120.0):
    """``mgr.wait(raise_errors=False)``, failing the test instead of hanging it."""
    box: list = []
    t = threading.Thread(target=lambda: box.append(mgr.wait(raise_errors=False)), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"wait() still blocked after {timeout} s"
    return box[0]


def _writer_pids(mgr: CheckpointManager) -> list[int]:
    """The manager's writer process, while it runs (its ``WriterProcess.pid``)."""
    pid = mgr._persister.pid
    return [] if pid is None else [pid]


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_writer_killed_at_each_phase_and_the_saves_after(tmp_path, writer_at, caplog):
    root = str(tmp_path / "root")
    # A block a training process killed with SIGKILL left behind: removed when a manager
    # in process mode starts, and said in the log.
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = f"{_shared_directory()}/ckpt-staging-{gone.pid}-t{os.getpid()}"
    with open(stale, "wb") as f:
        f.write(b"\0" * 4096)
    writer_at("kill_mid_write")
    with caplog.at_level(logging.WARNING, logger="ckpt.dcp._host_arena"):
        mgr = CheckpointManager(root, ManagerOptions(writer="process"), retention=[])
    try:
        assert not os.path.exists(stale) and f"{stale} (0 MiB) of process {gone.pid}" \
            in caplog.text
        # A dead writer's successor starts at once: each point is set for the next writer
        # before the save whose writer dies.
        writer_at("kill_before_commit")
        # Killed half-way through its first data file: the save failed, as any failed save.
        assert mgr.save(1, _state(1))
        assert _wait(mgr) is None
        failed = mgr.events.of_kind("save_failed")[-1]
        assert failed.step == 1 and failed.fields["final"] and failed.fields["outcome"] == "failed"
        assert "writer process" in failed.fields["error"] and "signal 9" in failed.fields["error"]
        with pytest.raises(CheckpointError, match="writer process of rank 0"):
            mgr.wait()
        # Killed right before its commit: failed too; another writer is started.
        writer_at("kill_after_commit")
        assert mgr.save(2, _state(2))
        assert _wait(mgr) is None and mgr.events.of_kind("save_failed")[-1].step == 2
        # Killed after its manifest landed: committed after all (read back), as the
        # persist thread counts an attempt that failed after its commit.
        writer_at(None)
        assert mgr.save(3, _state(3))
        committed3 = _wait(mgr)
        assert committed3 is not None and committed3.step == 3
        assert mgr.events.of_kind("save_committed")[-1].step == 3
        path = None
        for step in (4, 5):  # one writer for both, one shared block for every save
            assert mgr.save(step, _state(step))
            assert _wait(mgr).step == step
            assert path in (None, mgr.staging.shared_path)
            path = mgr.staging.shared_path
        assert path is not None and os.path.exists(path)
        # The training side knows the writer's commit: the step is refused at the gate.
        assert mgr.save(5, _state(5)) is False
        assert mgr.events.of_kind("save_skipped")[-1].fields["reason"] == "already committed"
        cost = mgr.events.of_kind("save_cost")[-1].fields
        assert cost["writer_process_cpu_seconds"] > 0 and cost["wall_seconds"]["write"] > 0
        done = mgr.events.of_kind("save_committed")[-1].fields
        assert done["bytes"] == sum(t.numel() * t.element_size() for t in
                                    [*_state(5)["model"].values(), *_state(5)["buffers"]])
    finally:
        mgr.close()
    assert not os.path.exists(path)  # the shared block is freed at close
    store = CheckpointStore(root)
    assert store.committed_steps() == [3, 4, 5]
    store.verify(3)
    # The killed attempts' files are leftovers the life-cycle recognises by their markers;
    # of the attempt killed after its commit, only its stale marker is.
    leftovers = dict(Lifecycle(Storage(root)).leftovers())
    assert sorted(leftovers) == [1, 2, 3]
    assert any(n.endswith(".bin") for n in leftovers[1])
    assert all(n.startswith("pending-") for n in leftovers[3]), leftovers[3]
    state = _state(1)
    assert ckpt.load_latest(state, root).step == 5
    assert_same(_state(5), state, "step 5 saved by a writer process")


def _foreign_record(ttl: float) -> bytes:
    return json.dumps({"holder": "feedfacecafe0000", "job": "other", "host": socket.gethostname(),
                       "pid": 1, "acquired_unix": time.time(), "heartbeat_unix": time.time(),
                       "ttl_seconds": ttl, "generation": 99, "released": False}).encode()


def test_a_writer_fenced_off_while_stopped_mid_save_does_not_commit(tmp_path, writer_at):
    root = str(tmp_path / "root")
    writer_at("stop_mid_write")
    mgr = CheckpointManager(root, ManagerOptions(writer="process", lease_ttl_seconds=2.0),
                            retention=[])
    storage = Storage(root)
    try:
        mgr.save(1, _state(1))
        assert wait_for(lambda: any(_stopped(p) for p in _writer_pids(mgr)), timeout=60)
        [pid] = _writer_pids(mgr)
        storage.write_bytes(LEASE_NAME, _foreign_record(60))  # another job takes over
        assert wait_for(lambda: mgr.events.of_kind("lease_lost"), timeout=20)
        os.kill(pid, signal.SIGCONT)
        assert _wait(mgr) is None
        failed = mgr.events.of_kind("save_failed")[-1]
        assert failed.fields["outcome"] == "abandoned" and "lease lost" in failed.fields["error"]
        assert not storage.exists("step_000000001/manifest.json")
        assert mgr.save(2, _state(2)) is False
        assert mgr.events.of_kind("save_skipped")[-1].fields["reason"] == "lease lost"
    except BaseException:
        for pid in _writer_pids(mgr):  # a stopped writer would keep close() waiting
            os.kill(pid, signal.SIGKILL)
        raise
    finally:
        mgr.close()
    assert json.loads(storage.read_bytes(LEASE_NAME))["holder"] == "feedfacecafe0000"
    assert CheckpointStore(storage).committed_steps() == []


def test_bad_writer_options_are_refused_naming_them(tmp_path):
    with pytest.raises(ValueError, match="writer='fork'"):
        CheckpointManager(str(tmp_path / "a"), ManagerOptions(writer="fork", use_lease=False))
    with pytest.raises(ValueError, match="staging_budget_bytes"):
        CheckpointManager(str(tmp_path / "b"),
                          ManagerOptions(writer="process", staging_budget_bytes=1 << 20,
                                         use_lease=False))
    with pytest.raises(ValueError, match="memory://"):
        CheckpointManager("memory://writer-process",
                          ManagerOptions(writer="process", use_lease=False))


_TTL = 10.0


def _two_ranks(rank: int, world: int, root: str, hooks: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def state(step: int) -> dict:
        full = torch.arange(40 * 6, dtype=torch.float32).reshape(40, 6) * step
        return {"model": {"w": distribute_tensor(full, mesh, [Shard(0)]),
                          "r": torch.linspace(0, step, 7)},
                "extra": {"step": step}, f"own{rank}": torch.full((4,), float(rank + step))}

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [
        hooks, os.environ.get("PYTHONPATH")]))
    if rank == 1:  # this rank's first writer dies as it comes to the rendezvous
        os.environ["CKPT_TEST_WRITER_AT"] = "kill_at_rendezvous"
    else:  # the coordinator's first writer dies right after its commit of step 3
        os.environ["CKPT_TEST_WRITER_AT"] = "kill_after_commit"
        os.environ["CKPT_TEST_WRITER_STEP"] = "3"
    # The lease TTL bounds the writers' rendezvous (a writer not there by then is gone).
    mgr = CheckpointManager(f"{root}/process",
                            ManagerOptions(writer="process", lease_ttl_seconds=_TTL),
                            retention=[])
    os.environ.pop("CKPT_TEST_WRITER_AT", None)
    os.environ.pop("CKPT_TEST_WRITER_STEP", None)
    out = {}
    try:
        if rank == 1:  # its second (started when the first dies) half-way through a file
            os.environ["CKPT_TEST_WRITER_AT"] = "kill_mid_write"
        t0 = time.monotonic()
        mgr.save(1, state(1))
        out["rendezvous_failed"] = mgr.wait(raise_errors=False) is None and \
            mgr.events.of_kind("save_failed")[-1].fields["final"]
        out["rendezvous_seconds"] = time.monotonic() - t0
        out["rendezvous_error"] = mgr.events.of_kind("save_failed")[-1].fields["error"]
        os.environ.pop("CKPT_TEST_WRITER_AT", None)  # the writers after the second do not
        # Step 3: the coordinator's writer dies between its manifest and telling the others:
        # every rank counts it committed (the others read it back as the coordinator does).
        mgr.save(2, state(2))
        out["first"] = mgr.wait(raise_errors=False) is None and \
            mgr.events.of_kind("save_failed")[-1].fields["final"]
        for step in (3, 4):
            mgr.save(step, state(step))
            m = mgr.wait()
            out[f"committed{step}"] = mgr.newest_committed_step == step
            if rank == 0:
                out["manifest"] = m
        out["writer_failed3"] = any(e.step == 3 and e.fields["final"]
                                    for e in mgr.events.of_kind("save_failed"))
        out["committed_events3"] = sum(e.step == 3 for e in mgr.events.of_kind("save_committed"))
        # The keys of save 1's timed-out rendezvous went at a later one.
        prefix = mgr._persister._init["rendezvous"]["prefix"]
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False)
        out["stale_keys"] = [k for k in (f"{prefix}/1/n", f"{prefix}/1/all")
                             if store.check([k])]
    finally:
        mgr.close()
    thread = CheckpointManager(f"{root}/thread", retention=[])
    try:
        thread.save(4, state(4), block=True)
        expected = thread.last_committed
    finally:
        thread.close()
    loaded = state(0)
    loaded["model"]["w"].to_local().zero_()
    ckpt.load_latest(loaded, f"{root}/process")
    out["bit_exact"] = all(torch.equal(a, b) for a, b in (
        (loaded["model"]["w"].full_tensor(), state(4)["model"]["w"].full_tensor()),
        (loaded["model"]["r"], state(4)["model"]["r"]),
        (loaded[f"own{rank}"], state(4)[f"own{rank}"]))) and loaded["extra"] == {"step": 4}
    if rank == 0:
        got = out.pop("manifest")
        out["same_manifest"] = (got.tensors.keys() == expected.tensors.keys()
                                and all(got.tensors[k]["shape"] == expected.tensors[k]["shape"]
                                        and got.tensors[k]["sharded"] ==
                                        expected.tensors[k]["sharded"] for k in got.tensors)
                                and got.planner_data == expected.planner_data
                                and sorted(got.parts) != [] and len(got.parts) ==
                                len(expected.parts))
    return out


def test_two_ranks_save_shards_bit_for_bit_through_killed_writers(tmp_path):
    results = run_ranks(_two_ranks, 2, str(tmp_path), HOOKS, timeout=150)
    for rank, out in enumerate(results):
        # Rank 1's writer died at the rendezvous: the save failed on both ranks, rank 0's
        # writer waiting no longer than the lease TTL (not the store's 10 minutes).
        assert out["rendezvous_failed"], (rank, out)
        assert out["first"], (rank, out)  # every rank reports the save its writer lost
        assert out["committed3"] and out["committed4"] and out["bit_exact"], (rank, out)
    # Rank 1's writer lost step 3 (the coordinator's died after its commit) and the rank
    # counts the commit: reported committed once, with no final failure before it.
    for rank, out in enumerate(results):
        assert not out["writer_failed3"] and out["committed_events3"] == 1, (rank, out)
        assert out["stale_keys"] == [], (rank, out)
    assert "rendezvous of save 1: 1 of 2 writers arrived within 10 s (the lease TTL)" in \
        results[0]["rendezvous_error"], results[0]
    assert results[0]["rendezvous_seconds"] < _TTL + 20, results[0]
    assert results[0]["same_manifest"]


def test_retention_deletes_in_the_writer_and_survives_its_death(tmp_path, writer_at):
    """Retention's policies decide in the training process, the writer process deletes: a
    writer killed as it deletes is reported (``retention_failed``), never a failed save;
    when the next writer dies right after its commit, the training process deletes what was
    left itself; the training side knows which steps are gone."""
    root = str(tmp_path / "root")
    writer_at("kill_at_retention")
    mgr = CheckpointManager(root, ManagerOptions(writer="process"), retention=[KeepLast(1)])
    try:
        writer_at("kill_after_commit")  # the writer started when the first one dies
        for step in (1, 2):
            assert mgr.save(step, _state(step))
            assert _wait(mgr).step == step
        # The writer died deleting step 1 (the deletion was the writer's): reported, never
        # a failed save.
        failed = mgr.events.of_kind("retention_failed")
        assert failed and "writer process" in failed[-1].fields["error"], failed
        assert mgr.events.of_kind("save_committed")[-1].step == 2
        assert CheckpointStore(root).committed_steps() == [1, 2]
        writer_at(None)
        # Its successor dies right after committing step 3: committed (read back), and with
        # no writer to carry retention out, the training process deletes steps 1 and 2.
        assert mgr.save(3, _state(3))
        assert _wait(mgr).step == 3
        assert mgr._persister.num_starts == 2 and mgr._persister.pid is None  # it died
        assert [e.step for e in mgr.events.of_kind("retention_deleted")] == [1, 2]
        assert CheckpointStore(root).committed_steps() == [3]
        assert mgr.life.known_committed() == [3]
        assert len(mgr.events.of_kind("retention_failed")) == 1
    finally:
        mgr.close()
    state = _state(1)
    assert ckpt.load_latest(state, root).step == 3
    assert_same(_state(3), state, "step 3 after the writers died in retention and after a commit")
