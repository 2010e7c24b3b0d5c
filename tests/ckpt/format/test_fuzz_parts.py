"""Damaged, foreign and forged parts (format version 2) are refused, naming the part.

A real root of two steps is saved in one process with sharded chunks (each step has one
part); then step 2's part is damaged (bytes flipped, truncated, extended, deleted, replaced
by step 1's part), its checksum in the root is changed, or it is forged consistently (its
JSON mutated, resealed, and the root made to agree, as a hostile writer would). Every load
of step 2 must fail with ``CorruptCheckpointError`` naming the part (and ``load_latest``
falls back to step 1 exactly), or load exactly what was saved. The original bytes are
restored after each case.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckpt.export._consolidate import consolidate
from ckpt.format import MANIFEST_NAME, crc32c_of, jsonio, part_sha256, step_dirname
from ckpt.format._check import manifest_bytes, sealed_bytes
from tests.ckpt._helpers import assert_same
from tests.ckpt._parts import even_chunks, save_chunked

SEED = 20261201
BUDGET_SECONDS = 20.0
CHUNKS = {"w": [([0, 0], [3, 4]), ([3, 0], [3, 4])], "b": even_chunks(4, 2),
          "n": even_chunks(5, 2)}


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g),
            "n": torch.arange(5, dtype=torch.int64) * seed, "note": f"seed {seed}"}


def _blank() -> dict:
    return {"w": torch.zeros(6, 4), "b": torch.zeros(4), "n": torch.zeros(5, dtype=torch.int64),
            "note": ""}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, str]:
    """The root, and the name of step 2's part."""
    root = tmp_path_factory.mktemp("parts") / "root"
    save_chunked(str(root), 1, _state(1), CHUNKS)
    manifest = save_chunked(str(root), 2, _state(2), CHUNKS)
    (name,) = manifest.parts
    return root, name


class _Restored:
    """Restores step 2's folder (the part and the root) to its saved bytes on exit."""

    def __init__(self, root: Path):
        self.folder = root / step_dirname(2)
        self.saved = {p.name: p.read_bytes() for p in self.folder.iterdir()}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.folder.iterdir():
            if p.name not in self.saved:
                p.unlink()
        for name, data in self.saved.items():
            (self.folder / name).write_bytes(data)


def _refused(root: Path, name: str) -> CorruptCheckpointError:
    """Step 2 does not load, the error names the part; ``load_latest`` falls back exactly."""
    with pytest.raises(CorruptCheckpointError) as info:
        ckpt.load(_blank(), str(root), 2)
    assert name in str(info.value), info.value
    fresh = _blank()
    loaded = ckpt.load_latest(fresh, str(root))
    assert loaded is not None and loaded.step == 1
    assert_same(_state(1), fresh)
    return info.value


def _reseal(root: Path, name: str, doc_or_bytes) -> None:
    """Write part ``name`` (a document, sealed, or raw bytes) and make the root agree."""
    folder = root / step_dirname(2)
    data = doc_or_bytes if isinstance(doc_or_bytes, bytes) else \
        sealed_bytes(doc_or_bytes, "part_sha256", compact=True)
    (folder / name).write_bytes(data)
    doc = jsonio.loads((folder / MANIFEST_NAME).read_bytes(), "root")
    doc["parts"][name]["sha256"] = part_sha256(data)
    doc["files"][name].update(size=len(data), crc32c=f"{crc32c_of([data]):08x}")
    (folder / MANIFEST_NAME).write_bytes(manifest_bytes(doc))


def test_damaged_missing_and_foreign_parts_are_refused_naming_them(saved):
    root, name = saved
    path = root / step_dirname(2) / name
    data = path.read_bytes()
    rng = random.Random(SEED)
    cases = [("flip", i) for i in sorted(rng.sample(range(len(data)), 24))]
    cases += [("truncate", cut) for cut in (0, 1, len(data) // 2, len(data) - 1)]
    cases += [("extend", None), ("delete", None), ("foreign", None)]
    for kind, arg in cases:
        with _Restored(root):
            if kind == "flip":
                damaged = bytearray(data)
                damaged[arg] ^= 1 << rng.randrange(8)
                path.write_bytes(bytes(damaged))
            elif kind == "truncate":
                path.write_bytes(data[:arg])
            elif kind == "extend":
                path.write_bytes(data + b"\x00junk")
            elif kind == "delete":
                path.unlink()
            else:  # step 1's part, copied over step 2's
                (other,) = (root / step_dirname(1)).glob("part-*.json")
                path.write_bytes(other.read_bytes())
            err = _refused(root, name)
            assert err.path is not None and err.path.endswith(name), (kind, arg, err)
            with pytest.raises(CorruptCheckpointError, match=name):
                ckpt.CheckpointStore(str(root)).verify(2)


def test_a_part_whose_sha256_in_the_root_differs_is_refused(saved):
    root, name = saved
    folder = root / step_dirname(2)
    with _Restored(root):
        doc = jsonio.loads((folder / MANIFEST_NAME).read_bytes(), "root")
        doc["parts"][name]["sha256"] = "0" * 64
        (folder / MANIFEST_NAME).write_bytes(manifest_bytes(doc))
        err = _refused(root, name)
        assert "SHA-256" in str(err) and err.expected == "0" * 64


def _row(doc: dict, key: str = "w") -> list:
    return doc["chunks"][key][0]


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(format="ckpt"), "not a ckpt part"),
    (lambda d: d.update(format_version=3), "format_version 3"),
    (lambda d: d.update(step=1), "does not belong here"),
    (lambda d: d.update(rank=1), "does not belong here"),
    (lambda d: d.update(files=d["files"] + ["elsewhere.bin"]), "'files' must list"),
    (lambda d: d["chunks"].update(note=d["chunks"]["w"]), "not a sharded tensor"),
    (lambda d: d["chunks"].update(zzz=[]), "not a sharded tensor"),
    (lambda d: _row(d).__setitem__(0, [5, 0]), "lies outside the tensor's shape"),
    (lambda d: _row(d).__setitem__(0, [0]), "int lists of the tensor's rank"),
    (lambda d: _row(d).__setitem__(2, 9), "file index"),
    (lambda d: _row(d).__setitem__(3, 10 ** 6), "lies outside file"),
    (lambda d: _row(d).__setitem__(4, 4), "length 4 != 12 elements"),
    (lambda d: _row(d).__setitem__(5, -1), "crc32c must be an int"),
    (lambda d: _row(d).append(0), "must be \\[offsets, sizes"),
    (lambda d: d["chunks"]["w"].append(list(_row(d))), "share bytes|listed twice"),
    (lambda d: d["refs"].update(w=[[[0, 0], 0]]), "naming another rank's part"),
    (lambda d: d["refs"].update(w=[[[0, 0], 7]]), "naming another rank's part"),
    (lambda d: d.update(chunks=[]), "'chunks' and 'refs' must be objects"),
])
def test_forged_parts_are_refused_naming_the_part(saved, edit, match):
    root, name = saved
    folder = root / step_dirname(2)
    with _Restored(root):
        doc = jsonio.loads((folder / name).read_bytes(), name)
        edit(doc)
        _reseal(root, name, doc)
        err = _refused(root, name)
        assert re.search(match, str(err)), (match, err)


VALUES = [None, True, -1, 0, 2 ** 63, 1.5, "x", [], {}, [1, 2], [[0], 1], "ZZ" * 300]


def _paths(node, prefix=()):
    yield prefix, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def test_any_forged_part_is_refused_or_loads_exactly(saved):
    """Seeded mutations of every member of the part, resealed with the root made to agree:
    only named errors escape; what loads is exactly what was saved."""
    root, name = saved
    folder = root / step_dirname(2)
    original = jsonio.loads((folder / name).read_bytes(), name)
    rng = random.Random(SEED)
    cases = []
    for path, value in list(_paths(original))[1:]:
        for kind, v in [("set", v) for v in rng.sample(VALUES, 2)] + [("remove", None)] + (
                [("duplicate", None), ("reverse", None)] if isinstance(value, list) and value
                else []):
            cases.append((path, kind, v))
    rng.shuffle(cases)
    deadline = time.monotonic() + BUDGET_SECONDS
    checked = 0
    for path, kind, v in cases:
        if time.monotonic() > deadline:
            break
        doc = json.loads(json.dumps(original))
        parent = doc
        for p in path[:-1]:
            parent = parent[p]
        value = parent[path[-1]]
        if kind == "set":
            parent[path[-1]] = v
        elif kind == "remove":
            del parent[path[-1]]
        elif kind == "duplicate":
            parent[path[-1]] = value + [value[0]]
        else:
            parent[path[-1]] = value[::-1]
        with _Restored(root):
            _reseal(root, name, doc)
            fresh = _blank()
            try:
                ckpt.load(fresh, str(root), 2)
            except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                assert name in str(exc) or step_dirname(2) in str(exc), (path, kind, exc)
            else:
                assert_same(_state(2), fresh, f"{kind} {path}")
            try:
                flat, _ = consolidate(str(root), 2, nested=False)
            except (CorruptCheckpointError, CheckpointNotFoundError):
                pass
            else:
                for key in ("w", "b", "n"):
                    assert_same(_state(2)[key], flat[key], f"{kind} {path}: {key}")
        checked += 1
    assert checked >= 20, checked
