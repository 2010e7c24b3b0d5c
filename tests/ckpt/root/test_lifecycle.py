"""The checkpoint life-cycle under real failure sequences (ckpt/root/lifecycle.py), local and S3.

Each test is one way the store's promises broke before: a commit delayed past the lease's
TTL, a live lease taken over by a job that only shares torchrun's default run id, a plain
``ckpt.save`` into a root another job holds, a rollback undone by the next save, a
rollback refused after a SIGKILL. The last test interleaves two writers and a reader at
random (seeded, bounded) and checks the invariants after every step.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import ckpt
from ckpt.cli import main as ckpt_main
from ckpt.dcp import SaveRequest
from ckpt.dcp.api import save_with
from ckpt.errors import CheckpointError, FencedCheckpointError, LeaseHeldError, LeaseLostError
from ckpt.root import (
    COMMITTED,
    CheckpointStore,
    FENCED,
    Lifecycle,
    ROLLED_BACK,
    acquire_lease,
    release_lease,
)
from ckpt.root.lease import LEASE_NAME
from ckpt.storage import Storage

pytestmark = pytest.mark.timeout(180)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TTL = 0.6


class HoldingStorage(Storage):
    """A real Storage whose requests can be held before they reach the backend.

    ``hold(pattern)`` makes the next request whose path ends with ``pattern`` wait until
    ``release()``: the same as a request delayed in flight (a slow network, a stalled
    process) as far as the backend can tell. ``delay`` adds a random pause to writes.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pattern: str | None = None
        self._go = threading.Event()
        self.held = threading.Event()
        self.delay: tuple[random.Random, float] | None = None

    def __getstate__(self):
        raise TypeError("built in the process that uses it")

    def hold(self, pattern: str) -> None:
        self._pattern, self._go = pattern, threading.Event()
        self.held.clear()

    def release(self) -> None:
        self._go.set()

    def _maybe_hold(self, rel: str) -> None:
        if self._pattern is not None and rel.endswith(self._pattern):
            self._pattern = None
            self.held.set()
            assert self._go.wait(60), "held request never released"
        if self.delay is not None:
            rng, most = self.delay
            time.sleep(rng.random() * most)

    def create_exclusive(self, rel, data):
        self._maybe_hold(rel)
        return super().create_exclusive(rel, data)

    def write_buffers(self, rel, buffers, **kwargs):
        self._maybe_hold(rel)
        return super().write_buffers(rel, buffers, **kwargs)


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path):
    """(url, storage_options) of an empty root on local disk or on the loopback S3 server."""
    if request.param == "local":
        return str(tmp_path / "root"), None
    s3 = request.getfixturevalue("s3_root")
    return s3[0], s3[1]


def _state(value: float) -> dict:
    return {"w": torch.full((4, 3), value), "b": torch.arange(5.0) + value}


def _save(life: Lifecycle, step: int, value: float):
    return save_with(_state(value), life.storage, step, SaveRequest(life))


def _loaded(url, options, step: int) -> float:
    state = _state(-1.0)
    ckpt.load(state, Storage(url, options), step)
    return float(state["w"][0, 0])


def _save_held_past_the_lease(job: Lifecycle, storage: HoldingStorage, pattern: str):
    """Start ``job``'s save of step 2 on a thread, its request for ``pattern`` held; return
    ``(thread, result)`` once the lease's TTL has passed with it held (``result`` gets
    ``manifest`` or ``error`` when the save ends)."""
    storage.hold(pattern)
    result: dict = {}

    def slow_save():
        try:
            result["manifest"] = _save(job, 2, 2.0)
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            result["error"] = exc

    t = threading.Thread(target=slow_save)
    t.start()
    assert storage.held.wait(30), f"the request for {pattern} was never made"
    time.sleep(TTL + 0.2)
    return t, result


def test_commit_delayed_past_the_ttl_does_not_count(where):
    """Job 1's manifest PUT is held past its lease; job 2 takes over, cleans up, saves."""
    url, options = where
    storage1 = HoldingStorage(url, options)
    storage1.makedirs("")
    job1 = acquire_lease(storage1, ttl_seconds=TTL, heartbeat=False)  # stalls: no renewals
    _save(job1, 1, 1.0)
    t, result = _save_held_past_the_lease(job1, storage1, "step_000000002/manifest.json")
    storage2 = Storage(url, options)
    job2 = acquire_lease(storage2, ttl_seconds=30)  # takes over, fences generation 1
    assert job2.lease.took_over is not None and job2.lease.generation == 2
    removed = job2.cleanup()
    assert removed == [2]  # job 1's step 2 data: an aborted save
    job2.begin(2, "aaaaaaaaaaaa")  # job 2 starts its own step 2 (the folder exists again)
    storage1.release()  # the delayed create-if-absent now lands
    t.join(60)
    assert isinstance(result.get("error"), LeaseLostError), result
    store = CheckpointStore(Storage(url, options))
    with pytest.raises(FencedCheckpointError):
        store.read_manifest(2)
    assert store.latest(check="full").step == 1
    assert store.info(2).status == FENCED
    job2.abandon(2, "aaaaaaaaaaaa")
    # Job 2's own save of step 2 is not "already committed": it commits, and verifies.
    m = _save(job2, 2, 22.0)
    assert m is not None and store.read_manifest(2).save_id == m.save_id
    store.verify(2, full=True)
    assert _loaded(url, options, 2) == 22.0
    assert [e.status for e in store.entries(2)] == [COMMITTED]
    release_lease(job2)
    assert store.latest(check="full").step == 2


def test_data_written_after_a_takeover_removed_the_folder_says_the_lease_was_lost(tmp_path):
    """Job 1's data write is held past its lease; job 2 takes over and cleans up the step's
    folder; the write then lands on nothing. Job 1 is told it lost the lease (as at the
    commit), not "no such file", and job 2's root is untouched."""
    url = str(tmp_path / "root")
    storage1 = HoldingStorage(url)
    storage1.makedirs("")
    job1 = acquire_lease(storage1, ttl_seconds=TTL, heartbeat=False)  # stalls: no renewals
    _save(job1, 1, 1.0)
    t, result = _save_held_past_the_lease(job1, storage1, "_0.bin")  # step 2's first data
    job2 = acquire_lease(Storage(url), ttl_seconds=30)
    assert job2.cleanup() == [2]  # job 1's step 2: an aborted save, folder and all
    storage1.release()
    t.join(60)
    assert isinstance(result.get("error"), LeaseLostError), result
    assert "another job took over" in str(result["error"])
    store = CheckpointStore(Storage(url))
    assert store.committed_steps() == [1]
    release_lease(job2)


def test_commit_that_lands_before_the_takeover_listing_counts(where):
    """The other side of the fence: a commit the new holder saw is kept, and says so."""
    url, options = where
    storage1 = HoldingStorage(url, options)
    storage1.makedirs("")
    job1 = acquire_lease(storage1, ttl_seconds=TTL, heartbeat=False)
    # Hold the renewal that follows the manifest: the manifest exists, the proof does not.
    original = job1.lease.confirm
    calls = []

    def confirm(**kwargs):
        calls.append(1)
        if storage1.exists("step_000000003/manifest.json"):
            acquired.wait(30)
        return original(**kwargs)

    acquired = threading.Event()
    job1.lease.confirm = confirm
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(m=_save(job1, 3, 3.0)))
    t.start()
    time.sleep(TTL + 0.4)
    job2 = acquire_lease(Storage(url, options), ttl_seconds=30)
    acquired.set()
    t.join(60)
    assert calls, "the commit was never proved by a renewal"
    assert result.get("m") is not None  # counts: job 2's close record lists it
    store = CheckpointStore(Storage(url, options))
    assert store.read_manifest(3).save_id == result["m"].save_id
    assert job2.cleanup() == []
    store.verify(3, full=True)
    release_lease(job2)


def test_a_close_record_written_while_the_writer_checks_is_read_not_guessed(where):
    """The writer's own verdict after a lost renewal agrees with the readers'.

    Job 2 takes over while job 1's commit of step 3 waits for its renewal: job 2 marks
    generation 1 closing and lists the manifests (job 1's is there), and its close record
    lands just after job 1 looked for it and found none. The record lists job 1's commit, so
    readers accept it; job 1 must say it counts, not that it was fenced off."""
    url, options = where
    storage1 = Storage(url, options)
    storage1.makedirs("")
    job1 = acquire_lease(storage1, ttl_seconds=TTL, heartbeat=False)
    storage2 = HoldingStorage(url, options)
    storage2.hold("_fence/gen_000000001.json")  # job 2's close record of generation 1
    record_in = threading.Event()
    original_confirm, original_doc = job1.lease.confirm, job1.fence.doc

    def doc(generation, what):
        found = original_doc(generation, what)
        if what == "json" and found is None and not record_in.is_set():
            storage2.release()  # the record lands between this read and the next
            deadline = time.monotonic() + 30
            while not Storage(url, options).exists("_fence/gen_000000001.json"):
                assert time.monotonic() < deadline, "the close record never landed"
                time.sleep(0.02)
            record_in.set()
        return found

    def confirm(**kwargs):
        if storage1.exists("step_000000003/manifest.json"):
            assert storage2.held.wait(30), "job 2 never reached its close record"
            job1.fence.doc = doc
        return original_confirm(**kwargs)

    job1.lease.confirm = confirm
    result: dict = {}

    def take_over():
        time.sleep(TTL + 0.4)
        result["job2"] = acquire_lease(storage2, ttl_seconds=30)

    t = threading.Thread(target=take_over)
    t.start()
    try:
        m = _save(job1, 3, 3.0)
    finally:
        storage2.release()
        t.join(60)
    assert record_in.is_set(), "the race was not staged"
    store = CheckpointStore(Storage(url, options))
    assert store.read_manifest(3).save_id == m.save_id  # readers accept it: so did the writer
    assert m.save_id in job1.lease.committed_ids
    release_lease(result["job2"])
    assert store.latest(check="full").step == 3


def _foreign(run_id, attempt, fingerprint=None, host="another-host") -> bytes:
    now = time.time()
    return json.dumps({"holder": "feedfacecafe0000", "job": "other", "host": host,
                       "pid": 4242, "acquired_unix": now, "heartbeat_unix": now,
                       "ttl_seconds": 60, "run_id": run_id, "attempt": attempt,
                       "fingerprint": fingerprint, "generation": 7}).encode()


@pytest.mark.parametrize("env_run_id,holder_run_id,fp_mine,fp_theirs,taken", [
    ("none", "none", None, None, False),      # torchrun's default: proves nothing
    (None, None, None, None, False),          # no torchrun at all
    ("job-42", "job-42", "abc", "def", False),  # same run id, another config
    ("job-42", "job-43", None, None, False),  # another run
    ("job-42", "job-42", "abc", "abc", True),  # an earlier attempt of this very job
])
def test_live_lease_is_taken_only_with_proof(tmp_path, monkeypatch, env_run_id, holder_run_id,
                                              fp_mine, fp_theirs, taken):
    storage = Storage(str(tmp_path))
    storage.write_bytes(LEASE_NAME, _foreign(holder_run_id, 0, fp_theirs))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # torchrun's alone
    if env_run_id is None:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", env_run_id)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    if not taken:
        with pytest.raises(LeaseHeldError, match="host another-host, pid 4242"):
            acquire_lease(storage, fingerprint=fp_mine)
        assert json.loads(storage.read_bytes(LEASE_NAME))["holder"] == "feedfacecafe0000"
        return
    life = acquire_lease(storage, fingerprint=fp_mine)
    assert life.lease.generation == 8 and life.lease.took_over["run_id"] == holder_run_id
    release_lease(life)


@pytest.mark.parametrize("holder_run_id,holder_attempt,fp_theirs,elastic,taken", [
    ("slurm-77", 0, "abc", None, True),       # the run before this requeue, killed hard
    ("slurm-77", 1, "abc", None, False),      # this same run (another step of it)
    ("slurm-77", 0, "def", None, False),      # the same job, another config
    ("slurm-78", 0, "abc", None, False),      # another job
    ("slurm-77", 0, "abc", "job-42", False),  # torchrun's run id wins inside the job
])
def test_a_requeued_slurm_run_takes_over_its_earlier_runs_lease_only(
        tmp_path, monkeypatch, holder_run_id, holder_attempt, fp_theirs, elastic, taken):
    """Slurm requeues a job (same SLURM_JOB_ID, SLURM_RESTART_COUNT one higher) once its
    previous run ended: a lease that run could not release (killed after the grace, its
    node lost) is taken over at once, not after its TTL, and the record names this run."""
    storage = Storage(str(tmp_path))
    storage.write_bytes(LEASE_NAME, _foreign(holder_run_id, holder_attempt, fp_theirs))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.delenv("SLURM_CLUSTER_NAME", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    if elastic is None:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", elastic)
    if not taken:
        with pytest.raises(LeaseHeldError, match="host another-host, pid 4242"):
            acquire_lease(storage, fingerprint="abc")
        assert json.loads(storage.read_bytes(LEASE_NAME))["holder"] == "feedfacecafe0000"
        return
    life = acquire_lease(storage, fingerprint="abc")
    assert life.lease.took_over["run_id"] == "slurm-77"
    record = json.loads(storage.read_bytes(LEASE_NAME))
    assert (record["run_id"], record["attempt"], record["job"]) == \
        ("slurm-77", 1, "slurm-77-restart-1"), record
    release_lease(life)


def test_plain_save_respects_another_jobs_lease(where):
    url, options = where
    storage = Storage(url, options)
    storage.makedirs("")
    holder = acquire_lease(storage, ttl_seconds=30)
    with pytest.raises(LeaseHeldError, match="in use by job"):
        ckpt.save(_state(1.0), url, 5, storage_options=options)
    assert CheckpointStore(storage).steps() == []
    release_lease(holder)
    ckpt.save(_state(1.0), url, 5, storage_options=options)  # released: now it may
    assert CheckpointStore(storage).committed_steps() == [5]
    assert json.loads(storage.read_bytes(LEASE_NAME))["released"] is True


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = ckpt_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_rollback_keeps_its_word_list_verify_restore(tmp_path, capsys):
    url = str(tmp_path / "root")
    for step in (10, 20, 30, 40):
        ckpt.save(_state(float(step)), url, step)
    code, out, _ = _cli(capsys, "rollback", url, "--step", "20")
    assert code == 0, out
    store = CheckpointStore(url)
    assert store.committed_steps() == [10, 20]
    old40 = [e for e in store.entries(40) if e.status == ROLLED_BACK][0].id
    # The resumed run saves 40 again: the rolled-back 40 is neither deleted nor overwritten.
    ckpt.save(_state(400.0), url, 40)
    assert _loaded(url, None, 40) == 400.0
    code, out, _ = _cli(capsys, "list", url, "--all", "--json")
    rows = json.loads(out)
    assert {(r["step"], r["status"]) for r in rows} >= {(40, "committed"), (40, "rolled-back"),
                                                        (30, "rolled-back")}
    assert all(r["id"] and {"step", "status", "bytes", "created"} <= set(r) for r in rows)
    assert _cli(capsys, "verify", url, "--id", old40)[0] == 0
    code, _, err = _cli(capsys, "restore", url, "--id", old40)
    assert code != 0 and "--replace" in err  # a committed 40 exists
    code, out, _ = _cli(capsys, "restore", url, "--id", old40, "--replace")
    assert code == 0, out
    assert _loaded(url, None, 40) == 40.0
    new40 = [e for e in CheckpointStore(url).entries(40) if e.status == ROLLED_BACK]
    assert len(new40) == 1 and _cli(capsys, "verify", url, "--id", new40[0].id)[0] == 0
    # Rolled-back checkpoints go only by an explicit gc.
    code, out, _ = _cli(capsys, "gc", url, "--rolled-back")
    assert code == 0 and "dry run" in out
    assert len(CheckpointStore(url).list(all_versions=True)) == 5
    code, out, _ = _cli(capsys, "gc", url, "--rolled-back", "--yes")
    assert code == 0
    assert [(i.step, i.status) for i in CheckpointStore(url).list(all_versions=True)] == [
        (10, "committed"), (20, "committed"), (40, "committed")]
    for step in (10, 20, 40):
        CheckpointStore(url).verify(step, full=True)


def test_rollback_right_after_sigkill_is_not_refused(tmp_path, capsys):
    url = str(tmp_path / "root")
    err = open(tmp_path / "child.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tests.ckpt.root._mgr_lease_child", url, "60"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
                            env={**os.environ, "PYTHONPATH": REPO})
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), line
        code, _, msg = _cli(capsys, "rollback", url, "--step", "1")
        assert code == 2 and "in use by job" in msg and "--force" in msg  # alive: refused
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        err.close()
    t0 = time.monotonic()
    code, out, msg = _cli(capsys, "rollback", url, "--step", "1")
    assert code == 0, msg
    assert time.monotonic() - t0 < 10  # not the 60 s TTL: the holder is known dead
    info = json.loads(Storage(url).read_bytes(LEASE_NAME))
    assert info["released"] is True and info["generation"] == 2
    assert info["host"] == socket.gethostname()


# -- randomized: two writers and a reader -------------------------------------------------
def _writer_loop(name, url, options, seed, stop, log, errors, ttl):
    rng = random.Random(seed)
    storage = HoldingStorage(url, options)
    storage.delay = (random.Random(seed + 1), 0.15)
    while not stop.is_set():
        try:
            life = acquire_lease(storage, ttl_seconds=ttl, heartbeat=rng.random() < 0.5,
                                 force=rng.random() < 0.2)
        except LeaseHeldError:
            time.sleep(rng.random() * 0.3)
            continue
        except CheckpointError as exc:
            errors.append(f"{name} acquire: {exc!r}")
            continue
        try:
            life.cleanup()
            for _ in range(rng.randint(1, 3)):
                op = rng.random()
                step = rng.randint(1, 6)
                if op < 0.7:
                    value = rng.random()
                    try:
                        m = save_with(_state(value), storage, step, SaveRequest(life))
                        log.append(("counted", m.save_id, step, value))
                    except FileExistsError:
                        pass
                    except LeaseLostError as exc:
                        log.append(("fenced", str(exc), step, value))
                        break
                elif op < 0.85:
                    try:
                        life.uncommit(step)
                    except (CheckpointError, FileNotFoundError):
                        pass
                else:
                    rolled = [e for s in life.steps() for e in life.entries(s)
                              if e.status == ROLLED_BACK]
                    if rolled:
                        try:
                            life.restore(rng.choice(rolled).id, replace=True)
                        except (CheckpointError, FileExistsError, FileNotFoundError):
                            pass
                if rng.random() < 0.15:
                    time.sleep(ttl * 1.2)  # a stall past the TTL, mid-tenure
        except LeaseLostError:
            pass
        except Exception as exc:  # noqa: BLE001 - anything else is a finding
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
        finally:
            if rng.random() < 0.7:
                release_lease(life)
            else:
                life.lease.stop_heartbeat()  # dies holding the lease


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_two_writers_and_a_reader_at_random(kind, tmp_path, request):
    if kind == "local":
        url, options = str(tmp_path / "root"), None
    else:
        s3 = request.getfixturevalue("s3_root")
        url, options = s3[0], s3[1]
    Storage(url, options).makedirs("")
    stop = threading.Event()
    log: list = []
    errors: list = []
    seen: dict[str, int] = {}
    writers = [threading.Thread(target=_writer_loop,
                                args=(n, url, options, seed, stop, log, errors,
                                      0.5 if kind == "local" else 1.0))
               for n, seed in (("A", 11), ("B", 23))]
    for w in writers:
        w.start()
    reader = CheckpointStore(Storage(url, options))
    deadline = time.monotonic() + (12 if kind == "local" else 15)
    while time.monotonic() < deadline:
        for step in reader.committed_steps():
            try:
                m = reader.read_manifest(step)
            except CheckpointError:
                continue
            try:
                reader.verify_manifest(m, full=True)
            except CheckpointError as exc:
                # A reader may race a rollback (the manifest moves aside, nothing is
                # deleted) but must never find an accepted checkpoint with missing data.
                if reader.life.has_manifest(step):
                    try:
                        still = reader.read_manifest(step).save_id == m.save_id
                    except CheckpointError:
                        still = False
                    assert not still, f"accepted checkpoint {m.save_id} fails: {exc}"
            seen[m.save_id] = step
        time.sleep(0.05)
    stop.set()
    for w in writers:
        w.join(60)
    assert not errors, errors
    # Quiescent: take the lease once more (fencing every writer) and check the invariants.
    final = acquire_lease(Storage(url, options), force=True)
    try:
        versions = {e.id: e for s in final.steps() for e in final.entries(s)}
        for save_id, step in seen.items():  # nothing accepted was lost
            assert save_id in versions, f"accepted {save_id} at step {step} vanished"
            assert versions[save_id].status in (COMMITTED, ROLLED_BACK)
        for e in versions.values():  # every kept version verifies
            if e.status in (COMMITTED, ROLLED_BACK):
                CheckpointStore(final.storage).verify_manifest(e.manifest, full=True)
        counted = {entry[1] for entry in log if entry[0] == "counted"}
        for save_id in counted:  # a save that said it counted is kept
            assert save_id in versions and versions[save_id].status in (COMMITTED, ROLLED_BACK)
        fenced_steps = [entry for entry in log if entry[0] == "fenced"]
        for e in versions.values():  # a fenced-off commit never counts
            if e.status == COMMITTED:
                assert e.id in counted or e.manifest.writer.get("restored_unix")
        assert counted, (len(counted), len(fenced_steps))  # the run made progress
    finally:
        release_lease(final)


def test_damaged_lease_never_hands_out_a_generation_twice(tmp_path):
    storage = Storage(str(tmp_path))
    storage.makedirs("")
    a = acquire_lease(storage, ttl_seconds=30, heartbeat=False)
    m1 = _save(a, 1, 1.0)
    storage.write_bytes(LEASE_NAME, b'{"garbage')  # damaged: nobody can renew it any more
    b = acquire_lease(storage, ttl_seconds=30)  # taken over, with a warning
    assert b.lease.generation == a.lease.generation + 1
    with pytest.raises(LeaseLostError):
        _save(a, 2, 2.0)  # the old holder is fenced off
    store = CheckpointStore(storage)
    assert store.read_manifest(1).save_id == m1.save_id  # closed with step 1 listed
    assert store.committed_steps() == [1]
    release_lease(b)
    c = acquire_lease(storage)
    assert c.lease.generation == b.lease.generation + 1
    release_lease(c)


def test_a_checkpoint_copied_from_another_root_counts(tmp_path):
    """Generations are numbered per root: a folder copied from another root (same generation
    number, another holder) is not judged by this root's fence files."""
    import shutil

    a_root, b_root = tmp_path / "a", tmp_path / "b"
    ckpt.save(_state(7.0), str(a_root), 7)  # generation 1 of root a
    b = str(b_root)
    ckpt.save(_state(1.0), b, 1)  # generation 1 of root b, closed at release
    shutil.copytree(a_root / "step_000000007", b_root / "step_000000007")
    store = CheckpointStore(b)
    assert store.read_manifest(7).writer["lease_generation"] == 1
    assert store.latest(check="full").step == 7
    assert _loaded(b, None, 7) == 7.0
    job = acquire_lease(Storage(b))  # a new holder closes nothing it should not
    job.cleanup()
    release_lease(job)
    assert store.committed_steps() == [1, 7] and store.latest(check="full").step == 7


def test_gc_json_and_export_progress(tmp_path, capsys):
    url = str(tmp_path / "root")
    for step in (10, 20):
        ckpt.save(_state(float(step)), url, step)
    assert _cli(capsys, "rollback", url, "--step", "10")[0] == 0
    code, out, _ = _cli(capsys, "gc", url, "--rolled-back", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["dry_run"] is True and doc["leftovers"] == []
    assert [(r["step"], r["bytes"] > 0) for r in doc["rolled_back"]] == [(20, True)]
    code, out, err = _cli(capsys, "export", url, "--out", str(tmp_path / "m.safetensors"),
                          "--progress")
    assert code == 0 and "export [" in err and "100.0%" in err, err


def test_a_clean_release_never_hides_its_checkpoints(tmp_path):
    """Readers polling while a holder releases never see its checkpoints in doubt."""
    url = str(tmp_path / "root")
    Storage(url).makedirs("")
    stop, seen = threading.Event(), []

    def poll():
        store = CheckpointStore(Storage(url))
        while not stop.is_set():
            for step in store.committed_steps():
                try:
                    store.read_manifest(step)
                except FencedCheckpointError as exc:
                    seen.append(str(exc))
                except CheckpointError:
                    pass

    t = threading.Thread(target=poll)
    t.start()
    try:
        for step in range(1, 16):
            ckpt.save(_state(float(step)), url, step)  # acquire, commit, release each time
    finally:
        stop.set()
        t.join(30)
    assert not seen, seen[:2]


def test_the_store_only_reads_and_the_life_cycle_uncommits_newer(tmp_path):
    """The read side (CheckpointStore) has no verb that changes the root; un-committing
    the steps past a resume point is the life-cycle's, newest first, each restorable."""
    storage = Storage(str(tmp_path / "root"))
    life = Lifecycle(storage)
    for step in (1, 2, 3):
        _save(life, step, float(step))
    store = CheckpointStore(storage)
    changing = {"delete", "uncommit", "uncommit_newer", "restore", "commit", "begin",
                "abandon", "cleanup", "delete_entry"}
    assert not changing & {n for n in dir(store) if not n.startswith("_")}
    assert [(s, exc) for s, _, exc in life.uncommit_newer(1)] == [(3, None), (2, None)]
    assert store.committed_steps() == [1]
    assert [e.status for s in (2, 3) for e in store.entries(s)] == [ROLLED_BACK] * 2
