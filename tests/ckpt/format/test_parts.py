"""Format version 2: the chunks of sharded tensors live in per-rank parts.

One process here (the multi-rank reads are in test_parts_dist.py, damaged parts in
test_fuzz_parts.py): a save puts its shards' chunks in its part and the root lists the
part; loads find chunks through an index (counted, not timed); a crafted checkpoint of
300k one-element chunks loads or is refused within bounds; a dead attempt's part goes with
its data files; a version 1 checkpoint (a stored fixture, written before parts existed)
still loads, verifies, shows and exports.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import ckpt
from ckpt.cli import main as cli_main
from ckpt.dcp.planners import SafeLoadPlanner
from ckpt.dcp.reader import CkptReader
from ckpt.errors import CorruptCheckpointError
from ckpt.export._consolidate import consolidate
from ckpt.format import MANIFEST_NAME, jsonio, step_dirname
from ckpt.format._check import manifest_bytes
from ckpt.root import Lifecycle, acquire_lease, release_lease
from ckpt.storage import Storage
from tests.ckpt._parts import craft_chunked, even_chunks, save_chunked

FIXTURES = Path(__file__).parent.parent / "fixtures"


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 6, generator=g), "b": torch.randn(6, generator=g),
            "note": f"seed {seed}"}


_CHUNKS = {"w": [([0, 0], [4, 6]), ([4, 0], [4, 3]), ([4, 3], [4, 3])],
           "b": even_chunks(6, 3)}


def _blank() -> dict:
    return {"w": torch.zeros(8, 6), "b": torch.zeros(6), "note": ""}


def test_a_sharded_tensors_chunks_are_in_its_part_and_the_root_lists_the_part(any_root):
    url, options = any_root
    storage = Storage(url, options)
    saved = save_chunked(storage, 1, _state(1), _CHUNKS)
    assert saved.format_version == 2 and not saved.complete
    (name, record), = saved.parts.items()
    assert name == f"part-r00000_{saved.save_id}.json" and record.rank == 0
    assert saved.files[name].rank == 0  # listed among the version's files, with its rank
    data = storage.read_bytes(f"{step_dirname(1)}/{name}")
    assert hashlib.sha256(data).hexdigest() == record.sha256
    assert data.startswith(b'{"part_sha256": "')
    root = json.loads(storage.read_bytes(f"{step_dirname(1)}/{MANIFEST_NAME}"))
    assert root["format_version"] == 2 and root["parts"] == {name: record.to_json()}
    for key in ("w", "b"):  # the root knows the key, not its chunks
        assert root["tensors"][key]["sharded"] is True and root["tensors"][key]["chunks"] == []
    store = ckpt.CheckpointStore(storage)
    full = store.read_manifest(1, complete=True)
    assert full.complete and len(full.tensors["w"]["chunks"]) == 3
    assert all(c["part"] == name for c in full.tensors["w"]["chunks"])
    store.verify(1)
    state = _blank()
    ckpt.load(state, storage, 1)
    assert torch.equal(state["w"], _state(1)["w"]) and torch.equal(state["b"], _state(1)["b"])
    assert state["note"] == "seed 1"
    # A restore re-commits the root as it was: the parts' chunks are not copied into it.
    life = acquire_lease(storage, ttl_seconds=30)
    try:
        kept = life.uncommit(1)
        life.restore(kept)
    finally:
        release_lease(life)
    again = json.loads(storage.read_bytes(f"{step_dirname(1)}/{MANIFEST_NAME}"))
    assert again["tensors"] == root["tensors"] and again["parts"] == root["parts"]
    state = _blank()
    ckpt.load(state, storage, 1)
    assert torch.equal(state["w"], _state(1)["w"])


class _Counted(list):
    """A list that counts the items handed out by iterating it."""

    def __init__(self, items, counter: list[int]):
        super().__init__(items)
        self.counter = counter

    def __iter__(self):
        for item in super().__iter__():
            self.counter[0] += 1
            yield item


class _CountingReader(CkptReader):
    """Our reader, with every tensor's chunk list in the metadata counting its iterations."""

    counter = [0]

    def read_metadata(self, *args, **kwargs):
        md = super().read_metadata(*args, **kwargs)
        for value in md.state_dict_metadata.values():
            if hasattr(value, "chunks") and not isinstance(value.chunks, _Counted):
                value.chunks = _Counted(value.chunks, self.counter)
        return md


def _chunks_visited(root: str, n: int, version: int) -> int:
    values = craft_chunked(root, 1, n, version=version)
    storage = Storage(root)
    manifest = ckpt.CheckpointStore(storage).read_manifest(1)
    reader = _CountingReader(storage, step_dirname(1), manifest)
    reader.counter[0] = 0
    state = {"t": torch.zeros(n)}
    with warnings.catch_warnings():  # DCP warns of one process even when asked for one
        warnings.filterwarnings("ignore", message=".*assuming the intent is")
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    reader.apply()
    assert torch.equal(state["t"], values)
    return reader.counter[0]


@pytest.mark.parametrize("version", [1, 2])
def test_finding_a_chunk_costs_the_same_however_many_the_tensor_has(tmp_path, version):
    # A lookup per read by scanning the tensor's chunks visits n^2/2 chunks in all: 16x
    # from 1k to 4k chunks. Through an index (and DCP's own sorted sweep) it grows 4x.
    small = _chunks_visited(str(tmp_path / "small"), 1000, version)
    large = _chunks_visited(str(tmp_path / "large"), 4000, version)
    assert large / small < 6, (small, large)


def test_a_crafted_checkpoint_of_300k_one_element_chunks_loads_in_bounded_time(tmp_path):
    n = 300_000
    root = str(tmp_path / "root")
    values = craft_chunked(root, 1, n, num_parts=4)  # saved by 4 ranks: read all parts
    state = {"t": torch.zeros(n)}
    start = time.process_time()
    ckpt.load(state, root, 1)
    seconds = time.process_time() - start
    assert torch.equal(state["t"], values)
    # About 3 s of CPU on an idle machine (docs/performance.md); quadratic work would take
    # hours. The bound leaves room for a slow, shared CI machine.
    assert seconds < 120, seconds


def test_a_crafted_300k_chunk_part_with_a_duplicate_is_refused_naming_it(tmp_path):
    n = 300_000
    root = tmp_path / "root"
    craft_chunked(str(root), 1, n, num_parts=2)
    folder = root / step_dirname(1)
    name = next(p.name for p in folder.iterdir() if p.name.startswith("part-r00001"))
    doc = jsonio.loads((folder / name).read_bytes(), name)
    doc["chunks"]["t"][-1][0] = [0]  # also listed by rank 0's part
    _reseal_part(folder, name, doc)
    start = time.process_time()
    with pytest.raises(CorruptCheckpointError, match=r"chunk \[0\] of 't' is listed twice"):
        ckpt.load({"t": torch.zeros(n)}, str(root), 1)
    assert time.process_time() - start < 120


def _reseal_part(folder: Path, name: str, doc: dict) -> None:
    """Write part ``name`` holding ``doc`` and make the root agree with it (a forger's
    consistent edit: digests, sizes and checksums all match)."""
    from ckpt.format import crc32c_of, part_sha256
    from ckpt.format._check import sealed_bytes

    data = sealed_bytes(doc, "part_sha256", compact=True)
    (folder / name).write_bytes(data)
    root = jsonio.loads((folder / MANIFEST_NAME).read_bytes(), "root")
    root["parts"][name]["sha256"] = part_sha256(data)
    root["files"][name].update(size=len(data), crc32c=f"{crc32c_of([data]):08x}")
    (folder / MANIFEST_NAME).write_bytes(manifest_bytes(root))


def test_a_dead_attempts_part_is_removed_with_its_data_files(tmp_path):
    root = str(tmp_path / "root")
    storage = Storage(root)
    saved = save_chunked(storage, 1, _state(1), _CHUNKS)
    folder = tmp_path / "root" / step_dirname(1)
    dead = "0123456789ab"
    leftovers = [f"r00000_{dead}_0.bin", f"part-r00000_{dead}.json",
                 f"part-r00003_{dead}.json"]
    for name in leftovers:
        (folder / name).write_bytes(b"{}")
    life = acquire_lease(storage, ttl_seconds=30)
    try:
        assert dict(life.leftovers()) == {1: sorted(leftovers)}
        life.cleanup()
        assert sorted(os.listdir(folder)) == sorted([MANIFEST_NAME, *saved.files])
        life.delete(1)  # retention: the version's part goes with its data files
    finally:
        release_lease(life)
    assert not folder.exists() or os.listdir(folder) == []
    # An abandoned attempt's part goes too.
    os.makedirs(folder, exist_ok=True)
    for name in leftovers:
        (folder / name).write_bytes(b"{}")
    assert sorted(Lifecycle(storage).abandon(1, dead)) == sorted(leftovers)


# -- version 1 ----------------------------------------------------------------------------
V1 = FIXTURES / "v1_fsdp2"


@pytest.fixture
def v1_root(tmp_path) -> str:
    """A version 1 checkpoint written by ckpt before parts existed: an FSDP2 model (two
    ranks, each tensor in two chunks) and AdamW, at step 5 (fixtures/README.md)."""
    root = tmp_path / "v1"
    shutil.copytree(V1, root)
    return str(root)


def test_a_version_1_checkpoint_still_loads_verifies_shows_and_exports(v1_root, tmp_path,
                                                                     capsys):
    store = ckpt.CheckpointStore(v1_root)
    manifest = store.read_manifest(5)
    assert manifest.format_version == 1 and manifest.complete and not manifest.parts
    w = manifest.tensors["app.model.0.weight"]
    assert len(w["chunks"]) == 2 and not w["sharded"]  # sharded over 2 ranks, all listed
    store.verify(5)
    flat, _ = consolidate(v1_root, 5, nested=False)
    assert flat["app.model.0.weight"].shape == (8, 6)
    expected = load_file(str(FIXTURES / "v1_fsdp2_expected.safetensors"))
    for key, value in expected.items():
        assert torch.equal(flat[key], value), key
    # Loaded into one process (resharded from two), exactly the saved values.
    state = {key: torch.zeros_like(value) for key, value in expected.items()}
    ckpt.load(state, v1_root, 5, strict=False)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    assert cli_main(["verify", v1_root]) == 0
    capsys.readouterr()
    assert cli_main(["show", v1_root, "--json", "--tensors"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["format_version"] == 1 and shown["step"] == 5
    assert shown["tensors"]["app.model.0.weight"]["num_chunks"] == 2
    out = tmp_path / "v1.safetensors"
    assert cli_main(["export", v1_root, "--out", str(out)]) == 0 and out.exists()
