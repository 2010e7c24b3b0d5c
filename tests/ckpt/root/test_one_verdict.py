"""One definition of a good checkpoint (``ckpt.root.verify_checkpoint``): ``ckpt verify``,
``ckpt list --check full``, ``pin``, ``rollback``, ``restore`` and the loaders agree.

Crafted versions are built as a hostile writer or rot would leave them: checksums and digests
recomputed wherever the format lets one (the whole file's CRC32C in the root, a part's SHA-256
and seal), so that only the check the readers used to skip can tell. A chunk whose CRC32C
no longer matches its bytes (the file's own CRC recomputed) must fail ``ckpt verify`` as it
fails every load; a rolled-back version whose part was forged must not be re-committed by
``ckpt restore``; a resume must not take a version whose attachment is damaged; a part replaced
by a large sparse file is refused before it is read (memory measured in a child process).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.cli import main as cli_main
from ckpt.errors import CorruptCheckpointError
from ckpt.format import MANIFEST_NAME, crc32c_of, jsonio, part_sha256, step_dirname
from ckpt.format._check import manifest_bytes, sealed_bytes
from ckpt.root import ROLLED_BACK, CheckpointStore
from tests.ckpt._parts import even_chunks, save_chunked

pytestmark = pytest.mark.timeout(240)

CHUNKS = {"w": [([0, 0], [3, 4]), ([3, 0], [3, 4])], "b": even_chunks(4, 2)}


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g),
            "note": f"seed {seed}"}


def _blank() -> dict:
    return {"w": torch.zeros(6, 4), "b": torch.zeros(4), "note": ""}


def cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out + err


def _doc(path: Path) -> dict:
    return jsonio.loads(path.read_bytes(), str(path))


def _crc(data: bytes) -> str:
    return f"{crc32c_of([data]):08x}"


def _rewrite_file(folder: Path, manifest: str, name: str, data: bytes) -> None:
    """``name`` (a data file or part) holds ``data``; the manifest ``manifest`` of
    ``folder`` is made to agree (size, CRC32C, a part's SHA-256) and resealed."""
    (folder / name).write_bytes(data)
    doc = _doc(folder / manifest)
    doc["files"][name].update(size=len(data), crc32c=_crc(data))
    if name in doc.get("parts", {}):
        doc["parts"][name]["sha256"] = part_sha256(data)
    (folder / manifest).write_bytes(manifest_bytes(doc))


def _chunk_bytes_changed(root: Path, step: int, manifest: str = MANIFEST_NAME) -> None:
    """A byte of the first chunk of ``w`` (a sharded tensor: listed in the part) changed
    and the data file's own CRC32C recomputed in the root: only the chunk's CRC32C,
    in the part, still tells."""
    folder = root / step_dirname(step)
    (part,) = folder.glob("part-*.json")
    row = _doc(part)["chunks"]["w"][0]
    file = _doc(part)["files"][row[2]]
    data = bytearray((folder / file).read_bytes())
    data[row[3] + 1] ^= 0x40
    _rewrite_file(folder, manifest, file, bytes(data))


def _object_crc_changed(root: Path, step: int) -> None:
    """The CRC32C recorded for the object ``note`` (in the root) altered, the root
    resealed; the data file and its own CRC32C untouched."""
    path = root / step_dirname(step) / MANIFEST_NAME
    doc = _doc(path)
    loc = doc["objects"]["note"]
    loc["crc32c"] = f"{int(loc['crc32c'], 16) ^ 1:08x}"
    path.write_bytes(manifest_bytes(doc))


@pytest.mark.parametrize("damage", [_chunk_bytes_changed, _object_crc_changed])
def test_verify_refuses_what_every_load_refuses(tmp_path, capsys, damage):
    root = tmp_path / "root"
    save_chunked(str(root), 1, _state(1), CHUNKS)
    save_chunked(str(root), 2, _state(2), CHUNKS)
    damage(root, 2)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        ckpt.load(_blank(), str(root), 2)
    assert ckpt.load_latest(_blank(), str(root)).step == 1
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch in .* bytes \["):
        CheckpointStore(str(root)).verify(2)
    rc, out = cli(capsys, "verify", root, "--step", 2)
    assert rc == 1 and "CORRUPT" in out and "checksum mismatch" in out, out
    rc, out = cli(capsys, "list", root, "--check", "full", "--json")
    rows = {r["step"]: r for r in json.loads(out[:out.rindex("]") + 1])}
    assert rc == 1 and rows[2]["status"] == "corrupt" and rows[1]["status"] == "committed"
    rc, out = cli(capsys, "pin", root, "--step", 2)
    assert rc != 0 and "refusing to pin step 2" in out, out
    rc, out = cli(capsys, "rollback", root, "--step", 2)
    assert rc != 0 and "checksum mismatch" in out, out
    assert CheckpointStore(str(root)).committed_steps() == [1, 2]


def _row(doc: dict) -> list:
    return doc["chunks"]["w"][0]


# Parts forged consistently (resealed, the root made to agree): every rule a load applies.
FORGED = [
    ("offsets outside the shape", lambda d: _row(d).__setitem__(0, [5, 0])),
    ("file index", lambda d: _row(d).__setitem__(2, 9)),
    ("offset outside its file", lambda d: _row(d).__setitem__(3, 10 ** 6)),
    ("length", lambda d: _row(d).__setitem__(4, 4)),
    ("crc32c out of range", lambda d: _row(d).__setitem__(5, -1)),
    ("a chunk listed twice", lambda d: d["chunks"]["w"].append(list(_row(d)))),
    ("a chunk dropped", lambda d: d["chunks"]["w"].pop()),
    ("a chunk's crc32c", lambda d: _row(d).__setitem__(5, _row(d)[5] ^ 1)),
    ("a ref to nobody", lambda d: d["refs"].update(w=[[[0, 0], 7]])),
    ("another step", lambda d: d.update(step=1)),
    ("not a part", lambda d: d.update(format="ckpt")),
]


@pytest.mark.parametrize("what, edit", FORGED, ids=[f for f, _ in FORGED])
def test_restore_never_recommits_what_verify_refuses(tmp_path, capsys, what, edit):
    root = tmp_path / "root"
    save_chunked(str(root), 2, _state(2), CHUNKS)
    four = save_chunked(str(root), 4, _state(4), CHUNKS)
    assert cli(capsys, "rollback", root, "--step", 2)[0] == 0
    folder = root / step_dirname(4)
    rolled = f"rolled-back-{four.save_id}.json"
    assert (folder / rolled).exists()
    (part,) = four.parts
    doc = jsonio.loads((folder / part).read_bytes(), part)
    edit(doc)
    _rewrite_file(folder, rolled, part, sealed_bytes(doc, "part_sha256", compact=True))
    rc, out = cli(capsys, "verify", root, "--id", four.save_id)
    assert rc == 1 and "CORRUPT" in out, out
    rc, out = cli(capsys, "restore", root, "--id", four.save_id)
    assert rc != 0 and step_dirname(4) in out, out  # the part, or the folder as a whole
    store = CheckpointStore(str(root))
    assert store.committed_steps() == [2]
    assert [e.status for e in store.life.entries(4)] == [ROLLED_BACK]
    assert ckpt.load_latest(_blank(), str(root)).step == 2


def test_a_resume_refuses_a_version_whose_attachment_is_damaged(tmp_path, capsys):
    """A flipped byte in an attachment (no load reads it): the resume falls back to the
    version before, which verifies whole, instead of going on from one `ckpt verify`
    refuses for good."""
    root = str(tmp_path / "root")
    for step in (1, 2):
        ckpt.save(_state(step), root, step,
                  attachments={"hf_export.json": json.dumps({"step": step}).encode()})
    m = CheckpointStore(root).read_manifest(2)
    path = Path(root) / step_dirname(2) / m.attachments["hf_export.json"].file
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    fallbacks = []
    state = _blank()
    loaded = ckpt.load_latest(state, root, on_fallback=lambda s, why: fallbacks.append((s, why)))
    assert loaded is not None and loaded.step == 1
    assert [s for s, _ in fallbacks] == [2] and "hf_export.json" in fallbacks[0][1]
    assert state["note"] == "seed 1"
    rc, out = cli(capsys, "verify", root)
    assert rc == 1 and "step 1: ok" in out and "step 2: CORRUPT" in out, out


def _damaged_attachment_root(tmp_path) -> str:
    root = str(tmp_path / "root")
    ckpt.save(_state(2), root, 2, attachments={"hf_export.json": b'{"step": 2}'})
    m = CheckpointStore(root).read_manifest(2)
    path = Path(root) / step_dirname(2) / m.attachments["hf_export.json"].file
    data = bytearray(path.read_bytes())
    data[0] ^= 0x01
    path.write_bytes(bytes(data))
    return root


def _load_step_2(rank: int, world_size: int, root: str) -> str:
    state = _blank()
    try:
        ckpt.load(state, root, 2)
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
        assert torch.equal(state["w"], torch.zeros(6, 4)) and state["note"] == ""
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_a_load_of_a_chosen_step_refuses_a_damaged_attachment(tmp_path):
    """A step chosen by name (``ckpt.load``, a manager's ``load_latest(step=...)``, the
    trainer's ``checkpoint.load_step``) is taken only whole, as the walk takes one: a damaged
    attachment refuses it on every rank, naming the file, nothing loaded; ``verify='none'``
    opts out as for the data."""
    from ckpt.job import CheckpointManager, ManagerOptions
    from tests.dist import run_ranks

    root = _damaged_attachment_root(tmp_path)
    for out in run_ranks(_load_step_2, 2, root, timeout=120):
        assert out.startswith("CorruptCheckpointError") and "hf_export.json" in out, out
    with pytest.raises(CorruptCheckpointError, match="hf_export.json"):
        with CheckpointManager(root, ManagerOptions(use_lease=False)) as manager:
            manager.load_latest(_blank(), step=2)
    state = _blank()
    ckpt.load(state, root, 2, verify="none")
    assert state["note"] == "seed 2"


_CHILD = textwrap.dedent("""
    import json, resource, sys
    from ckpt.cli import main
    from ckpt.root import CheckpointStore

    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    root, step, good = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    main(["verify", root, "--step", str(good)])  # warm: the imports, one verify
    before = peak()
    codes = [main(["verify", root, "--step", str(step)]),
             main(["list", root, "--check", "full", "--json"])]
    try:
        CheckpointStore(root).verify(step)
        error = ""
    except Exception as exc:
        error = str(exc)
    import ckpt, torch
    state = {"w": torch.zeros(6, 4), "b": torch.zeros(4), "note": ""}
    loaded = ckpt.load_latest(state, root).step  # falls back, no MemoryError
    print(json.dumps({"grew": peak() - before, "codes": codes, "error": error,
                      "loaded": loaded}))
""")


def _run_child(root: Path, step: int, good: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(root), str(step), str(good)],
                         capture_output=True, text=True, timeout=180,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


SPARSE_BYTES = 3 << 29  # 1.5 GiB, costing no disk


def test_a_part_replaced_by_a_large_sparse_file_is_refused_unread(tmp_path):
    root = tmp_path / "root"
    save_chunked(str(root), 1, _state(1), CHUNKS)
    manifest = save_chunked(str(root), 2, _state(2), CHUNKS)
    (part,) = manifest.parts
    with open(root / step_dirname(2) / part, "r+b") as f:
        f.truncate(SPARSE_BYTES)
    got = _run_child(root, 2, 1)
    assert got["codes"] == [1, 1] and part in got["error"] and got["loaded"] == 1, got
    assert got["grew"] < 128 << 20, got  # not the 1.5 GiB the file holds


def test_a_manifest_replaced_by_a_large_sparse_file_is_refused_unread(tmp_path):
    root = tmp_path / "root"
    for step in (1, 2):
        ckpt.save(_state(step), str(root), step)
    with open(root / step_dirname(2) / MANIFEST_NAME, "r+b") as f:
        f.truncate(SPARSE_BYTES)
    got = _run_child(root, 2, 1)
    assert got["codes"] == [1, 1] and MANIFEST_NAME in got["error"] and got["loaded"] == 1, got
    assert "more than the" in got["error"], got
    assert got["grew"] < 128 << 20, got
