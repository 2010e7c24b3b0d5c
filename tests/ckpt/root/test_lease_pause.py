"""A lease holder that stalls (a GC or VM pause, SIGSTOP) while it holds the lease, on local
disk and on S3.

The stall is injected where it hurts most: inside the compare-and-swap of the lease record,
right before the new record lands. On local disk that is the rename over ``_lease.json``
with the swap's lock held; on S3 the conditional ``PUT`` held in flight by the proxy in
front of the server. Meanwhile a second job finds the record stale and takes the lease over
(on local disk it has to break the stalled holder's lock to do so). When the holder resumes
its swap must fail: it learns that it lost, the new holder keeps the lease, and the root
holds nothing that ``ckpt verify`` fails on. A writer fenced off in the middle of a commit
leaves a fenced manifest, which ``ckpt verify`` reports as a leftover and ``ckpt gc``
removes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import pytest
import torch

import ckpt
from ckpt.cli import main as ckpt_main
from ckpt.job import CheckpointManager, ManagerOptions
from ckpt.root import CheckpointStore, FENCED, Lease, acquire_lease, release_lease
from ckpt.root.lease import LEASE_NAME
from ckpt.storage import Storage
from tests.ckpt._mgr_util import wait_for

pytestmark = pytest.mark.timeout(120)

TTL = 1.0
BREAK_SECONDS = 0.3
"""The new holder's wait for a stalled swapper's lock, before it breaks it (local disk)."""


class SwapStall:
    """Holds the next write of the lease record (one job's only) right before it lands,
    until :meth:`resume`. ``stalled`` is set once it is held."""

    def __init__(self):
        self.stalled = threading.Event()
        self._go = threading.Event()
        self._armed = False

    def arm(self) -> None:
        self._armed = True

    def resume(self) -> None:
        self._go.set()

    def hold(self) -> None:
        """Called where the write is about to land: wait there if armed (once)."""
        if self._armed:
            self._armed = False
            self.stalled.set()
            assert self._go.wait(60), "the stalled swap was never resumed"


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path):
    """``(url, storage_options)`` of an empty root on local disk or on the loopback S3
    server."""
    if request.param == "local":
        return str(tmp_path / "root"), None
    s3 = request.getfixturevalue("s3_root")
    return s3.url, s3.storage_options


@pytest.fixture
def roots(where, request, monkeypatch):
    """``(stalling, other, stall)``: two Storages of one empty root, the first one's lease
    writes held by ``stall`` when armed."""
    url, options = where
    stall = SwapStall()
    if options is None:
        stalling, other = Storage(url), Storage(url)
        lease_path = stalling.local_path(LEASE_NAME)
        real_replace = os.replace

        # Both swaps, before and after this change, land the record with os.replace; the
        # other job is started only after the stall, so the one write held is the first's.
        def replace(src, dst, *args, **kwargs):
            if os.fspath(dst) == lease_path:
                stall.hold()
            return real_replace(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "replace", replace)
        other.backend.swap_lock_timeout_seconds = BREAK_SECONDS
    else:
        proxy = request.getfixturevalue("s3_proxy")

        def delay(req) -> float:
            if req.method == "PUT" and req.headers.get("If-Match") \
                    and req.path.split("?")[0].endswith("/" + LEASE_NAME):
                stall.hold()
            return 0.0

        proxy.delay = delay
        stalling, other = Storage(url, proxy.storage_options), Storage(url, options)
    stalling.makedirs("")
    return stalling, other, stall


def _record(storage: Storage) -> dict:
    return json.loads(storage.read_bytes(LEASE_NAME))


def test_a_holder_stalled_inside_its_swap_learns_it_lost(roots):
    """Holder A stalls inside the swap of its renewal past its TTL; B takes the lease over;
    A resumes: its swap fails (it does not put its record back over B's), and B keeps the
    lease."""
    stalling, other, stall = roots
    a = Lease(stalling, ttl_seconds=TTL, job_name="a")
    a.acquire(heartbeat=False)
    stall.arm()
    renewed = []
    t = threading.Thread(target=lambda: renewed.append(a.confirm()))
    t.start()
    try:
        assert stall.stalled.wait(30), "the renewal never reached its write"
        time.sleep(TTL + 0.3)  # A's record is stale now: to anyone else its holder is dead
        b = Lease(other, ttl_seconds=30, job_name="b")
        b.acquire(heartbeat=False)
        assert b.took_over["holder"] == a.holder_id and b.generation == a.generation + 1
    finally:
        stall.resume()
        t.join(60)
    assert renewed == [False] and a.lost and not a.held
    assert _record(other)["holder"] == b.holder_id
    assert b.confirm() and b.check() and b.heartbeat() and b.held
    assert a.confirm() is False and a.heartbeat() is False
    assert _record(other)["holder"] == b.holder_id
    b.release()
    assert _record(other)["released"] is True
    assert sorted(n for n, _, _ in other.listdir("")) == [LEASE_NAME]  # no lock left behind


def _state(step: int) -> dict:
    return {"w": torch.full((8,), float(step))}


def _cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = ckpt_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out + err


def _cli_args(storage: Storage) -> list[str]:
    endpoint = (storage.storage_options.get("client_kwargs") or {}).get("endpoint_url")
    return [storage.url] + (["--endpoint-url", endpoint] if endpoint else [])


def test_a_writer_stalled_past_its_lease_stops_saving_and_the_root_verifies(roots, capsys,
                                                                            caplog):
    """Job A stalls inside a lease renewal (its heartbeat's, or a commit's) past its TTL;
    job B takes the root over and saves. A resumes: it learns that it lost the lease, says
    so once, and saves nothing more; B's lease and saves stand; ``ckpt verify`` passes."""
    stalling, other, stall = roots
    caplog.set_level(logging.ERROR, logger="ckpt")
    a = CheckpointManager(stalling, ManagerOptions(lease_ttl_seconds=TTL, job_name="a"),
                          retention=[])
    b = None
    try:
        for step in (1, 2):
            assert a.save(step, _state(step), block=True)
        stall.arm()  # the heartbeat (every TTL/4) or the next commit's renewal stalls
        a.save(3, _state(3))
        assert stall.stalled.wait(30)
        time.sleep(TTL + 0.3)
        b = CheckpointManager(other, ManagerOptions(lease_ttl_seconds=30, job_name="b"),
                              retention=[])
        assert b.lease.took_over["holder"] == a.owner
        assert b.save(10, _state(10), block=True)
        stall.resume()
        assert wait_for(lambda: a.events.of_kind("lease_lost"), timeout=30), \
            "the stalled writer never learned that it lost the lease"
        a.wait(raise_errors=False)
        assert [a.save(step, _state(step), block=True) for step in range(4, 10)] == [False] * 6
        assert a.lease_lost and len(a.events.of_kind("lease_lost")) == 1
        skipped = [e.step for e in a.events.of_kind("save_skipped")
                   if e.fields["reason"] == "lease lost"]
        assert skipped == list(range(4, 10))
        said = [r for r in caplog.records if "nor any later step" in r.getMessage()]
        assert len(said) == 1 and "step 4 " in said[0].getMessage()
        assert b.lease.held and b.lease.check()
        assert b.save(11, _state(11), block=True)
        assert _record(other)["holder"] == b.owner
    finally:
        stall.resume()
        a.close()
        if b is not None:
            b.close()
    store = CheckpointStore(Storage(other.url, other.storage_options))
    committed = store.committed_steps()
    assert {10, 11} <= set(committed) and set(committed) <= {1, 2, 3, 10, 11}
    for step in committed:  # every manifest there counts: none of A's after the takeover
        store.read_manifest(step)
    rc, out = _cli(capsys, "verify", *_cli_args(other))
    assert rc == 0, out
    assert "fenced" not in out and "CORRUPT" not in out


class HoldingStorage(Storage):
    """A real Storage whose next exclusive create of a name ending in ``pattern`` waits
    until released (a commit delayed in flight)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pattern: str | None = None
        self.held = threading.Event()
        self.go = threading.Event()

    def create_exclusive(self, rel, data):
        if self.pattern is not None and rel.endswith(self.pattern):
            self.pattern = None
            self.held.set()
            assert self.go.wait(60), "held create never released"
        return super().create_exclusive(rel, data)


def test_verify_reports_a_fenced_leftover_as_such_and_gc_removes_it(where, capsys):
    """A's commit of step 2 is delayed until after B took the lease over (by force): its
    manifest lands fenced. ``ckpt verify`` of the root passes and names it a fenced
    leftover (a step asked for by number still fails: it is no checkpoint); ``ckpt gc``
    removes it; A stopped saving."""
    url, options = where
    other = Storage(url, options)
    storage = HoldingStorage(url, options)
    a = CheckpointManager(storage, ManagerOptions(lease_ttl_seconds=30, job_name="a"),
                          retention=[])
    try:
        assert a.save(1, _state(1), block=True)
        storage.pattern = "step_000000002/manifest.json"
        a.save(2, _state(2))
        assert storage.held.wait(30)
        b = acquire_lease(Storage(other.url, other.storage_options), ttl_seconds=30,
                          job_name="b", force=True)
        release_lease(b)
        storage.go.set()
        a.wait(raise_errors=False)
        assert a.events.of_kind("save_failed")[-1].fields["outcome"] == "abandoned"
        assert a.save(3, _state(3), block=True) is False
    finally:
        storage.go.set()
        a.close()
    store = CheckpointStore(Storage(other.url, other.storage_options))
    assert store.info(2).status == FENCED
    args = _cli_args(other)
    rc, out = _cli(capsys, "verify", *args)
    assert rc == 0, out
    assert "step 1: ok" in out and "step 2: fenced leftover" in out and "CORRUPT" not in out
    rc, out = _cli(capsys, "verify", *args, "--step", 2)
    assert rc == 1 and "step 2: fenced leftover" in out
    rc, out = _cli(capsys, "gc", *args, "--yes")
    assert rc == 0, out
    assert [e.status for e in store.entries(2)] == [] and store.committed_steps() == [1]
    rc, out = _cli(capsys, "verify", *args)
    assert rc == 0 and "step 2" not in out, out


def _staged(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(LEASE_NAME + ".swap-")
                  and n != LEASE_NAME + ".swap-lock")


class StageStall:
    """Holds a swapper (the next, when armed) right after it staged its record, before it
    renames the staged folder into the lock (steps 1 and 2 of the local swap); ``between``
    runs there first, if set. ``stalled`` is set once it is held."""

    def __init__(self, monkeypatch):
        self.stalled, self.go = threading.Event(), threading.Event()
        self.armed = False
        self.between = None
        real_rename = os.rename

        def rename(src, dst, *args, **kwargs):
            if self.armed and os.fspath(dst).endswith(LEASE_NAME + ".swap-lock"):
                self.armed = False
                if self.between is not None:
                    self.between(os.fspath(src))
                self.stalled.set()
                assert self.go.wait(60), "the stalled swap was never resumed"
            return real_rename(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "rename", rename)


def test_a_holder_paused_before_its_lock_learns_it_lost_its_staged_swap_removed(
        tmp_path, monkeypatch):
    """Holder A stalls after staging its renewal, before taking the swap's lock, past its
    TTL and past the age at which a staged swap counts as a dead swapper's; B takes the
    lease over, and its first swap removes A's staged folder. A resumes: its swap starts
    over and fails (A learns it lost, with no error), B keeps the lease, nothing is left
    beside the record."""
    url = str(tmp_path / "root")
    stalling, other = Storage(url), Storage(url)
    stalling.makedirs("")
    other.backend.stale_stage_seconds = 0.2
    stall = StageStall(monkeypatch)
    a = Lease(stalling, ttl_seconds=TTL, job_name="a")
    a.acquire(heartbeat=False)
    stall.armed = True
    renewed = []
    t = threading.Thread(target=lambda: renewed.append(a.confirm()))
    t.start()
    try:
        assert stall.stalled.wait(30)
        assert len(_staged(url)) == 1
        time.sleep(TTL + 0.3)
        b = Lease(other, ttl_seconds=30, job_name="b")
        b.acquire(heartbeat=False)
        assert b.took_over["holder"] == a.holder_id
        assert _staged(url) == []  # A's staged swap, unchanged for longer than 0.2 s
    finally:
        stall.go.set()
        t.join(60)
    assert renewed == [False] and a.lost
    assert _record(other)["holder"] == b.holder_id and b.confirm() and b.check()
    b.release()
    assert sorted(os.listdir(url)) == [LEASE_NAME]


def test_a_swap_whose_staged_record_is_removed_under_it_never_lands_it(tmp_path,
                                                                       monkeypatch):
    """The staged record removed (as stale) between a swapper's staging and its lock, the
    emptied folder still there: the swapper takes the lock with no record in it, its
    rename over the record is refused, and it starts over: the swap lands once, from a
    record staged again, and leaves nothing behind."""
    url = str(tmp_path / "root")
    storage = Storage(url)
    storage.makedirs("")
    storage.create_exclusive(LEASE_NAME, b"old")
    stall = StageStall(monkeypatch)
    stall.between = lambda stage: os.unlink(os.path.join(stage, os.listdir(stage)[0]))
    stall.armed = True
    stall.go.set()
    assert storage.replace_if_unchanged(LEASE_NAME, b"new", b"old")
    assert storage.read_bytes(LEASE_NAME) == b"new"
    assert sorted(os.listdir(url)) == [LEASE_NAME]


def test_a_dead_swappers_staged_folder_is_removed_by_gc_and_verify_passes(tmp_path, capsys):
    """A swapper SIGKILLed while it waits for the lock leaves its staged folder. ``ckpt
    verify`` passes and says nothing of it; ``ckpt gc`` (the next swap of the record)
    removes it once it is older than a swap could wait, and leaves a fresh one."""
    url = str(tmp_path / "root")
    for step in (1, 2):
        ckpt.save(_state(step), url, step)
    lock = os.path.join(url, LEASE_NAME + ".swap-lock")
    os.mkdir(lock)
    open(os.path.join(lock, "0" * 32), "wb").close()  # a live swapper's lock
    storage = Storage(url)
    storage.backend.swap_lock_timeout_seconds = 3600.0
    pid = os.fork()
    if pid == 0:  # the swapper: stages its record, then waits for the lock until killed
        try:
            storage.replace_if_unchanged(LEASE_NAME, b"mine", b"theirs")
        finally:
            os._exit(1)
    try:
        assert wait_for(lambda: _staged(url), timeout=60), "the swapper never staged"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    (dead,) = _staged(url)
    os.unlink(os.path.join(lock, "0" * 32))
    os.rmdir(lock)
    rc, out = _cli(capsys, "verify", url)
    assert rc == 0 and "step 1: ok" in out and "step 2: ok" in out and "swap" not in out, out
    old = time.time() - 3600
    os.utime(os.path.join(url, dead), (old, old))
    fresh = f"{LEASE_NAME}.swap-{'f' * 32}"
    os.mkdir(os.path.join(url, fresh))  # a swapper staging right now: not touched
    rc, out = _cli(capsys, "gc", url, "--yes")
    assert rc == 0, out
    assert _staged(url) == [fresh]
    assert CheckpointStore(url).committed_steps() == [1, 2]
