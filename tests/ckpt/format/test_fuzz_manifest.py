"""A seeded, time-bounded fuzzer of crafted checkpoints.

A real two-step checkpoint root is built with ``ckpt.save``; then, one case at a time, the
newest step's manifest is mutated (every field: wrong types, out-of-range, huge and deeply
nested values, removed members, removed/duplicated/reordered list items), both resealed
(as a hostile writer would: the digest matches) and not (damage: the digest catches it),
and every file kind (manifest, data files, pins, history) has bytes flipped or is
truncated. For each case: nothing but our named errors escapes, nothing read back runs
code, and ``load_latest`` into a fresh state falls back to the intact step 1 whenever step 2
is refused. The original bytes are restored after each case.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import random
import time
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.cadence import HISTORY_NAME
from ckpt.cadence.history import read_history
from ckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, StateMismatchError
from ckpt.events import EventBus
from ckpt.export._consolidate import consolidate
from ckpt.format import MANIFEST_NAME, jsonio, step_dirname
from ckpt.format._check import manifest_bytes
from ckpt.job import read_pins
from ckpt.job.retention import PINS_NAME
from ckpt.storage import Storage
from tests.ckpt._helpers import assert_same

SEED = 20261130
BUDGET_SECONDS = 20.0
NAMED = (CorruptCheckpointError, CheckpointNotFoundError)  # FormatVersionError is a Corrupt...


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _state(seed: int):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g),
                      "n": torch.arange(5, dtype=torch.int64)},
            "extra": {"step": seed, "name": "run", "pair": (1, 2.5), "raw": b"\x00"}}


def _blank():
    return {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3),
                      "n": torch.zeros(5, dtype=torch.int64)},
            "extra": {"step": 0, "name": "", "pair": (0, 0.0), "raw": b""}}


def _paths(node, prefix=()):
    """Every (path, value) in a JSON tree, containers included."""
    yield prefix, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _get(doc, path):
    for p in path:
        doc = doc[p]
    return doc


HUGE = "__HUGE_NUMBER__"
DEEP = "__DEEP_NESTING__"
VALUES = [None, True, False, -1, 0, 2 ** 63, 2 ** 64 + 1, 10 ** 30, 1.5, -0.0, "x", "",
          "../../etc/passwd", [], {}, [1, 2], {"__float__": "nan"}, {"__float__": "inf"},
          "ZZ" * 300, HUGE, DEEP]


def _encode(doc) -> bytes:
    """The body of a manifest (as manifest_bytes writes it), with placeholders expanded."""
    body = json.dumps({k: v for k, v in doc.items() if k != "manifest_sha256"}, indent=1)
    body = body.replace(f'"{HUGE}"', "1" + "0" * 5000)
    body = body.replace(f'"{DEEP}"', "[" * 100_000 + "]" * 100_000)
    return body.encode()


def _sealed(body: bytes) -> bytes:
    rest = body[2:]  # after "{\n", as docs/format.md describes the digest
    return (b'{"manifest_sha256": "' + hashlib.sha256(rest).hexdigest().encode() + b'",\n'
            + rest)


def _cases(doc, files: dict[str, bytes], rng: random.Random):
    """(description, {relative path: new bytes}) pairs, in a seeded order."""
    manifest = f"{step_dirname(2)}/{MANIFEST_NAME}"
    cases = []
    for path, value in list(_paths(doc))[1:]:
        if path[0] == "manifest_sha256":
            continue
        edits = [("set", v) for v in rng.sample(VALUES, 3)]
        parent = _get(doc, path[:-1])
        edits.append(("remove", None))
        if isinstance(value, list) and value:
            edits += [("duplicate", None), ("reverse", None)]
        for kind, v in edits:
            mutated = json.loads(json.dumps(doc))
            p = _get(mutated, path[:-1])
            if kind == "set":
                p[path[-1]] = v
            elif kind == "remove":
                del p[path[-1]]
            elif kind == "duplicate":
                p[path[-1]] = value + [value[0]]
            else:
                p[path[-1]] = value[::-1]
            if isinstance(parent, dict) and kind == "set" and rng.random() < 0.2:
                p[f"{path[-1]}_renamed"] = p.pop(path[-1])
            body = _encode(mutated)
            sealed = rng.random() < 0.85
            cases.append((f"{kind} {path} = {str(v)[:30]} (sealed={sealed})",
                          {manifest: _sealed(body) if sealed else body}))
    # Raw damage to every file kind.
    for rel, data in files.items():
        for _ in range(12):
            damaged = bytearray(data)
            if damaged:
                i = rng.randrange(len(damaged))
                damaged[i] ^= 1 << rng.randrange(8)
            cases.append((f"flip a byte of {rel}", {rel: bytes(damaged)}))
        for cut in sorted({0, 1, len(data) // 2, max(0, len(data) - 1)}):
            cases.append((f"truncate {rel} to {cut}", {rel: data[:cut]}))
        cases.append((f"extend {rel}", {rel: data + b"\x00junk"}))
    rng.shuffle(cases)
    return cases


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz") / "root"
    ckpt.save(_state(1), str(root), 1, user_metadata={"loss": 2.0})
    ckpt.save(_state(2), str(root), 2, user_metadata={"loss": math.nan, "tag": "x"})
    (root / PINS_NAME).write_text(json.dumps({"pinned": [1]}))
    (root / HISTORY_NAME).write_text(json.dumps({"version": 1, "failure_times": [1.0],
                                                 "uptime_seconds": 5.0}))
    return root


def _check_case(root: Path, marker: Path) -> None:
    store = ckpt.CheckpointStore(str(root))
    try:
        manifest = store.read_manifest(2)
    except NAMED:
        manifest = None
    try:
        store.verify(2)
    except NAMED:
        pass
    for info in store.list(check="full"):
        assert info.status in ("committed", "corrupt", "incomplete", "fenced"), info
    fresh = _blank()
    try:
        loaded = ckpt.load_latest(fresh, str(root))
    except StateMismatchError:
        # Only a manifest that passed every check (a consistent forgery) gets this far.
        assert manifest is not None
    else:
        assert loaded is not None
        if manifest is None:
            assert loaded.step == 1, "a refused step 2 must fall back to step 1"
            assert torch.equal(fresh["model"]["w"], _state(1)["model"]["w"])
        else:
            assert loaded.step in (1, 2)
        # Whatever loads is exactly what was saved (no gaps filled, no bytes misplaced).
        assert_same(_state(loaded.step), fresh)
    if manifest is not None:
        try:
            consolidate(str(root), 2, verify="full")  # nested along the planner paths
            flat, _ = consolidate(str(root), 2, verify="full", nested=False)
        except NAMED:
            pass
        else:
            for key, value in _state(2)["model"].items():
                if f"model.{key}" in flat:  # a forged manifest may drop or rename keys
                    assert_same(value, flat[f"model.{key}"])
    try:
        read_pins(store, strict=True)
    except ValueError as exc:
        assert PINS_NAME in str(exc)
    read_history(Storage(str(root)), EventBus(), took_over=False, found_aborted=False)
    assert not marker.exists()


def test_crafted_checkpoints_fall_back_or_fail_with_named_errors(root, tmp_path):
    rng = random.Random(SEED)
    marker = tmp_path / "PWNED"
    d = root / step_dirname(2)
    files = {f"{step_dirname(2)}/{n}": (d / n).read_bytes() for n in sorted(os.listdir(d))}
    files[PINS_NAME] = (root / PINS_NAME).read_bytes()
    files[HISTORY_NAME] = (root / HISTORY_NAME).read_bytes()
    original = files[f"{step_dirname(2)}/{MANIFEST_NAME}"]
    assert manifest_bytes(jsonio.loads(original, "m")) == original
    doc = json.loads(original)  # the raw JSON tree: tags stay objects, to be mutated too
    assert _sealed(_encode(doc)) == original  # docs/format.md's digest, rebuilt by hand
    cases = _cases(doc, files, rng)
    # Pickles where data is expected: never unpickled.
    evil = pickle.dumps(_Payload(str(marker)))
    for rel in files:
        if rel.endswith(".bin"):
            cases.insert(0, (f"pickle in {rel}", {rel: evil}))
    start, done = time.monotonic(), 0
    for what, edit in cases:
        if time.monotonic() - start > BUDGET_SECONDS:
            break
        try:
            for rel, data in edit.items():
                (root / rel).write_bytes(data)
            _check_case(root, marker)
        except Exception as exc:
            raise AssertionError(f"case {what!r}: {type(exc).__name__}: {exc}") from exc
        finally:
            for rel in edit:
                (root / rel).write_bytes(files[rel])
        done += 1
    assert done >= min(len(cases), 100), f"only {done} of {len(cases)} cases in the budget"
    print(f"{done} of {len(cases)} crafted cases checked")
