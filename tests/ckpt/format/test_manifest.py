"""The manifest checks its own digest and every MUST of docs/format.md before it is used."""

from __future__ import annotations

import json
import math
import re
import shutil
import time

import pytest
import torch

import ckpt
from ckpt.errors import CorruptCheckpointError
from ckpt.format import MANIFEST_NAME, Manifest, coverage_problem, step_dirname
from ckpt.format._check import DIGEST_KEY, manifest_bytes
from ckpt.format.coverage import MAX_GRID_CELLS
from ckpt.root.lifecycle import parse_marker

SRC = "root/step_000000001/manifest.json"


def _doc(shape, boxes, *, dtype="float32", itemsize=4, step=1, **extra):
    """A manifest document for one tensor ``t`` cut into ``boxes`` ((offsets, sizes) pairs),
    stored back to back in one file."""
    chunks, offset = [], 0
    for offs, sizes in boxes:
        length = math.prod(sizes) * itemsize
        chunks.append({"offsets": list(offs), "sizes": list(sizes), "file": "a.bin",
                       "offset": offset, "length": length, "crc32c": "00000000"})
        offset += length
    doc = {"format": "ckpt", "format_version": 1, "step": step, "save_id": "s",
           "created_unix": 1.0, "files": {"a.bin": {"size": offset, "crc32c": "00000000"}},
           "tensors": {"t": {"dtype": dtype, "shape": list(shape), "chunks": chunks}},
           "objects": {}, "planner_data": {"t": ["t"]}}
    doc.update(extra)
    return doc


def _parse(doc, **kw) -> Manifest:
    return Manifest.from_json_bytes(manifest_bytes(doc), SRC, **kw)


def _refused(doc, match, **kw) -> CorruptCheckpointError:
    with pytest.raises(CorruptCheckpointError, match=match) as info:
        _parse(doc, **kw)
    assert info.value.path == SRC and SRC in str(info.value)
    return info.value


# -- the digest ------------------------------------------------------------------------------
def test_every_single_byte_flip_of_a_real_manifest_is_refused(tmp_path):
    saved = ckpt.save({"m": {"w": torch.ones(2, 3), "step": 4}}, str(tmp_path), 1,
                      user_metadata={"loss": 1.5})
    data = (tmp_path / step_dirname(1) / MANIFEST_NAME).read_bytes()
    assert data.startswith(b'{"manifest_sha256": "')
    assert Manifest.from_json_bytes(data, SRC).tensors == saved.tensors
    accepted = []
    for i in range(len(data)):
        for bit in (0x01, 0x20):
            damaged = bytearray(data)
            damaged[i] ^= bit
            try:
                m = Manifest.from_json_bytes(bytes(damaged), SRC)
            except CorruptCheckpointError as exc:
                assert exc.path == SRC
                continue
            accepted.append((i, bit))
            # Only a flip inside the digest line itself can leave a readable manifest: the
            # rest is intact then, so it reads exactly as written.
            assert i < data.index(b"\n") and m.tensors == saved.tensors, (i, bit)
    assert len(accepted) < 2 * data.index(b"\n")


def test_a_flipped_tensor_key_falls_back_instead_of_a_state_mismatch(tmp_path):
    state = {"m": {"w": torch.ones(3)}}
    ckpt.save(state, str(tmp_path), 1)
    ckpt.save({"m": {"w": torch.full((3,), 2.0)}}, str(tmp_path), 2)
    path = tmp_path / step_dirname(2) / MANIFEST_NAME
    path.write_bytes(path.read_bytes().replace(b'"m.w"', b'"m.v"'))
    with pytest.raises(CorruptCheckpointError, match="manifest is damaged.*load an earlier"):
        ckpt.CheckpointStore(str(tmp_path)).verify(2)
    target = {"m": {"w": torch.zeros(3)}}
    assert ckpt.load_latest(target, str(tmp_path)).step == 1
    assert torch.equal(target["m"]["w"], torch.ones(3))


def test_manifests_without_a_digest_are_still_read():
    doc = _doc([4], [([0], [4])])
    m = Manifest.from_json_bytes(json.dumps(doc).encode(), SRC)  # as written before digests
    assert m.tensors["t"]["shape"] == [4]
    # ... but a digest member anywhere but the first line means the file was tampered with.
    doc[DIGEST_KEY] = "0" * 64
    with pytest.raises(CorruptCheckpointError, match="not its first line"):
        Manifest.from_json_bytes(json.dumps(doc).encode(), SRC)


def test_a_manifest_copied_into_another_steps_folder_is_refused(tmp_path):
    ckpt.save({"w": torch.ones(2)}, str(tmp_path), 5)
    (tmp_path / step_dirname(9)).mkdir()
    shutil.copy(tmp_path / step_dirname(5) / MANIFEST_NAME, tmp_path / step_dirname(9))
    store = ckpt.CheckpointStore(str(tmp_path))
    with pytest.raises(CorruptCheckpointError, match="of step 5, but it lies in the folder of "
                                                     "step 9"):
        store.read_manifest(9)
    assert store.read_manifest(5).step == 5
    assert ckpt.load_latest({"w": torch.zeros(2)}, str(tmp_path)).step == 5


def test_nan_in_user_metadata_saves_and_comes_back(tmp_path):
    meta = {"loss": math.nan, "best": -math.inf, "nested": {"x": [math.inf, 1.0]},
            "__float__": "nan"}
    ckpt.save({"w": torch.ones(2)}, str(tmp_path), 1, user_metadata=meta,
              layout={"scale": math.inf})
    data = (tmp_path / step_dirname(1) / MANIFEST_NAME).read_bytes()
    assert b"NaN" not in data and b"Infinity" not in data
    m = ckpt.CheckpointStore(str(tmp_path)).read_manifest(1)
    assert math.isnan(m.user_metadata["loss"]) and m.user_metadata["best"] == -math.inf
    assert m.user_metadata["nested"] == {"x": [math.inf, 1.0]}
    assert m.user_metadata["__float__"] == "nan" and m.layout == {"scale": math.inf}


# -- chunk coverage --------------------------------------------------------------------------
def test_exact_tilings_are_accepted():
    _parse(_doc([4, 6], [([0, 0], [2, 6]), ([2, 0], [2, 3]), ([2, 3], [2, 3])]))
    _parse(_doc([], [([], [])]))
    _parse(_doc([0, 3], []))
    _parse(_doc([5], [([0], [5]), ([5], [0])]))  # an empty chunk covers nothing


@pytest.mark.parametrize("boxes, match", [
    ([([0, 0], [2, 6])], "chunks hold 12 elements, the shape \\[4, 6\\] has 24"),  # missing
    ([([0, 0], [2, 6]), ([0, 0], [2, 6])], "overlaps another chunk"),  # duplicated
    ([([0, 0], [3, 6]), ([2, 0], [2, 6])], "hold 30 elements"),  # overlap
    ([([0, 0], [2, 6]), ([1, 0], [2, 6])], "overlaps another chunk"),  # sums match, but
    # an overlap hides a gap
    ([([0, 0], [4, 7])], "lies outside the tensor's shape"),
    ([([0], [4])], "int lists of the tensor's rank"),
])
def test_gaps_overlaps_and_strays_are_refused(boxes, match):
    _refused(_doc([4, 6], boxes), match)


def test_a_scalar_needs_exactly_one_chunk():
    _refused(_doc([], []), "scalar and needs exactly one chunk")
    _refused(_doc([], [([], []), ([], [])]), "scalar and needs exactly one chunk")


def test_coverage_check_is_fast_for_thousands_of_chunks():
    start = time.monotonic()
    _parse(_doc([8192, 4], [([i, 0], [1, 4]) for i in range(8192)]))
    _parse(_doc([64, 128], [([i, j], [1, 2]) for i in range(64) for j in range(0, 128, 2)]))
    err = _refused(_doc([8192, 4], [([i, 0], [1, 4]) for i in range(8191)] + [([0, 0], [1, 4])]),
                   "overlaps")
    assert "chunks[8191]" in str(err)
    assert time.monotonic() - start < 10


def test_a_fragmented_layout_beyond_the_grid_limit_is_refused_without_allocating():
    side = int(math.isqrt(MAX_GRID_CELLS)) + 2
    # Columns of width 1 and a stack of rows in the last column: a valid tiling whose cuts
    # form side^2 cells; refused before any grid is built.
    boxes = [([0, j], [side, 1]) for j in range(side - 1)] + \
            [([i, side - 1], [1, 1]) for i in range(side)]
    _refused(_doc([side, side], boxes, dtype="uint8", itemsize=1), "grid of .* cells")


def test_huge_declared_shapes_are_refused_before_anything_is_allocated():
    doc = _doc([10 ** 14], [([0], [10 ** 14])])
    doc["files"]["a.bin"]["size"] = 16  # the size a reader finds on storage (see test_export)
    _refused(doc, "range \\[0, 400000000000000\\) lies outside file 'a.bin' of 16 bytes")
    doc = _doc([10 ** 14], [])
    _refused(doc, "chunks hold 0 elements")
    _refused(_doc([2 ** 62, 4], []), "too large")
    _refused(_doc([1] * 40, [([0] * 40, [1] * 40)]), "at most 32 ints")
    doc = _doc([4], [([0], [4])])
    doc["files"]["a.bin"]["size"] = 10 ** 30
    _refused(doc, "size must be an int in")


def test_items_must_not_share_bytes():
    doc = _doc([2, 2], [([0, 0], [1, 2]), ([1, 0], [1, 2])])
    doc["tensors"]["t"]["chunks"][1]["offset"] = 4
    _refused(doc, "share bytes of file 'a.bin'")
    doc = _doc([2], [([0], [2])])
    doc["objects"]["o"] = {"file": "a.bin", "offset": 0, "length": 1, "crc32c": "00000000"}
    _refused(doc, "share bytes")


# -- other fields ----------------------------------------------------------------------------
@pytest.mark.parametrize("planner_data, match", [
    ({"t": []}, "list of 1 to 64"),
    ({"t": [1.5]}, "strings or ints"),
    ({"t": [True]}, "strings or ints"),
    ({"t": [2 ** 40]}, "ints in"),
    ({"t": ["a"] * 65}, "list of 1 to 64"),
    ({"t": "t"}, "list of 1 to 64"),
    ({"t": ["a", 0], "u": ["a", 0]}, "collide .* the same as"),
    ({"t": ["a"], "u": ["a", "b"]}, "collide .* a prefix of"),
    ([], "planner_data must be an object"),
])
def test_planner_data_is_checked(planner_data, match):
    _refused(_doc([1], [([0], [1])], planner_data=planner_data), match)
    _parse(_doc([1], [([0], [1])], planner_data={"t": ["a", 0], "u": ["a", "0"]}))


@pytest.mark.parametrize("field, value, match", [
    ("step", -1, "step must be"), ("step", 2 ** 64, "step must be"), ("step", "1", "step"),
    ("step", True, "step"), ("created_unix", math.nan, "finite"),
    ("save_id", 3, "save_id"), ("user_metadata", [], "'user_metadata' must be an object"),
    ("tensors", [], "'tensors' must be an object"), ("files", None, "'files' must be"),
])
def test_field_types(field, value, match):
    _refused(_doc([1], [([0], [1])], **{field: value}), match)


def test_expected_step():
    assert _parse(_doc([1], [([0], [1])], step=7), expected_step=7).step == 7
    _refused(_doc([1], [([0], [1])], step=7), "of step 7, but .* step 8", expected_step=8)


def test_pending_marker():
    assert parse_marker(b'{"owner": "job", "save_id": "x", "step": 3}', "p")["owner"] == "job"
    for bad in (b"[1]", b'{"owner": 3}', b"[" * 100_000, b'{"step": ' + b"9" * 5000 + b"}",
                b"\xff"):
        with pytest.raises(CorruptCheckpointError, match="^p: "):
            parse_marker(bad, "p")


@pytest.mark.parametrize("meta, match", [
    ({"big": 10 ** 400}, "integer of 401 digits"),
    ({"deep": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]
               ]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}, "nested deeper than 64"),
])
def test_a_save_whose_manifest_readers_would_refuse_fails_instead(tmp_path, meta, match):
    with pytest.raises(ValueError, match=f"cannot write the manifest of step 1: .*{match}"):
        ckpt.save({"w": torch.ones(2)}, str(tmp_path), 1, user_metadata=meta)
    assert ckpt.CheckpointStore(str(tmp_path)).committed_steps() == []


# -- partial versions (span: one node's share of a job-wide checkpoint) ----------------------
def test_a_span_names_the_versions_ranks_of_the_job():
    span = {"node": 1, "nodes": 2, "ranks": [2, 3], "world_size": 4}
    m = _parse(_doc([1], [([0], [1])], world_size=2, span=span))
    assert m.span.to_json() == span and m.span.matches([2, 3], 4)
    assert not m.span.matches([0, 1], 4) and not m.span.matches([2, 3], 6)
    assert m.span.describe() == "node 1's share of a job of 2 nodes (ranks 2-3 of 4)"
    assert _parse(_doc([1], [([0], [1])])).span is None  # a whole checkpoint has none
    for bad, match in (([], "span must be an object"),
                       ({**span, "node": -1}, r"span\.node must be"),
                       ({**span, "nodes": 0}, r"span\.nodes must be"),
                       ({**span, "ranks": [2]}, r"span\.ranks must list 2 distinct"),
                       ({**span, "ranks": [2, 2]}, r"span\.ranks must list 2 distinct"),
                       ({**span, "ranks": [2, 4]}, r"span\.ranks must list 2 distinct"),
                       ({**span, "world_size": True}, r"span\.world_size must be")):
        _refused(_doc([1], [([0], [1])], world_size=2, span=bad), match)


@pytest.mark.parametrize("boxes, problem", [
    ([([2, 0], [2, 6])], None),  # one node's rows: the rest is the other node's
    ([], None),
    ([([0, 0], [1, 6]), ([3, 0], [1, 3])], None),
    ([([0, 0], [2, 6]), ([0, 0], [2, 6])], "overlaps another chunk"),
    ([([0, 0], [2, 6]), ([1, 0], [2, 3])], "overlaps another chunk"),
    ([([0, 0], [3, 6]), ([2, 0], [2, 6])], "hold 30 elements"),
])
def test_partial_coverage_admits_gaps_never_overlaps(boxes, problem):
    found = coverage_problem([4, 6], boxes, partial=True)
    assert (found is None) if problem is None else re.search(problem, found), found
    assert coverage_problem([], [], partial=True) is None
    assert "needs exactly one chunk" in coverage_problem([], [([], []), ([], [])],
                                                         partial=True)


def test_only_a_version_with_a_span_may_hold_a_tensor_in_part(tmp_path):
    """The same chunks (elements 2..5 of 6) verify as one node's share, and are refused as
    a whole checkpoint (a writer that lost chunks); the share never loads where it lacks
    chunks, and is never exported."""
    from ckpt.errors import PartialCheckpointError
    from ckpt.export import export
    from ckpt.format import Span
    from tests.ckpt._parts import save_chunked

    state, chunks = {"w": torch.arange(6.0)}, {"w": [([2], [4])]}
    save_chunked(str(tmp_path / "share"), 1, state, chunks, span=Span(0, 2, (0,), 1))
    m = ckpt.CheckpointStore(str(tmp_path / "share")).verify(1)
    assert m.span is not None
    # On its own layout, a load that needs the rows the share lacks is refused, the state
    # untouched (DCP alone would read elements 2..5 and leave 0..1 as they were).
    target = {"w": torch.full((6,), -1.0)}
    with pytest.raises(PartialCheckpointError, match="lacks chunks of key 'w' that rank 0"):
        ckpt.load(target, str(tmp_path / "share"), 1)
    assert torch.equal(target["w"], torch.full((6,), -1.0))
    with pytest.raises(PartialCheckpointError, match="node 0's share .* not a whole one"):
        export(str(tmp_path / "share"), 1, str(tmp_path / "out.pt"))
    save_chunked(str(tmp_path / "whole"), 1, state, chunks)
    with pytest.raises(CorruptCheckpointError, match="chunks hold 4 elements, the shape"):
        ckpt.CheckpointStore(str(tmp_path / "whole")).verify(1)
