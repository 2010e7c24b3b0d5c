"""Attachments: small files saved with a checkpoint (``ckpt.save(..., attachments=...)``),
listed and checksummed in the manifest, read back verified, and kept or deleted with their
version by the life-cycle (rollback, restore, gc, cleanup, retention)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import ckpt
from ckpt.cli import main as ckpt_main
from ckpt.dcp import SaveRequest
from ckpt.dcp.api import save_with
from ckpt.errors import CorruptCheckpointError
from ckpt.format import MAX_ATTACHMENT_BYTES, Manifest, data_file_id, step_dirname
from ckpt.format._check import manifest_bytes
from ckpt.job import CheckpointManager
from ckpt.root import ROLLED_BACK, CheckpointStore, acquire_lease, release_lease
from ckpt.storage import Storage
from tests.ckpt._helpers import flip_byte

pytestmark = pytest.mark.timeout(120)

CONFIG = b'{"hidden_size": 16, "layers": {"0": "dense"}}'


def _state(value: float) -> dict:
    return {"w": torch.full((4,), value), "step": int(value)}


def _folder(url: str, step: int) -> set[str]:
    return set(os.listdir(os.path.join(url, step_dirname(step))))


def _attachment_files(url: str, step: int) -> set[str]:
    return {n for n in _folder(url, step) if n.startswith("a_")}


def test_round_trip_bytes_and_path(tmp_path):
    url = str(tmp_path / "root")
    tok = tmp_path / "tokenizer.json"
    tok.write_bytes(b'{"vocab": {"a": 0}}' * 10)
    m = ckpt.save(_state(1.0), url, 5, attachments={
        "config.json": CONFIG, "tokenizer.json": str(tok), "empty.txt": bytearray()})
    # Listed in the manifest with size and crc, and in files (so verified and kept).
    assert set(m.attachments) == {"config.json", "tokenizer.json", "empty.txt"}
    for name, a in m.attachments.items():
        assert a.file == f"a_{m.save_id}_{name}" and a.file in m.files
        assert data_file_id(a.file) == m.save_id
    read_back = CheckpointStore(url).read_manifest(5)
    assert read_back.attachments == m.attachments
    assert ckpt.list_attachments(url, 5) == {"config.json": len(CONFIG), "empty.txt": 0,
                                             "tokenizer.json": tok.stat().st_size}
    assert ckpt.read_attachment(url, 5, "config.json") == CONFIG
    assert ckpt.read_attachment(url, None, "tokenizer.json") == tok.read_bytes()
    assert ckpt.read_attachment(url, 5, "empty.txt") == b""
    # Nested dicts with int keys come back as the same bytes (no JSON round trip).
    assert json.loads(ckpt.read_attachment(url, 5, "config.json"))["layers"] == {"0": "dense"}
    with pytest.raises(FileNotFoundError, match="no attachment 'missing.txt'.*config.json"):
        ckpt.read_attachment(url, 5, "missing.txt")
    CheckpointStore(url).verify(5, full=True)
    # A checkpoint without attachments keeps the old manifest shape.
    ckpt.save(_state(2.0), url, 6)
    raw = open(os.path.join(url, step_dirname(6), "manifest.json"), "rb").read()
    assert b'"attachments"' not in raw and ckpt.list_attachments(url, 6) == {}


def test_every_backend(any_root):
    m = ckpt.save(_state(1.0), any_root.url, 3, storage_options=any_root.storage_options,
                  attachments={"config.json": CONFIG, "empty.txt": b""})
    opts = {"storage_options": any_root.storage_options}
    assert ckpt.list_attachments(any_root.url, 3, **opts) == {"config.json": len(CONFIG),
                                                              "empty.txt": 0}
    assert ckpt.read_attachment(any_root.url, 3, "config.json", **opts) == CONFIG
    assert ckpt.read_attachment(any_root.url, 3, "empty.txt", **opts) == b""
    storage = Storage(any_root.url, any_root.storage_options)
    storage.write_bytes(f"{step_dirname(3)}/{m.attachments['config.json'].file}",
                        CONFIG.replace(b"16", b"17"))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        ckpt.read_attachment(any_root.url, 3, "config.json", **opts)


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "", "x" * 129, "a..b", "c:\\d",
                                  "tab\tname", "é.json", 5, None])
def test_bad_names_refused_before_anything_is_written(tmp_path, name):
    url = str(tmp_path / "root")
    with pytest.raises(ValueError, match="not a plain file name"):
        ckpt.save(_state(1.0), url, 1, attachments={name: b"x"})
    assert not os.path.exists(os.path.join(url, step_dirname(1)))


def test_size_limit(tmp_path):
    url = str(tmp_path / "root")
    with pytest.raises(ValueError, match=r"'big.bin' \(bytes\) is 67108865 bytes, more than "
                                         r"the 64 MiB"):
        ckpt.save(_state(1.0), url, 1, attachments={"big.bin": b"\0" * (MAX_ATTACHMENT_BYTES + 1)})
    assert not os.path.exists(os.path.join(url, step_dirname(1)))
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(MAX_ATTACHMENT_BYTES + 1)  # sparse
    with pytest.raises(ValueError, match="more than the 64 MiB"):
        ckpt.save(_state(1.0), url, 1, attachments={"big.bin": str(big)})
    assert CheckpointStore(url).committed_steps() == []
    with pytest.raises(ValueError, match="'gone.txt': file .* does not exist"):
        ckpt.save(_state(1.0), url, 2, attachments={"gone.txt": str(tmp_path / "nope")})
    with pytest.raises(TypeError, match="expected bytes or a path"):
        ckpt.save(_state(1.0), url, 2, attachments={"n.txt": 3})
    # Exactly at the limit is fine.
    with open(big, "r+b") as f:
        f.truncate(MAX_ATTACHMENT_BYTES)
    ckpt.save(_state(1.0), url, 3, attachments={"big.bin": str(big)})
    assert len(ckpt.read_attachment(url, 3, "big.bin")) == MAX_ATTACHMENT_BYTES


def test_damage_is_detected_on_read_and_by_verify(tmp_path, capsys):
    url = str(tmp_path / "root")
    m = ckpt.save(_state(1.0), url, 1, attachments={"config.json": CONFIG})
    path = os.path.join(url, step_dirname(1), m.attachments["config.json"].file)
    flip_byte(path, 3)
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch in .*a_.*config\.json: "
                                                     r"expected crc32c"):
        ckpt.read_attachment(url, 1, "config.json")
    assert ckpt_main(["verify", url, "--step", "1"]) == 1
    assert "config.json" in capsys.readouterr().out
    with open(path, "ab") as f:
        f.write(b"more")
    with pytest.raises(CorruptCheckpointError, match="is 49 bytes, the manifest says 45"):
        ckpt.read_attachment(url, 1, "config.json")
    os.unlink(path)
    with pytest.raises(CorruptCheckpointError, match="is missing"):
        ckpt.read_attachment(url, 1, "config.json")


def _rewrite_manifest(url: str, step: int, change) -> None:
    path = os.path.join(url, step_dirname(step), "manifest.json")
    doc = json.loads(open(path, "rb").read())
    change(doc)
    with open(path, "wb") as f:
        f.write(manifest_bytes(doc))


@pytest.mark.parametrize("change, message", [
    (lambda d: d["attachments"].update({"../evil": d["attachments"]["config.json"]}),
     "not a plain file name"),
    (lambda d: d["attachments"]["config.json"].update(file="r00000_nothere_0.bin"),
     "is not listed in 'files'"),
    (lambda d: d["attachments"]["config.json"].update(size=46), "disagrees with files"),
    (lambda d: d["attachments"]["config.json"].update(crc32c="00000000"),
     "disagrees with files"),
    (lambda d: d["attachments"]["config.json"].update(size=MAX_ATTACHMENT_BYTES + 1),
     "size must be an int in"),
    (lambda d: d["attachments"].update(
        {"x.bin": {**d["attachments"]["config.json"],
                   "file": next(iter(d["tensors"]["w"]["chunks"]))["file"]}}),
     "disagrees with files|also holds tensor data"),
    (lambda d: d["attachments"].update({"copy.json": d["attachments"]["config.json"]}),
     "share the file"),
    (lambda d: d.update(attachments=[]), "'attachments' must be an object"),
])
def test_manifest_attachment_rules(tmp_path, change, message):
    url = str(tmp_path / "root")
    ckpt.save(_state(1.0), url, 1, attachments={"config.json": CONFIG})
    _rewrite_manifest(url, 1, change)
    with pytest.raises(CorruptCheckpointError, match=message):
        CheckpointStore(url).read_manifest(1)


def test_item_file_cannot_be_an_attachment(tmp_path):
    # An attachment whose file also holds tensor bytes (sizes and crcs made to agree).
    url = str(tmp_path / "root")
    ckpt.save(_state(1.0), url, 1, attachments={"config.json": CONFIG})

    def change(d):
        data = d["tensors"]["w"]["chunks"][0]["file"]
        d["attachments"]["x.bin"] = {"file": data, "size": d["files"][data]["size"],
                                     "crc32c": d["files"][data]["crc32c"]}
    _rewrite_manifest(url, 1, change)
    with pytest.raises(CorruptCheckpointError, match="also holds tensor data"):
        CheckpointStore(url).read_manifest(1)


def _fail(*_):
    raise RuntimeError("injected failure before the commit")


def test_rollback_gc_cleanup_never_lose_a_kept_versions_attachment(tmp_path, capsys):
    url = str(tmp_path / "root")
    ckpt.save(_state(1.0), url, 1, attachments={"config.json": b"one"})
    old2 = ckpt.save(_state(2.0), url, 2, attachments={"config.json": b"two"})
    assert ckpt_main(["rollback", url, "--step", "1"]) == 0
    # A dead attempt at step 2 (its writer failed before the commit): marker, data,
    # attachments.
    with pytest.raises(RuntimeError, match="injected"):
        save_with(_state(99.0), Storage(url), 2,
                  SaveRequest(before_commit=_fail, save_id="deadbeef0001"),
                  attachments={"config.json": b"dead"})
    # The resumed run saves 2 again, with other attachments, beside the rolled-back one.
    new2 = ckpt.save(_state(20.0), url, 2, attachments={"config.json": b"twenty",
                                                        "extra.txt": b"x"})
    dead = {n for n in _folder(url, 2) if "deadbeef0001" in n}
    assert "a_deadbeef0001_config.json" in dead and "pending-deadbeef0001.json" in dead
    kept = _attachment_files(url, 2) - dead
    assert len(kept) == 3  # rolled-back two, committed twenty + extra

    # gc (dry run, then for real) and a new holder's cleanup remove only the dead attempt.
    assert ckpt_main(["gc", url]) == 0
    assert f"step 2: would remove {len(dead)} leftover file(s)" in capsys.readouterr().out
    assert dead <= _folder(url, 2)
    assert ckpt_main(["gc", url, "--yes"]) == 0
    assert _attachment_files(url, 2) == kept and not (dead & _folder(url, 2))
    life = acquire_lease(Storage(url))
    try:
        life.cleanup()
    finally:
        release_lease(life)
    assert _attachment_files(url, 2) == kept
    assert ckpt.read_attachment(url, 2, "config.json") == b"twenty"
    assert ckpt.read_attachment(url, 1, "config.json") == b"one"

    # Restore the rolled-back version: its attachment is there and verified.
    assert ckpt_main(["restore", url, "--id", old2.save_id, "--replace"]) == 0
    assert ckpt.read_attachment(url, 2, "config.json") == b"two"
    assert ckpt.list_attachments(url, 2) == {"config.json": 3}
    life = acquire_lease(Storage(url))
    try:
        life.cleanup()
    finally:
        release_lease(life)
    assert _attachment_files(url, 2) == kept  # the now rolled-back twenty keeps its files
    store = CheckpointStore(url)
    rolled = [e for e in store.entries(2) if e.status == ROLLED_BACK]
    assert [e.id for e in rolled] == [new2.save_id]
    assert ckpt_main(["verify", url, "--id", new2.save_id]) == 0  # its attachments too

    # gc --rolled-back deletes that version's attachments with it; nothing else.
    assert ckpt_main(["gc", url, "--rolled-back", "--yes"]) == 0
    assert _attachment_files(url, 2) == {old2.attachments["config.json"].file}
    assert ckpt.read_attachment(url, 2, "config.json") == b"two"
    # Deleting a committed checkpoint (retention) takes its attachments too.
    life = acquire_lease(Storage(url))
    try:
        life.delete(1)
    finally:
        release_lease(life)
    assert not os.path.exists(os.path.join(url, step_dirname(1))) or \
        not _attachment_files(url, 1)


def test_older_reader_rules_keep_attachments(tmp_path):
    """Attachment files are listed in ``files``: what references ``files`` keeps them even
    without knowing the ``attachments`` field (a ckpt release before it)."""
    url = str(tmp_path / "root")
    m = ckpt.save(_state(1.0), url, 1, attachments={"config.json": CONFIG})
    doc = json.loads(open(os.path.join(url, step_dirname(1), "manifest.json"), "rb").read())
    doc.pop("attachments")
    plain = Manifest.from_json_bytes(manifest_bytes(doc), "edited")
    assert m.attachments["config.json"].file in plain.files


def test_manager_passes_attachments_through(tmp_path):
    url = str(tmp_path / "root")
    cfg = tmp_path / "config.json"
    cfg.write_bytes(CONFIG)
    with CheckpointManager(url, busy="wait", cadence="2", retention=[]) as mgr:
        for step in range(1, 5):
            mgr.maybe_save(step, _state(float(step)),
                           attachments={"config.json": str(cfg), "step.txt": str(step).encode()})
        mgr.wait()
        with pytest.raises(ValueError, match="not a plain file name"):
            mgr.save(7, _state(7.0), attachments={"../x": b""})
    assert CheckpointStore(url).committed_steps() == [2, 4]
    assert ckpt.read_attachment(url, 2, "step.txt") == b"2"
    assert ckpt.read_attachment(url, 4, "config.json") == CONFIG


def _two_rank_body(rank: int, world: int, root: str, missing: str) -> dict:
    state = {"w": torch.ones(4)}  # a replica: the same on every rank
    ckpt.save(state, root, 1, attachments={"config.json": f"rank {rank}".encode()})
    # A path that cannot be read fails the save on every rank (none waits for the others).
    try:
        ckpt.save(state, root, 2, attachments={"tok.json": missing})
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None}


def test_two_ranks_coordinator_writes_and_failures_reach_every_rank(tmp_path):
    from tests.dist import run_ranks

    url = str(tmp_path / "root")
    results = run_ranks(_two_rank_body, 2, url, str(tmp_path / "nope.json"), timeout=120)
    for r in results:
        assert r["error"] and "'tok.json': file" in r["error"] and "does not exist" in r["error"]
    assert ckpt.read_attachment(url, 1, "config.json") == b"rank 0"
    m = CheckpointStore(url).read_manifest(1)
    assert m.world_size == 2 and m.files[m.attachments["config.json"].file].rank == 0
    assert CheckpointStore(url).committed_steps() == [1]
