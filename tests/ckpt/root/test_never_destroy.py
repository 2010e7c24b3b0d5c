"""A committed checkpoint that cannot be read is someone's data: gc, a job's start, retention
and a resume never delete it; only ``ckpt gc --damaged`` does, and never one of a newer ckpt.

Roots are damaged as rot or a newer writer would leave them: one flipped bit in a manifest
(its digest no longer matches), a manifest resealed as ``format_version`` 3 (and one whose
newer seal this reader cannot check), a damaged manifest moved aside by the next commit of
its step. Leftovers of an aborted save (its marker, written before any data, still there)
are still removed beside them; the files an unreadable manifest may hold are not.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.cli import main as cli_main
from ckpt.format import MANIFEST_NAME, jsonio, step_dirname
from ckpt.format._check import manifest_bytes
from ckpt.job import CheckpointManager, KeepLast, ManagerOptions
from ckpt.root import CORRUPT, CheckpointStore, Lifecycle, acquire_lease, release_lease
from ckpt.root.lifecycle import MOVED_ASIDE
from ckpt.storage import Storage
from tests.ckpt._parts import even_chunks, save_chunked

pytestmark = pytest.mark.timeout(180)

CHUNKS = {"w": [([0, 0], [3, 4]), ([3, 0], [3, 4])], "b": even_chunks(4, 2)}


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g),
            "v": torch.randn(3, generator=g), "note": f"seed {seed}", "n": seed}


def cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out + err


def _files(root: Path, step: int) -> set[str]:
    folder = root / step_dirname(step)
    return set(os.listdir(folder)) if folder.is_dir() else set()


def _flip_a_bit(root: Path, step: int) -> None:
    """Rot: one bit of the manifest's body flipped; its digest no longer matches."""
    path = root / step_dirname(step) / MANIFEST_NAME
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04
    path.write_bytes(bytes(data))


def _newer(root: Path, step: int) -> None:
    """A manifest a newer ckpt wrote (``format_version`` 3), sealed as this one seals."""
    path = root / step_dirname(step) / MANIFEST_NAME
    doc = jsonio.loads(path.read_bytes(), str(path))
    doc["format_version"] = 3
    path.write_bytes(manifest_bytes(doc))


def _newer_sealed_otherwise(root: Path, step: int) -> None:
    """A newer ckpt's manifest whose seal this reader cannot check (another digest)."""
    path = root / step_dirname(step) / MANIFEST_NAME
    doc = jsonio.loads(path.read_bytes(), str(path))
    doc["format_version"] = 3
    doc["manifest_sha256"] = "0" * 64
    path.write_bytes(json.dumps(doc, indent=1).encode())


def _root(tmp_path: Path) -> tuple[Path, set[str]]:
    """Steps 2 and 4 (data files and a part each); step 4's files."""
    root = tmp_path / "root"
    save_chunked(str(root), 2, _state(2), CHUNKS)
    save_chunked(str(root), 4, _state(4), CHUNKS)
    files = _files(root, 4)
    assert len(files - {MANIFEST_NAME}) >= 3, files
    return root, files


def _start_a_job(root: Path, keep: int = 1) -> None:
    with CheckpointManager(str(root), ManagerOptions(async_save=False),
                           retention=[KeepLast(keep)]) as mgr:
        mgr.save(6, _state(6))
        mgr.save(8, _state(8))


@pytest.mark.parametrize("damage", [_flip_a_bit, _newer, _newer_sealed_otherwise])
def test_gc_a_jobs_start_and_retention_keep_a_manifest_they_cannot_read(tmp_path, capsys,
                                                                        damage):
    root, files = _root(tmp_path)
    damage(root, 4)
    rc, out = cli(capsys, "gc", root)
    assert rc == 0 and "step 4:" in out and "kept" in out and "leftover" not in out, out
    rc, out = cli(capsys, "gc", root, "--yes")
    assert rc == 0 and "kept" in out, out
    assert _files(root, 4) == files
    _start_a_job(root)  # cleanup at the start, retention after each save
    assert _files(root, 4) == files
    store = CheckpointStore(str(root))
    assert store.committed_steps() == [4, 8]  # retention deleted 2 and 6, kept 4
    assert [e.status for e in store.life.entries(4)] == [CORRUPT]
    assert ckpt.load_latest(_state(0), str(root)).step == 8


@pytest.mark.parametrize("damage", [_newer, _newer_sealed_otherwise])
def test_a_newer_format_is_never_touched(tmp_path, capsys, damage):
    root, files = _root(tmp_path)
    damage(root, 4)
    rc, out = cli(capsys, "gc", root, "--damaged")
    assert rc == 0 and "newer ckpt" in out and "would remove" not in out, out
    rc, out = cli(capsys, "gc", root, "--damaged", "--yes")
    assert rc == 0 and "newer ckpt" in out, out
    assert _files(root, 4) == files
    with pytest.raises(FileExistsError, match="newer ckpt"):
        ckpt.save(_state(9), str(root), 4)
    assert _files(root, 4) == files


def test_gc_damaged_removes_a_damaged_checkpoint_when_asked(tmp_path, capsys):
    root, files = _root(tmp_path)
    _flip_a_bit(root, 4)
    rc, out = cli(capsys, "gc", root, "--damaged")
    assert rc == 0 and "step 4: would remove manifest.json" in out, out
    assert _files(root, 4) == files
    rc, out = cli(capsys, "gc", root, "--damaged", "--yes", "--json")
    doc = json.loads(out[out.index("{"):out.rindex("}") + 1])
    assert rc == 0 and doc["damaged"][0]["manifests"] == [MANIFEST_NAME], doc
    assert not (root / step_dirname(4)).exists()
    assert CheckpointStore(str(root)).committed_steps() == [2]


def _begun(root: Path, step: int, save_id: str) -> set[str]:
    """An aborted save's leftovers at ``step``: its marker (written first), a data file
    and a part, as a writer killed before its commit leaves them."""
    life = acquire_lease(Storage(str(root)))
    try:
        life.begin(step, save_id)
    finally:
        release_lease(life)
    folder = root / step_dirname(step)
    names = {f"r00000_{save_id}_0.bin", f"part-r00000_{save_id}.json"}
    for name in names:
        (folder / name).write_bytes(b"aborted")
    return names | {f"pending-{save_id}.json"}


def test_an_aborted_saves_leftovers_go_beside_a_damaged_manifest_its_files_stay(tmp_path):
    root, files = _root(tmp_path)
    committed = CheckpointStore(str(root)).read_manifest(4).save_id
    _flip_a_bit(root, 4)
    dead = _begun(root, 4, "deadbeef0001")
    # The committed attempt's own marker, left behind (its removal is deferred or failed).
    (root / step_dirname(4) / f"pending-{committed}.json").write_bytes(
        json.dumps({"save_id": committed, "owner": None}).encode())
    assert dict(Lifecycle(Storage(str(root))).leftovers()) == {4: sorted(dead)}
    life = acquire_lease(Storage(str(root)))
    try:
        assert life.cleanup() == [4]
    finally:
        release_lease(life)
    assert _files(root, 4) == files | {f"pending-{committed}.json"}


def test_a_damaged_manifest_moved_aside_keeps_its_files(tmp_path, capsys):
    """The next save of a step whose manifest is damaged moves it aside and commits; the
    old version's files stay (the damaged manifest may name them), and gc says so."""
    root, files = _root(tmp_path)
    _flip_a_bit(root, 4)
    new = ckpt.save(_state(40), str(root), 4)
    store = CheckpointStore(str(root))
    statuses = sorted(e.status for e in store.life.entries(4))
    assert statuses == sorted(["committed", MOVED_ASIDE]), statuses
    aside = next(n for n in _files(root, 4) if n.startswith("damaged-manifest-"))
    kept = (files - {MANIFEST_NAME}) | {aside}
    rc, out = cli(capsys, "gc", root, "--yes")
    assert rc == 0 and f"manifest unreadable ({aside})" in out, out
    _start_a_job(root, keep=3)
    assert kept <= _files(root, 4)
    assert ckpt.load(_state(0), str(root), 4).save_id == new.save_id


@pytest.mark.parametrize("damage", [_flip_a_bit, _newer])
def test_a_resume_past_an_unreadable_checkpoint_keeps_it(tmp_path, damage):
    """A resume falls back past step 4 (unreadable) to step 2, un-commits what is newer
    (step 4 cannot be: it is left), and saves step 4 again: the old version's files stay,
    beside the new one (the damaged manifest moved aside), or the save is refused (newer)."""
    root, files = _root(tmp_path)
    damage(root, 4)
    state = _state(0)
    with CheckpointManager(str(root), ManagerOptions(async_save=False),
                           retention=[KeepLast(5)]) as mgr:
        assert mgr.load_latest(state).step == 2
        assert _files(root, 4) == files
        mgr.save(4, _state(44))
    kept = files - {MANIFEST_NAME}
    assert kept <= _files(root, 4)
    if damage is _newer:  # refused: "committed by a newer ckpt"
        assert _files(root, 4) == files
    else:
        assert any(n.startswith("damaged-manifest-") for n in _files(root, 4))
        assert CheckpointStore(str(root)).read_manifest(4).user_metadata is not None
