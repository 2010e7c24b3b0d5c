"""The write lease: one writer per checkpoint root, on local disk and on S3.

The first job is a genuinely separate process (``_mgr_lease_child``) that holds the lease,
has committed step 1 and is in the middle of saving step 2. A second job is refused with an
error naming the holder; once the first is SIGKILLed the second takes over (and removes the
dead job's half-written save). A lease whose holder cannot be checked (another host) is only
taken over after its TTL. A writer whose lease was taken stops saving, reported.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import ckpt
from ckpt.errors import LeaseHeldError
from ckpt.job import CheckpointManager, ManagerOptions
from ckpt.root import CheckpointStore, Lease, Lifecycle
from ckpt.root.lease import LEASE_NAME
from ckpt.storage import Storage
from tests.ckpt._mgr_util import FaultyStorage, wait_for
from tests.dist import run_ranks

pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TTL = 2.0


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    """(url, storage_options) of an empty root on local disk or on the loopback S3 server."""
    if request.param == "local":
        return str(tmp_path / "root"), None
    try:
        s3 = request.getfixturevalue("s3_root")
    except pytest.FixtureLookupError:
        pytest.skip("no s3_root fixture in tests/conftest.py")
    return s3[0], s3[1]


def _start_child(url: str, options, log_path: str) -> tuple[subprocess.Popen, dict]:
    err = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.ckpt.root._mgr_lease_child", url, str(TTL),
         json.dumps(options) if options else ""],
        cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
        env={**os.environ, "PYTHONPATH": REPO})
    err.close()
    deadline = time.monotonic() + 90
    line = ""
    while time.monotonic() < deadline and proc.poll() is None:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            break
    if not line.startswith("READY "):
        proc.kill()
        proc.wait()
        with open(log_path) as f:
            raise AssertionError(f"lease child did not start: {line!r}\n{f.read()[-3000:]}")
    return proc, json.loads(line[len("READY "):])


def _released(storage) -> bool:
    """The lease record stays at the root, marked released (it carries the generation)."""
    return json.loads(storage.read_bytes(LEASE_NAME))["released"] is True


def _foreign_record(ttl: float) -> bytes:
    now = time.time()
    return json.dumps({"holder": "feedfacecafe0000", "job": "elsewhere-job",
                       "host": "some-other-host", "pid": 4242, "acquired_unix": now,
                       "heartbeat_unix": now, "ttl_seconds": ttl}).encode()


def test_second_job_is_refused_then_takes_over_after_sigkill(root, tmp_path):
    url, options = root
    child, info = _start_child(url, options, str(tmp_path / "child.log"))
    try:
        assert info["took_over"] is False
        with pytest.raises(LeaseHeldError) as excinfo:
            CheckpointManager(url, ManagerOptions(storage_options=options, lease_ttl_seconds=TTL))
        msg = str(excinfo.value)
        assert f"pid {info['pid']}" in msg and f"host {socket.gethostname()}" in msg
        assert info["holder"] in msg and "'child'" in msg
        # The refused manager left nothing behind: the child's save in flight is untouched.
        store = CheckpointStore(Storage(url, options))
        assert [i.status for i in store.list()] == ["committed", "incomplete"]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    # Dead without releasing: its lease and its half-written step 2 are still there.
    storage = Storage(url, options)
    assert json.loads(storage.read_bytes(LEASE_NAME))["holder"] == info["holder"]
    assert [s for s, _ in Lifecycle(storage).leftovers()] == [2]

    mgr = None
    deadline = time.monotonic() + 30
    while mgr is None:
        try:
            mgr = CheckpointManager(url,
                                    ManagerOptions(storage_options=options, lease_ttl_seconds=TTL),
                                    retention=[])
        except LeaseHeldError:
            assert time.monotonic() < deadline, "the dead job's lease was never taken over"
            time.sleep(0.2)
    try:
        acquired = mgr.events.of_kind("lease_acquired")
        assert acquired and acquired[0].fields["took_over"] is True
        assert mgr.lease.took_over["holder"] == info["holder"]
        assert [e.step for e in mgr.events.of_kind("cleanup_aborted")] == [2]
        assert mgr.store.steps() == [1]
        state = {"w": torch.zeros(6)}
        assert mgr.load_latest(state).step == 1
        assert torch.equal(state["w"], torch.arange(6, dtype=torch.float32))
        mgr.save(2, state, block=True)
        assert mgr.store.committed_steps() == [1, 2]
    finally:
        mgr.close()
    assert _released(storage)  # released at a clean exit


def test_live_lease_elsewhere_is_taken_only_after_ttl(root):
    url, options = root
    storage = Storage(url, options)
    storage.makedirs("")
    storage.write_bytes(LEASE_NAME, _foreign_record(TTL))
    t0 = time.monotonic()
    with pytest.raises(LeaseHeldError, match="host some-other-host, pid 4242"):
        CheckpointManager(url, ManagerOptions(storage_options=options, lease_ttl_seconds=TTL))
    assert json.loads(storage.read_bytes(LEASE_NAME))["pid"] == 4242  # untouched
    time.sleep(max(0.0, TTL + 0.3 - (time.monotonic() - t0)))
    mgr = CheckpointManager(url, ManagerOptions(storage_options=options, lease_ttl_seconds=TTL),
                            retention=[])
    try:
        assert mgr.events.of_kind("lease_acquired")[0].fields["took_over"] is True
        assert mgr.lease.took_over["host"] == "some-other-host"
        assert json.loads(storage.read_bytes(LEASE_NAME))["holder"] == mgr.owner
    finally:
        mgr.close()


def test_lost_lease_stops_saves_and_blocks_the_commit_in_flight(root):
    url, options = root
    storage = FaultyStorage(url, options, delay_seconds=0.5)
    mgr = CheckpointManager(storage, ManagerOptions(lease_ttl_seconds=TTL), retention=[])
    state = {"w": torch.ones(3)}
    try:
        mgr.save(1, state)  # in flight while another writer takes the lease
        assert storage.writing.wait(30)
        storage.write_bytes(LEASE_NAME, _foreign_record(60))
        # Noticed by the heartbeat, which marks the lease lost and then emits the event.
        assert wait_for(lambda: mgr.events.of_kind("lease_lost"), timeout=10)
        assert mgr.lease.lost and mgr.events.of_kind("lease_lost")[0].fields["reason"]
        mgr.wait(raise_errors=False)
        failed = mgr.events.of_kind("save_failed")[-1]
        assert failed.fields["outcome"] == "abandoned" and "lease lost" in failed.fields["error"]
        assert not storage.exists("step_000000001/manifest.json")
        assert mgr.save(2, state) is False
        skipped = mgr.events.of_kind("save_skipped")[-1]
        assert skipped.step == 2 and skipped.fields["reason"] == "lease lost"
    finally:
        mgr.close()
    # The new holder's lease is not ours to release.
    assert json.loads(storage.read_bytes(LEASE_NAME))["holder"] == "feedfacecafe0000"
    assert CheckpointStore(storage).committed_steps() == []


def test_concurrent_heartbeats_do_not_lose_the_lease(tmp_path):
    storage = Storage(str(tmp_path))
    lease = Lease(storage, ttl_seconds=30)
    lease.acquire()
    errors = []

    def beat():
        for _ in range(25):
            if not lease.heartbeat():
                errors.append("lost")

    threads = [threading.Thread(target=beat) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and not lease.lost and lease.held
    lease.release()
    assert _released(storage)
    with pytest.raises(ValueError, match="ttl"):
        Lease(storage, ttl_seconds=0)


def test_a_lease_lost_during_the_last_save_is_agreed_before_the_run_ends(root):
    """The last save of a run: its checks found the lease held, its commit found it taken.
    No later save agrees the loss, so ``check_lease`` does (the trainer's exit code 4)."""
    url, options = root
    storage = FaultyStorage(url, options, delay_seconds=0.5)
    mgr = CheckpointManager(storage, ManagerOptions(lease_ttl_seconds=TTL), retention=[])
    try:
        mgr.save(1, {"w": torch.ones(3)})
        assert storage.writing.wait(30)
        storage.write_bytes(LEASE_NAME, _foreign_record(60))
        mgr.wait(raise_errors=False)
        assert not mgr.lease_lost  # not agreed yet: no save came after
        assert mgr.check_lease() is True and mgr.lease_lost
        assert mgr.lease_lost_url == storage.url
    finally:
        mgr.close()


_SPARSE_CHILD = """
import json, resource, sys
import torch, ckpt
from ckpt.cli import main
from ckpt.root import read_lease
from ckpt.storage import Storage

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

root, big = sys.argv[1], sys.argv[2]
main(["list", root])  # warm: the imports, one listing
before = peak()
out = {"info": read_lease(Storage(root)), "list": main(["list", root])}
try:
    ckpt.save({"w": torch.ones(2)}, root, 3)
    out["save"] = ""
except Exception as exc:
    out["save"] = f"{type(exc).__name__}: {exc}"
storage = Storage(root)
try:
    storage.create_exclusive(big, b"x")
    out["create"] = ""
except Exception as exc:
    out["create"] = type(exc).__name__
out["swap"] = storage.replace_if_unchanged(big, b"new", b"old")
out["grew"] = peak() - before
print(json.dumps(out))
"""


def test_a_lease_record_replaced_by_a_large_sparse_file_is_never_read_whole(tmp_path):
    """``_lease.json`` truncated up to 1.5 GiB (sparse: no disk): reading the lease (``ckpt
    list``, a job's start), and an exclusive create or a compare-and-swap that meets such a
    file, read no more than a record may hold; a job's start is refused in one line naming
    the file and the fix (no swap could take over what it will not read)."""
    root = tmp_path / "root"
    ckpt.save({"w": torch.ones(2)}, str(root), 1)
    for name in (LEASE_NAME, "big.bin"):
        with open(root / name, "ab") as f:
            f.truncate(3 << 29)
    out = subprocess.run([sys.executable, "-c", _SPARSE_CHILD, str(root), "big.bin"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["info"]["damaged"] and got["list"] == 0, got
    assert got["save"].startswith("CorruptCheckpointError") and LEASE_NAME in got["save"] \
        and "delete it" in got["save"], got
    assert got["create"] == "FileExistsError" and got["swap"] is False, got
    assert got["grew"] < 64 << 20, got  # not the 1.5 GiB each file holds
    assert CheckpointStore(str(root)).committed_steps() == [1]


def _save_on_unreadable_lease(rank: int, world_size: int, root: str) -> str:
    started = time.monotonic()
    try:
        ckpt.save({"x": torch.ones(4)}, root, 1)
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
        return f"{type(exc).__name__} after {time.monotonic() - started:.1f}s: {exc}"
    return "saved"


def test_a_storage_error_taking_the_lease_reaches_every_rank_at_once(tmp_path):
    """The coordinator cannot read the lease record (here a folder stands where the record
    goes): it raises that error and the other rank learns it from the coordinator at once,
    instead of waiting in the lease's broadcast until the group's timeout."""
    root = tmp_path / "root"
    (root / LEASE_NAME).mkdir(parents=True)
    first, other = run_ranks(_save_on_unreadable_lease, 2, str(root), timeout=90)
    assert first.startswith("IsADirectoryError"), first
    assert other.startswith("RankFailuresError") and "taking the write lease" in other \
        and "IsADirectoryError" in other, other
    assert float(other.split(" after ")[1].split("s:")[0]) < 30, other
