"""What a steady-state save costs in storage requests and collectives, and that the cheaper
path stays right when the root changes under the job (an un-commit at resume, a pin, a
checkpoint removed by hand).

Requests are counted by a counting ``Storage`` on a local root (``bench/_requests.py``, the
one ``bench/bench_requests.py`` prints) and at the HTTP level on S3 (the loopback proxy in
front of moto). A steady-state save is one after the first ``KEEP + 1``, when retention also
deletes the oldest checkpoint. Data-file writes (and, on a local root, the deletions of the
old checkpoint's data files, one per file) follow the bytes and are counted apart.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time

import pytest
import torch

from ckpt.dcp import SaveRequest
from ckpt.dcp.api import save_with
from ckpt.errors import LeaseLostError
from ckpt.job import CheckpointManager, KeepLast, KeepPinned, ManagerOptions, set_pinned
from ckpt.ranks import Agreement
from ckpt.root import CheckpointStore, acquire_lease, release_lease
from ckpt.storage import Storage
from tests.ckpt._mgr_util import OnlyRankWants

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))), "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

from _requests import DATA_KINDS, CountingStorage  # noqa: E402

pytestmark = pytest.mark.timeout(180)

KEEP = 3
SAVES = 7
MAX_LOCAL_REQUESTS = 11
"""Per steady-state save on a local root, data files apart: folder, marker, lease check,
manifest, lease renewal, pins, the newest's listing, the oldest's manifest, its listing, the
marker of the commit, the oldest's folder (was 22)."""
MAX_S3_REQUESTS = 9
"""Per steady-state save on S3, HTTP requests, data-file PUTs apart: marker, lease check,
manifest, lease renewal, pins, the newest's listing, the oldest's manifest delete, its
listing, one bulk delete of its files with the commit's marker (was 29)."""
_DATA = re.compile(r"/r\d{5}_[0-9a-f]+_\d+\.bin(\?|$)")


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((16, 16), float(step)), "b": torch.zeros(16)},
            "step": step}


def _manager(storage: Storage) -> CheckpointManager:
    # A long TTL keeps the heartbeat thread quiet: every request counted is a save's.
    return CheckpointManager(storage, ManagerOptions(busy="wait", lease_ttl_seconds=3600.0),
                             retention=[KeepLast(KEEP), KeepPinned(CheckpointStore(storage))])


def _fixed(counts) -> int:
    return sum(v for k, v in counts.items() if k not in DATA_KINDS)


def _no_markers_left(root: str, steps) -> bool:
    return not [n for s in steps for n in os.listdir(os.path.join(root, f"step_{s:09d}"))
                if n.startswith("pending-")]


def test_steady_state_saves_on_a_local_root_make_few_requests(tmp_path):
    root = str(tmp_path / "root")
    storage = CountingStorage(root)
    with _manager(storage) as mgr:
        for step in range(1, SAVES + 1):
            snap = storage.snapshot()
            assert mgr.save(step, _state(step), block=True)
            counts, log = storage.since(snap)
            if step <= KEEP + 1:
                continue
            assert _fixed(counts) <= MAX_LOCAL_REQUESTS, (step, counts, log)
            # The root is never listed, the lease swapped once (the proof after the commit).
            assert ("list", "") not in log and counts["swap"] == 1, log
        assert not mgr.events.of_kind("retention_failed")
    store = CheckpointStore(root)
    assert store.committed_steps() == list(range(SAVES - KEEP + 1, SAVES + 1))
    assert store.steps() == store.committed_steps()  # deleted folders are gone
    assert _no_markers_left(root, store.steps())


def test_steady_state_saves_on_s3_make_few_requests(s3_root, s3_proxy):
    storage = Storage(s3_root.url, s3_proxy.storage_options)
    with _manager(storage) as mgr:
        for step in range(1, SAVES + 1):
            first = len(s3_proxy.requests)
            assert mgr.save(step, _state(step), block=True)
            if step <= KEEP + 1:
                continue
            sent = [(r.method, r.path) for r in s3_proxy.requests[first:]
                    if not (r.method == "PUT" and _DATA.search(r.path))]
            assert len(sent) <= MAX_S3_REQUESTS, (step, sent)
            lease = [m for m, p in sent if "/_lease.json" in p]
            assert lease == ["GET", "PUT"], sent  # the check, then the one renewal
            assert not [m for m, _ in sent if m == "HEAD"], sent
        assert not mgr.events.of_kind("retention_failed")
    store = CheckpointStore(Storage(s3_root.url, s3_root.storage_options))
    assert store.committed_steps() == list(range(SAVES - KEEP + 1, SAVES + 1))
    assert store.steps() == store.committed_steps()
    assert not [n for s in store.steps() for n, _, _ in store.storage.listdir(
        f"step_{s:09d}") if n.startswith("pending-")]


def test_retention_without_listing_follows_the_root_as_it_changes(tmp_path):
    """The committed steps retention decides from are the writer's own knowledge: an
    un-commit through the manager's store (a resume past newer checkpoints), a pin and a
    checkpoint removed by hand are all followed, still without listing the root."""
    root = str(tmp_path / "root")
    storage = CountingStorage(root)
    store = CheckpointStore(root)
    with _manager(storage) as mgr:
        for step in range(1, 6):
            mgr.save(step, _state(step), block=True)
        assert store.committed_steps() == [3, 4, 5]
        # A resume from step 4 un-commits 5 (through the manager's own store); 5 is saved
        # again, not skipped as "already committed".
        assert [s for s, _, _ in mgr.life.uncommit_newer(4)] == [5]
        set_pinned(store, 3)  # an operator pins 3 meanwhile
        os.unlink(os.path.join(root, "step_000000004", "manifest.json"))  # and removes 4
        snap = storage.snapshot()
        for step in (5, 6, 7):
            assert mgr.save(step, _state(step), block=True)
        _, log = storage.since(snap)
        assert ("list", "") not in log
        assert not mgr.events.of_kind("retention_failed")
        assert [e.step for e in mgr.events.of_kind("save_committed")][-3:] == [5, 6, 7]
    # KeepLast(3) of 3, 5, 6, 7 plus the pinned 3; 4 was gone already.
    assert store.committed_steps() == [3, 5, 6, 7]


def test_a_due_save_costs_one_agreement_on_the_training_thread(tmp_path, monkeypatch):
    """A time-based cadence agrees its due check every few steps; the save it starts needs
    no second agreement, and the persist thread none at all (an abandon at shutdown is
    checked inside DCP's first collective)."""
    calls: dict[str, int] = {}
    original = Agreement.max

    def counted(self, *values):
        name = threading.current_thread().name.split("_")[0]
        calls[name] = calls.get(name, 0) + 1
        return original(self, *values)

    mgr = CheckpointManager(str(tmp_path / "root"), retention=[],
                            cadence=OnlyRankWants(0, 0, 3))
    try:
        monkeypatch.setattr(Agreement, "max", counted)
        for step in range(1, 6):
            mgr.maybe_save(step, _state(step))
        mgr.wait()
    finally:
        monkeypatch.undo()
        mgr.close()
    assert [e.step for e in mgr.events.of_kind("save_committed")] == [3]
    # One per step (the due check), the save at step 3 included; none on the persist thread.
    assert calls == {threading.main_thread().name: 5}, calls


def test_a_delete_renews_the_lease_only_when_its_last_renewal_is_old(tmp_path):
    """Retention right after a commit needs no renewal of its own (the commit's proof is
    milliseconds old); past half the TTL a delete renews first, and a writer fenced off
    meanwhile deletes nothing."""
    root = str(tmp_path / "root")
    storage = CountingStorage(root)
    storage.makedirs("")
    life = acquire_lease(storage, ttl_seconds=2.0, heartbeat=False)
    for step in (1, 2, 3):
        save_with(_state(step), storage, step, SaveRequest(life))
    snap = storage.snapshot()
    life.delete(1)
    _, log = storage.since(snap)
    assert not [rel for _, rel in log if rel == "_lease.json"], log
    time.sleep(1.2)  # past half the TTL: the next delete proves the lease first
    other = acquire_lease(Storage(root), ttl_seconds=30, force=True)  # fences `life` off
    with pytest.raises(LeaseLostError):
        life.delete(2)
    assert CheckpointStore(root).committed_steps() == [2, 3]
    release_lease(other)
