"""A save's background cost accounting, and the checksums the writer reuses.

The writer reuses the planner's checksums (of plain tensors and of objects' encodings)
instead of checksumming the same bytes again: every recorded checksum must still be the
checksum of the bytes on disk, item by item and file by file.
"""

from __future__ import annotations

import json
import os
import threading
import time

import torch

import ckpt
from ckpt.dcp import SaveCost, SaveRequest
from ckpt.dcp.api import save_with
from ckpt.dcp.api import resolve_state
from ckpt.events import SAVE_COST_PHASES
from ckpt.format import crc32c_of
from ckpt.root import CheckpointStore
from ckpt.storage import Storage


def _state():
    g = torch.Generator().manual_seed(3)
    return {"model": {f"w{i}": torch.randn(64 + 7 * i, generator=g) for i in range(9)},
            "half": torch.randn(5, 3, generator=g).to(torch.float16),
            "meta": {"step": 7, "note": "x" * 100, "lrs": [0.1, 0.2]},
            "count": 3}


def test_recorded_checksums_are_those_of_the_bytes_on_disk(tmp_path):
    root = str(tmp_path)
    cost = SaveCost()
    save_with(resolve_state(_state()), Storage(root), 1, SaveRequest(num_threads=3, cost=cost))
    manifest = CheckpointStore(root).read_manifest(1)
    folder = os.path.join(root, "step_000000001")
    items = [c["location"] for t in manifest.tensors.values() for c in t["chunks"]]
    items += list(manifest.objects.values())
    assert len(manifest.objects) >= 3 and len(items) >= 13
    for loc in items:
        with open(os.path.join(folder, loc.file), "rb") as f:
            f.seek(loc.offset)
            assert crc32c_of([f.read(loc.length)]) == loc.crc32c, loc
    for name, rec in manifest.files.items():
        data = open(os.path.join(folder, name), "rb").read()
        assert len(data) == rec.size and crc32c_of([data]) == rec.crc32c, name
    # A flipped byte is still caught by a full load (the reused checksums are real ones).
    loc = manifest.objects["meta.note"] if "meta.note" in manifest.objects else items[-1]
    path = os.path.join(folder, loc.file)
    data = bytearray(open(path, "rb").read())
    data[loc.offset] ^= 0xFF
    open(path, "wb").write(bytes(data))
    assert ckpt.load_latest(_state(), root) is None

    f = cost.fields()
    assert set(f["wall_seconds"]) == set(SAVE_COST_PHASES)
    assert f["cpu_seconds"]["crc"] > 0 and f["wall_seconds"]["write"] > 0
    json.dumps(f)


def test_phases_do_not_double_count_the_owner_thread():
    cost = SaveCost()
    with cost.collective_scope():
        time.sleep(0.02)                      # a collective's wait
        with cost.phase("plan"):
            time.sleep(0.05)
        with cost.span():                     # work on helpers, the owner waits
            t = threading.Thread(target=lambda: _busy(cost, "write", 0.05))
            t.start()
            t.join()
    cost.lap()
    time.sleep(0.01)
    cost.lap("retention")
    f = cost.fields()
    w = f["wall_seconds"]
    # Counting the plan phase or the span as collective too would give >= 0.12 s.
    assert 0.015 <= w["collective"] < 0.08, w
    assert w["plan"] >= 0.045 and w["write"] >= 0.045 and w["retention"] >= 0.008, w
    owner = w["collective"] + w["plan"] + w["retention"]
    assert owner <= f["total_wall_seconds"] + 1e-3
    # The helper's busy loop is its CPU, not the owner's.
    assert f["helper_cpu_seconds"] >= 0.045 and f["cpu_seconds"]["write"] >= 0.045
    assert f["persist_thread_cpu_seconds"] < 0.03


def _busy(cost: SaveCost, phase: str, seconds: float) -> None:
    with cost.phase(phase):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass


def test_retention_with_the_committed_manifest_still_checks_the_files(tmp_path):
    """Retention takes the manifest just committed instead of parsing it back; a damaged
    newest checkpoint must still stop every deletion."""
    from ckpt.job import KeepLast
    from ckpt.job.retention import apply_retention

    root = str(tmp_path)
    for step in (1, 2, 3):
        ckpt.save(_state(), root, step, use_lease=False)
    store = CheckpointStore(root)
    newest = store.read_manifest(3)
    name = sorted(newest.files)[0]
    path = os.path.join(root, "step_000000003", name)
    os.truncate(path, os.path.getsize(path) - 1)
    assert apply_retention(store, [KeepLast(1)], newest_manifest=newest) == []
    assert store.committed_steps() == [1, 2, 3]
    # A manifest of another step is not taken for the newest: the newest is read instead.
    assert apply_retention(store, [KeepLast(1)], newest_manifest=store.read_manifest(2)) == []
    os.truncate(path, os.path.getsize(path) + 1)  # size right again (a zero byte: no crc check)
    assert apply_retention(store, [KeepLast(1)], newest_manifest=newest) == [1, 2]
