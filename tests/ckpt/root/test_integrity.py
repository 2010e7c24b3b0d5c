"""Integrity: damaged data files are detected, named, and skipped in favour of an older step.

Two ranks save steps 1 and 2. A byte of step 2 that only rank 1 reads is flipped: during
``load_latest`` only rank 1 sees the bad checksum, yet every rank falls back to step 1 and
says why in a warning. Truncating the file does the same. Then, in this process, the
verification modes: ``CheckpointStore.verify`` names the file with expected and actual
crc32c; ``load(verify="size")`` catches size changes but not a same-size flip (the
documented trade-off for speed); ``verify="none"`` checks neither.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest

import ckpt
from ckpt.errors import CorruptCheckpointError
from ckpt.root import COMMITTED, CORRUPT, CheckpointStore
from tests.ckpt.root import _crash_child as states
from tests.ckpt._helpers import assert_same, flip_byte
from tests.dist import run_ranks

STEP2 = "step_000000002"


def _target(root: str) -> tuple[str, int]:
    """A data file of step 2 written by rank 1, and the offset of a byte only rank 1 reads."""
    manifest = CheckpointStore(root).read_manifest(2)
    loc = manifest.tensors["r1.v0"]["chunks"][0]["location"]
    assert manifest.files[loc.file].rank == 1
    return os.path.join(root, STEP2, loc.file), loc.offset + 5


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _integrity_body(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    ckpt.save(states.state_for(1, [rank]), root, 1)
    ckpt.save(states.state_for(2, [rank]), root, 2)
    path, offset = _target(root)
    with open(path, "rb") as f:
        pristine = f.read()
    records = _Records()
    logging.getLogger("ckpt").addHandler(records)
    out = {}

    def damage_then_load(case: str, damage) -> int:
        dist.barrier()
        if rank == 0:
            damage()
        dist.barrier()
        records.messages.clear()
        state = states.empty_state([rank])
        manifest = ckpt.load_latest(state, root)
        assert_same(states.state_for(manifest.step, [rank]), state, f"{case}: loaded values")
        out[case] = {"step": manifest.step, "warnings": list(records.messages)}
        return manifest.step

    def restore():
        with open(path, "wb") as f:
            f.write(pristine)

    def truncate():
        with open(path, "r+b") as f:
            f.truncate(len(pristine) - 3)

    damage_then_load("flip", lambda: flip_byte(path, offset))
    damage_then_load("restored", restore)
    damage_then_load("truncated", truncate)
    damage_then_load("restored again", restore)
    logging.getLogger("ckpt").removeHandler(records)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A root with steps 1 and 2 saved by 2 ranks (pristine again after the rank checks)."""
    root = str(tmp_path_factory.mktemp("integrity") / "root")
    results = run_ranks(_integrity_body, 2, root, timeout=240)
    return root, results


@pytest.fixture
def root(saved, tmp_path):
    """A private copy of the saved root, free to damage."""
    copy = str(tmp_path / "root")
    shutil.copytree(saved[0], copy)
    return copy


def test_load_latest_falls_back_on_every_rank(saved):
    root, results = saved
    name = os.path.basename(_target(root)[0])
    for rank, res in enumerate(results):
        for case in ("flip", "truncated"):
            assert res[case]["step"] == 1, (rank, case, res[case])
            text = "\n".join(res[case]["warnings"])
            # Every rank says step 2 was skipped and names the damaged file, even though only
            # rank 1 read the flipped byte.
            assert "step 2" in text and "falling back" in text, (rank, case, text)
            assert name in text, (rank, case, text)
        assert "checksum mismatch" in "\n".join(res["flip"]["warnings"])
        for case in ("restored", "restored again"):
            assert res[case] == {"step": 2, "warnings": []}, (rank, case, res[case])


def test_verify_names_the_file_and_both_checksums(root):
    path, offset = _target(root)
    store = CheckpointStore(root)
    record = store.read_manifest(2).files[os.path.basename(path)]
    store.verify(2)
    flip_byte(path, offset)
    with pytest.raises(CorruptCheckpointError) as info:
        store.verify(2)
    err = info.value
    assert err.path.endswith(f"{STEP2}/{os.path.basename(path)}")
    assert err.expected == f"{record.crc32c:08x}" and err.actual != err.expected
    assert os.path.basename(path) in str(err)
    assert err.expected in str(err) and err.actual in str(err)
    # A size check does not see a same-size flip; a full check does.
    store.verify(2, full=False)
    assert store.info(2, check="size").status == COMMITTED
    assert store.info(2, check="full").status == CORRUPT
    assert store.latest(check="size").step == 2
    assert store.latest(check="full").step == 1
    store.verify(1)


def test_verify_reports_truncation(root):
    path, _ = _target(root)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 1)
    store = CheckpointStore(root)
    for full in (True, False):
        with pytest.raises(CorruptCheckpointError) as info:
            store.verify(2, full=full)
        assert info.value.expected == size and info.value.actual == size - 1
        assert os.path.basename(path) in str(info.value)
    assert store.latest(check="size").step == 1


def _load_all(root: str, verify: str) -> dict:
    state = states.empty_state([0, 1])
    ckpt.load(state, root, 2, verify=verify)
    return state


def test_verify_modes_on_a_flipped_byte(root):
    path, offset = _target(root)
    flip_byte(path, offset)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as info:
        _load_all(root, "full")
    assert os.path.basename(path) in str(info.value)
    expected = states.state_for(2, [0, 1])
    for mode in ("size", "none"):
        # Not detected: the flipped value is loaded, everything else is intact.
        state = _load_all(root, mode)
        with pytest.raises(AssertionError):
            assert_same(expected["r1"]["v0"], state["r1"]["v0"])
        state["r1"]["v0"] = expected["r1"]["v0"]
        assert_same(expected, state, f"verify={mode}")


def test_verify_modes_on_a_size_change(root):
    path, _ = _target(root)
    with open(path, "ab") as f:
        f.write(b"junk")  # grown: every saved byte is still in place
    for mode in ("full", "size"):
        with pytest.raises(CorruptCheckpointError, match="bytes, the manifest says"):
            _load_all(root, mode)
    # verify="none" skips the size check, and the data it reads is intact.
    assert_same(states.state_for(2, [0, 1]), _load_all(root, "none"))
    # Truncated: "size" refuses before reading; "none" cannot read the missing bytes either,
    # and says so rather than loading garbage.
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CorruptCheckpointError, match="bytes, the manifest says"):
        _load_all(root, "size")
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        _load_all(root, "none")
