"""A node's local checkpoint arriving as a copy on the next node (``ckpt.job._copy``), in one
process: the messages ``swap_bytes`` would carry go straight from ``Outgoing`` to
``Incoming`` (each cloned, as the network would). On local disk a file is written as its
chunks arrive (the receiver holds two chunks, whatever the file's size); a chunk damaged on
the way fails the file's checksum, and the copy is refused and removed."""

from __future__ import annotations

import os
import weakref

import pytest
import torch

import ckpt
import ckpt.job._copy as copy_mod
from ckpt.errors import CheckpointError
from ckpt.format import step_dirname
from ckpt.job._copy import Incoming, Outgoing
from ckpt.root import CheckpointStore, Lifecycle
from ckpt.storage import Storage

CHUNK = 64 << 10
STEP = 5


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(copy_mod, "CHUNK_BYTES", CHUNK)


def _own(tmp_path) -> tuple[Storage, ckpt.Manifest]:
    g = torch.Generator().manual_seed(0)
    state = {"big": torch.randn(300_000, generator=g), "small": torch.arange(10)}
    root = str(tmp_path / "own")
    manifest = ckpt.save(state, root, STEP, use_lease=False)
    return Storage(root), manifest


def _receiver(url: str) -> Lifecycle:
    storage = Storage(url)
    storage.makedirs("")
    return Lifecycle(storage)


def _copy(storage: Storage, manifest, life: Lifecycle, damage_message: int | None = None):
    """Send the version; returns (what ``finish`` returned or raised, the most messages the
    receiver kept alive at once after taking one)."""
    incoming = Incoming(life, 0, mirror=True)
    alive: list[weakref.ref] = []
    peak = 0
    for i, msg in enumerate(Outgoing(storage, manifest, 0, [STEP]).messages()):
        msg = msg.clone()
        if i == damage_message:
            msg[msg.numel() // 2] ^= 0x10
        incoming.take(msg)
        if i >= 2:  # a data chunk
            alive.append(weakref.ref(msg))
        del msg
        peak = max(peak, sum(r() is not None for r in alive))
    try:
        return incoming.finish(), peak
    except CheckpointError as exc:
        return exc, peak


def _data_files(storage: Storage, manifest) -> dict[str, bytes]:
    d = step_dirname(manifest.step)
    return {n: storage.read_bytes(f"{d}/{n}") for n in manifest.files}


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_copy_is_bit_exact_and_held_a_chunk_at_a_time_on_local_disk(tmp_path, where):
    storage, manifest = _own(tmp_path)
    biggest = max(r.size for r in manifest.files.values())
    assert biggest > 10 * CHUNK  # the case at stake: a file of many chunks
    url = str(tmp_path / "peer") if where == "local" else f"memory://copy-{os.getpid()}"
    life = _receiver(url)
    try:
        got, peak = _copy(storage, manifest, life)
        assert not isinstance(got, Exception), got
        assert CheckpointStore(life.storage, lifecycle=life).committed_steps() == [STEP]
        assert _data_files(life.storage, manifest) == _data_files(storage, manifest)
        if where == "local":
            # The chunk just taken, and the one being written: not the file's 10+ chunks.
            assert peak <= 2, peak
    finally:
        if where == "memory":
            life.storage.delete("", recursive=True)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_chunk_damaged_on_the_way_refuses_the_copy_and_removes_its_files(tmp_path, where):
    storage, manifest = _own(tmp_path)
    names = sorted(manifest.files)
    biggest = max(names, key=lambda n: manifest.files[n].size)
    # The message in the middle of the biggest file: header, manifest, then chunks in order.
    before = sum(-(-manifest.files[n].size // CHUNK) or 1 for n in names[:names.index(biggest)])
    middle = 2 + before + manifest.files[biggest].size // CHUNK // 2
    url = str(tmp_path / "peer") if where == "local" else f"memory://damaged-{os.getpid()}"
    life = _receiver(url)
    try:
        got, _ = _copy(storage, manifest, life, damage_message=middle)
        assert isinstance(got, CheckpointError), got
        assert "checksum mismatch" in str(got) and biggest in str(got), got
        assert CheckpointStore(life.storage, lifecycle=life).committed_steps() == []
        left = [n for n, kind, _ in life.storage.listdir(step_dirname(STEP)) if kind == "file"]
        assert left == [], left
        # The next round copies it whole: nothing of the refused one is in the way.
        got, _ = _copy(storage, manifest, life)
        assert not isinstance(got, Exception), got
        assert _data_files(life.storage, manifest) == _data_files(storage, manifest)
    finally:
        if where == "memory":
            life.storage.delete("", recursive=True)
