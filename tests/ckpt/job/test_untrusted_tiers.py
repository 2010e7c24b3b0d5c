"""The local tier's folders and copies are untrusted too: a link planted where a node keeps
its peer's copies is refused naming it (the job never writes into the root it leads to),
and a copy whose manifest lists sizes its files do not hold is refused in bounded time and
memory, the resume going on with the next candidate instead of waiting out a timeout.

Two real gloo processes act as two nodes (``tests/ckpt/job/_copy_workers.py``), each with its
local root ``local-{node}`` and the copies of the other's in ``local-{node}/peer-{other}``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.format import MANIFEST_NAME, jsonio, step_dirname
from ckpt.format._check import manifest_bytes
from ckpt.job._copy import Incoming
from ckpt.root import CheckpointStore, Lifecycle
from ckpt.storage import Storage
from tests.ckpt.job import _copy_workers as w
from tests.dist import run_ranks

pytestmark = pytest.mark.timeout(400)

NODES = 2
LAST, TOTAL = 5, 7  # the first job saves local steps 2 and 4 and copies them
NO_DURABLE = "100"  # only the local tier can resume


def _roots(base: Path) -> tuple[str, str]:
    return str(base / "durable"), str(base / "local-{node}")


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "_lease.json"}


def test_a_link_planted_for_the_peer_copies_is_refused_naming_it(tmp_path):
    other = tmp_path / "other"
    for step in (2, 4):
        ckpt.save({"w": torch.full((3,), float(step))}, str(other), step)
    before = _snapshot(other)
    (tmp_path / "local-1").mkdir()
    os.symlink(other, tmp_path / "local-1" / "peer-0")
    with pytest.raises(AssertionError, match="peer-0 is a symbolic link") as info:
        run_ranks(w.train_body, NODES, *_roots(tmp_path), LAST, NO_DURABLE, timeout=180)
    line = next(x for x in str(info.value).splitlines() if "peer-0 is a symbolic link" in x)
    assert str(other) in line  # one line: the link and where it leads
    assert _snapshot(other) == before
    assert CheckpointStore(str(other)).committed_steps() == [2, 4]
    assert not list(other.glob("step_*/pending-*"))


@pytest.fixture(scope="module")
def copied(tmp_path_factory) -> Path:
    """Roots a two-node job left after step 5: local steps 2 and 4 on each node, each
    copied to the other node; no durable checkpoint."""
    base = tmp_path_factory.mktemp("copied")
    out = run_ranks(w.train_body, NODES, *_roots(base), LAST, NO_DURABLE, timeout=240)
    for events in out:
        assert [s for s, _ in events["copy_committed"]] == [2, 4], events
    return base


def _one_more_file(path: Path, size: int) -> None:
    """The copy's manifest lists one more data file, of ``size`` bytes; resealed."""
    doc = jsonio.loads(path.read_bytes(), str(path))
    doc["files"]["r00000_0123456789ab_9.bin"] = {"size": size, "crc32c": "00000000",
                                                 "rank": 0}
    path.write_bytes(manifest_bytes(doc))


def test_a_crafted_copy_is_refused_in_bounded_time_and_the_resume_goes_on(copied, tmp_path):
    base = tmp_path / "job"
    shutil.copytree(copied, base)
    shutil.rmtree(base / "local-1")  # node 1 is replaced: its steps live in node 0's copies
    _one_more_file(base / "local-0" / "peer-1" / step_dirname(4) / MANIFEST_NAME, 2 ** 62)
    t0 = time.monotonic()
    out = run_ranks(w.resume_body, NODES, *_roots(base), TOTAL, NO_DURABLE, timeout=240)
    assert time.monotonic() - t0 < 150  # far from the copies' 300 s timeout
    # Step 4 cannot come back (node 0 does not send a copy whose files do not match it);
    # step 2 does, and every node resumes from it.
    assert [(r["step"], r["tier"]) for r in out] == [(2, "local")] * NODES, out
    assert [s for s, _ in out[1]["copy_restored"]] == [2]


def _message(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def test_a_receiver_refuses_sizes_no_disk_holds_without_allocating_them(tmp_path):
    """A head announcing a file of 2**62 bytes (its manifest resealed to agree): refused at
    the verdict, with no more than a few MiB allocated on its word."""
    own = tmp_path / "own"
    m = ckpt.save({"w": torch.ones(4)}, str(own), 3, use_lease=False)
    path = own / step_dirname(3) / MANIFEST_NAME
    _one_more_file(path, 2 ** 62)
    manifest = path.read_bytes()
    files = sorted([[n, r.size] for n, r in m.files.items()]
                   + [["r00000_0123456789ab_9.bin", 2 ** 62]])
    header = json.dumps({"step": 3, "node": 0, "root": str(own), "files": files,
                         "keep": [3]}).encode()
    storage = Storage(str(tmp_path / "peer"))
    storage.makedirs("")
    incoming = Incoming(Lifecycle(storage), 0, mirror=True)
    tracemalloc.start()
    try:
        incoming.take(_message(header))
        incoming.take(_message(manifest))
        wanted = incoming.wants_data()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not wanted and incoming.expected == 2
    assert "free" in incoming.error, incoming.error
    assert peak < 8 << 20, peak
    with pytest.raises(ckpt.CheckpointError, match="more than the"):
        incoming.finish()
    assert not list((tmp_path / "peer").rglob("*.bin"))
