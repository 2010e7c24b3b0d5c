"""Control files (history, pins), links and export: hostile content is a named error or a safe
default, links never lead reads or writes out of the root, export allocates nothing on a
manifest's word alone."""

from __future__ import annotations

import json
import os

import pytest
import torch

import ckpt
from ckpt.cadence import HISTORY_NAME, write_history
from ckpt.cadence.history import read_history
from ckpt.errors import CorruptCheckpointError
from ckpt.events import EventBus
from ckpt.export import export
from ckpt.export._consolidate import consolidate
from ckpt.format import MANIFEST_NAME, step_dirname
from ckpt.format._check import manifest_bytes
from ckpt.job import KeepLast, KeepPinned, read_pins, set_pinned
from ckpt.job.retention import PINS_NAME, apply_retention
from ckpt.storage import Storage

HOSTILE = [b"[" * 200_000, b'{"pinned": [' + b"9" * 5000 + b"]}", b'{"pinned": [NaN]}',
           b"\xff\xfe", b'{"version": 1, "failure_times": [' + b"1" * 400 + b"]}",
           b'{"version": 1, "failure_times": [{"__float__": "nan"}]}',
           b'{"pinned": [1], "pinned": [2]}', b"1e999"]


def _save_steps(root, steps):
    for s in steps:
        ckpt.save({"w": torch.full((2,), float(s))}, root, s)
    return ckpt.CheckpointStore(root)


@pytest.mark.parametrize("content", HOSTILE)
def test_hostile_pins_keep_everything_and_name_the_file(tmp_path, content, caplog):
    root = str(tmp_path)
    store = _save_steps(root, [1, 2])
    (tmp_path / PINS_NAME).write_bytes(content)
    with pytest.raises(ValueError, match=f"{PINS_NAME} is damaged"):
        read_pins(store, strict=True)
    assert read_pins(store) == set()
    assert apply_retention(store, [KeepLast(1), KeepPinned(store)]) == []
    with pytest.raises(ValueError, match="damaged"):
        set_pinned(store, 1)
    assert (tmp_path / PINS_NAME).read_bytes() == content


@pytest.mark.parametrize("content", HOSTILE)
def test_hostile_history_is_ignored_with_a_warning(tmp_path, content, caplog):
    storage = Storage(str(tmp_path))
    (tmp_path / HISTORY_NAME).write_bytes(content)
    with caplog.at_level("WARNING", logger="ckpt.cadence.history"):
        history = read_history(storage, EventBus(), took_over=False, found_aborted=False)
    assert history.num_failures == 0 and history.uptime_seconds == 0
    assert any(HISTORY_NAME in r.getMessage() for r in caplog.records)


# -- links -------------------------------------------------------------------------------------
def test_a_linked_data_file_is_refused_and_loads_fall_back(tmp_path):
    root = tmp_path / "root"
    _save_steps(str(root), [1, 2])
    d = root / step_dirname(2)
    name = next(n for n in os.listdir(d) if n.endswith(".bin"))
    outside = tmp_path / "outside.bin"
    os.replace(d / name, outside)
    os.symlink(outside, d / name)
    with pytest.raises(CorruptCheckpointError, match=f"{name} is a symbolic link") as info:
        ckpt.CheckpointStore(str(root)).verify(2)
    assert info.value.path.endswith(name)
    for verify in ("full", "size", "none"):  # "none": the reader refuses it
        with pytest.raises(CorruptCheckpointError, match="symbolic link"):
            ckpt.load({"w": torch.zeros(2)}, str(root), 2, verify=verify)
        state = {"w": torch.zeros(2)}
        assert ckpt.load_latest(state, str(root), verify=verify).step == 1
        assert torch.equal(state["w"], torch.full((2,), 1.0))


def test_open_local_never_follows_a_link(tmp_path):
    storage = Storage(str(tmp_path / "root"))
    storage.makedirs("d")
    storage.write_bytes("d/x.bin", b"abc")
    with storage.open_local("d/x.bin") as f:
        assert f.read() == b"abc"
    os.symlink(tmp_path / "root" / "d" / "x.bin", tmp_path / "root" / "d" / "y.bin")
    with pytest.raises(CorruptCheckpointError, match="y.bin is a symbolic link"):
        storage.open_local("d/y.bin")
    with pytest.raises(FileNotFoundError):
        storage.open_local("d/absent.bin")


def test_create_local_never_writes_through_a_link_or_over_a_file(tmp_path):
    storage = Storage(str(tmp_path / "root"))
    storage.makedirs("d")
    with storage.create_local("d/x.bin") as f:
        f.write(b"abc")
    assert storage.read_bytes("d/x.bin") == b"abc"
    with pytest.raises(FileExistsError):
        storage.create_local("d/x.bin")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / "root" / "d" / "y.bin")
    with pytest.raises(FileExistsError):
        storage.create_local("d/y.bin")
    os.symlink(tmp_path, tmp_path / "root" / "out")  # a folder leading outside the root
    with pytest.raises(CorruptCheckpointError, match="outside the checkpoint root"):
        storage.create_local("out/z.bin")
    assert victim.read_text() == "precious" and not (tmp_path / "z.bin").exists()
    with pytest.raises(ValueError, match="not on a local file system"):
        Storage(f"memory://create-local-{os.getpid()}").create_local("x.bin")


def test_a_linked_manifest_or_folder_leading_outside_is_refused(tmp_path):
    root, other = tmp_path / "root", tmp_path / "other"
    _save_steps(str(root), [1])
    _save_steps(str(other), [2])
    os.symlink(other / step_dirname(2), root / step_dirname(2))  # a folder link
    store = ckpt.CheckpointStore(str(root))
    with pytest.raises(CorruptCheckpointError, match="outside the checkpoint root"):
        store.read_manifest(2)
    m = root / step_dirname(1) / MANIFEST_NAME
    os.replace(m, tmp_path / "m.json")
    os.symlink(tmp_path / "m.json", m)
    with pytest.raises(CorruptCheckpointError, match="manifest.json is a symbolic link"):
        store.read_manifest(1)
    assert ckpt.load_latest({"w": torch.zeros(2)}, str(root)) is None


def test_control_file_writes_replace_planted_links(tmp_path):
    root = tmp_path / "root"
    store = _save_steps(str(root), [1])
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    for name in (PINS_NAME, HISTORY_NAME):
        os.symlink(victim, root / name)
    with pytest.raises(ValueError, match="symbolic link"):
        set_pinned(store, 1)  # the link is a damaged pins file: refused, not followed
    os.unlink(root / PINS_NAME)
    os.symlink(tmp_path / "absent.json", root / PINS_NAME)  # a dangling link: refused too
    with pytest.raises(ValueError, match="symbolic link"):
        set_pinned(store, 1)
    store.storage.write_bytes(PINS_NAME, b'{"pinned": []}')  # a plain write replaces it
    assert set_pinned(store, 1) == {1}
    from ckpt.cadence import FailureHistory
    write_history(store.storage, FailureHistory(failure_times=[1.0]))
    store.storage.write_bytes("other.json", b"x")
    for name in (PINS_NAME, HISTORY_NAME):
        assert not os.path.islink(root / name)
    assert victim.read_text() == "precious" and not (tmp_path / "absent.json").exists()
    assert json.loads((root / PINS_NAME).read_bytes()) == {"pinned": [1]}
    assert not [n for n in os.listdir(root) if ".tmp-" in n]


def test_export_replaces_a_planted_link_at_its_output(tmp_path):
    root = tmp_path / "root"
    _save_steps(str(root), [1])
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "model.pt"
    os.symlink(victim, out)
    export(str(root), 1, str(out))
    assert victim.read_text() == "precious" and not os.path.islink(out)
    assert torch.load(out, weights_only=True)["w"].tolist() == [1.0, 1.0]


# -- export and crafted manifests ----------------------------------------------------------------
def _reseal(root, step, edit):
    path = root / step_dirname(step) / MANIFEST_NAME
    doc = json.loads(path.read_bytes())
    edit(doc)
    path.write_bytes(manifest_bytes(doc))


def test_export_checks_declared_sizes_before_allocating(tmp_path):
    root = tmp_path / "root"
    _save_steps(str(root), [1])

    def huge(doc):
        t = doc["tensors"]["w"]
        chunk = t["chunks"][0]
        n = 10 ** 14
        t["shape"], chunk["sizes"], chunk["length"] = [n], [n], n * 4
        doc["files"][chunk["file"]]["size"] = chunk["offset"] + n * 4 + 1000
    _reseal(root, 1, huge)
    for verify in ("full", "none"):
        with pytest.raises(CorruptCheckpointError, match="the manifest says"):
            consolidate(str(root), 1, verify=verify)
        with pytest.raises(CorruptCheckpointError, match="the manifest says"):
            export(str(root), 1, str(tmp_path / "x.pt"), verify=verify)


@pytest.mark.parametrize("paths, expect", [
    ({"w": ["a", 2 ** 30], "v": ["a", "b"]}, {"a": {2 ** 30: "W", "b": "V"}}),
    ({"w": ["a", 1], "v": ["a", 0]}, {"a": ["V", "W"]}),
    ({"w": [3], "v": ["x"]}, {3: "W", "x": "V"}),
])
def test_crafted_planner_paths_build_plain_containers(tmp_path, paths, expect):
    root = tmp_path / "root"
    ckpt.save({"w": torch.ones(1), "v": torch.zeros(1)}, str(root), 1)
    _reseal(root, 1, lambda doc: doc.update(planner_data=paths))
    nested, _ = consolidate(str(root), 1)
    as_names = json.loads(json.dumps(nested, default=lambda t: "W" if t.sum() else "V"))
    assert as_names == json.loads(json.dumps(expect))


def test_colliding_paths_are_a_named_error(tmp_path):
    root = tmp_path / "root"
    ckpt.save({"w": torch.ones(1), "v": torch.zeros(1)}, str(root), 1)
    # "v" has no planner path of its own, so it falls back to ["v"], which "w" claims too.
    _reseal(root, 1, lambda doc: doc.update(planner_data={"w": ["v"]}))
    with pytest.raises(CorruptCheckpointError, match="collides"):
        consolidate(str(root), 1)


@pytest.mark.parametrize("payload", [b'{"__float__":"abc"}', b'{"__tuple__":"abcde"}',
                                     b'{"__literal__":"ab"}', b'{"__dict__":["ab"]}'])
def test_a_resealed_object_no_encoder_wrote_is_refused(tmp_path, payload):
    """Object bytes replaced by a tag with a payload no encoder writes, the checksums
    recomputed: every reader refuses the value instead of loading another one."""
    from ckpt.format import crc32c_of

    root = tmp_path / "root"
    original = "x" * (len(payload) - 2)  # its JSON string is as long as the payload
    ckpt.save({"w": torch.ones(2), "obj": original}, str(root), 1)
    m = ckpt.CheckpointStore(str(root)).read_manifest(1)
    loc = m.objects["obj"]
    path = root / step_dirname(1) / loc.file
    data = bytearray(path.read_bytes())
    assert data[loc.offset:loc.offset + loc.length] == json.dumps(original).encode()
    data[loc.offset:loc.offset + loc.length] = payload
    path.write_bytes(bytes(data))
    crc = f"{crc32c_of([payload]):08x}"

    def reseal(doc):
        doc["objects"]["obj"]["crc32c"] = crc
        doc["files"][loc.file]["crc32c"] = f"{crc32c_of([bytes(data)]):08x}"
    _reseal(root, 1, reseal)
    ckpt.CheckpointStore(str(root)).verify(1, full=True)  # the checksums hold
    state = {"w": torch.zeros(2), "obj": None}
    with pytest.raises(CorruptCheckpointError, match="'obj'"):
        ckpt.load(state, str(root), 1)
    assert state["obj"] is None
    with pytest.raises(CorruptCheckpointError, match="'obj'"):
        consolidate(str(root), 1)
