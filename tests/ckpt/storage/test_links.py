"""No write, delete or listing follows a symbolic link below a local root, nor below the root
a ``Storage.child`` lies in (a tier's ``peer-{node}``); a planted link is refused in one line
naming it, and what it leads to is left as it was.

The links are planted as an attacker with write access to the root would: a step folder
made a link to another step of the same root (a link to outside was refused before), a
child root made a link to another root, before it is opened or after.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.errors import CorruptCheckpointError
from ckpt.format import step_dirname
from ckpt.root import CheckpointStore, Lifecycle, acquire_lease, release_lease
from ckpt.storage import Storage

pytestmark = pytest.mark.timeout(120)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and p.name != "_lease.json"}


def _root_with_a_linked_step(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """Steps 2 and 4 committed; then step 2's folder replaced by a link to step 4's."""
    root = tmp_path / "root"
    for step in (2, 4):
        ckpt.save({"w": torch.full((3,), float(step))}, str(root), step)
    for p in (root / step_dirname(2)).iterdir():
        p.unlink()
    (root / step_dirname(2)).rmdir()
    os.symlink(root / step_dirname(4), root / step_dirname(2))
    return root, _snapshot(root / step_dirname(4))


def test_a_save_never_writes_through_a_linked_step_folder(tmp_path):
    root, step4 = _root_with_a_linked_step(tmp_path)
    with pytest.raises(CorruptCheckpointError, match=f"{step_dirname(2)} is a symbolic link"):
        ckpt.save({"w": torch.zeros(3)}, str(root), 2)
    assert _snapshot(root / step_dirname(4)) == step4
    assert CheckpointStore(str(root)).verify(4).step == 4


def test_gc_and_a_jobs_start_never_delete_through_a_linked_step_folder(tmp_path, capsys):
    root, step4 = _root_with_a_linked_step(tmp_path)
    from ckpt.cli import main as cli_main

    assert cli_main(["gc", str(root), "--yes", "--damaged", "--rolled-back"]) == 0
    life = acquire_lease(Storage(str(root)))
    try:
        life.cleanup()
    finally:
        release_lease(life)
    assert _snapshot(root / step_dirname(4)) == step4
    assert os.path.islink(root / step_dirname(2))
    assert CheckpointStore(str(root)).latest().step == 4


def test_a_child_root_refuses_a_link_planted_before_or_after_it_opens(tmp_path):
    other = tmp_path / "other"
    ckpt.save({"w": torch.ones(3)}, str(other), 7)
    before = _snapshot(other)
    local = Storage(str(tmp_path / "local"))
    local.makedirs("")
    os.symlink(other, tmp_path / "local" / "peer-0")
    with pytest.raises(CorruptCheckpointError, match="peer-0 is a symbolic link") as info:
        local.child("peer-0")
    assert str(other) in str(info.value) and "\n" not in str(info.value)
    # Opened as a plain folder, then swapped for a link: every access refuses it.
    child = local.child("peer-1")
    life = Lifecycle(child)
    os.rename(tmp_path / "local" / "peer-1", tmp_path / "local" / "peer-1-away")
    os.symlink(other, tmp_path / "local" / "peer-1")
    for attempt in (lambda: child.write_bytes("x.json", b"{}"),
                    lambda: child.makedirs(step_dirname(7)),
                    lambda: child.delete(f"{step_dirname(7)}/manifest.json"),
                    lambda: child.listdir(step_dirname(7)),
                    lambda: life.read_committed(7)):
        with pytest.raises(CorruptCheckpointError, match="peer-1 is a symbolic link"):
            attempt()
    assert _snapshot(other) == before
    # Pickled (as ranks get it) the child keeps the root it lies in.
    import pickle

    with pytest.raises(CorruptCheckpointError, match="peer-1 is a symbolic link"):
        pickle.loads(pickle.dumps(child)).listdir("")


def test_a_delete_removes_a_planted_link_never_what_it_leads_to(tmp_path):
    root = tmp_path / "root"
    ckpt.save({"w": torch.ones(3)}, str(root), 1)
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    folder = root / step_dirname(1)
    os.symlink(victim, folder / "r00000_abcdef123456_0.bin")  # an "aborted" file: a link
    (folder / "pending-abcdef123456.json").write_bytes(b'{"save_id": "abcdef123456"}')
    life = acquire_lease(Storage(str(root)))
    try:
        assert life.cleanup() == [1]
    finally:
        release_lease(life)
    assert victim.read_bytes() == b"precious"
    assert not os.path.lexists(folder / "r00000_abcdef123456_0.bin")
    storage = Storage(str(root))
    os.symlink(tmp_path, root / "out")
    storage.delete("out", recursive=True)  # the link goes, the folder it led to stays
    assert not os.path.lexists(root / "out") and victim.exists()
