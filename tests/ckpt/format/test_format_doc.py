"""docs/format.md names every file the store writes and every field of its JSON records.

A root is built by the real code paths (saves with an attachment, a rollback, an attempt
left incomplete, a save with sharded chunks (its part), one node's share (a span), pins,
the failure history, the retention record, the lease and its fence files, a copy of a
version in a ``peer-{NODE}/`` root inside it, as a two-tier job's local root holds); then
every file under it must match a name the spec lists, and every member of the lease, the
fence files, the attempt marker, the manifest, a part and a span must be named in the
spec's section for that record.
A new file or field that the spec does not describe fails here.
"""

from __future__ import annotations

import json
import os
import re

import torch

import ckpt
from ckpt.cadence import FailureHistory, write_history
from ckpt.format import Span
from ckpt.job import KeepBest, set_pinned
from ckpt.job.retention import record_retention
from ckpt.root import CheckpointStore, acquire_lease, release_lease
from ckpt.storage import Storage
from tests.ckpt._parts import save_chunked

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
with open(os.path.join(REPO, "docs", "format.md"), encoding="utf-8") as _f:
    SPEC = _f.read()

_ID = r"[0-9a-f]{6,64}"
# (how the spec's tables spell a name, what the code writes under that name)
NAMES = [
    ("`step_NNNNNNNNN/`", r"step_\d{9,}/"),
    ("`_lease.json`", r"_lease\.json"),
    ("`_fence/gen_GGGGGGGGG.open`, `.closing`, `.json`", r"_fence/gen_\d{9,}\.(open|closing|json)"),
    ("`pins.json`", r"pins\.json"),
    ("`_history.json`", r"_history\.json"),
    ("`_retention.json`", r"_retention\.json"),
    ("`r{RANK:05d}_{ID}_{K}.bin`", rf"step_\d{{9,}}/r\d{{5}}_{_ID}_\d+\.bin"),
    ("`part-r{RANK:05d}_{ID}.json`", rf"step_\d{{9,}}/part-r\d{{5}}_{_ID}\.json"),
    ("`a_{ID}_{NAME}`", rf"step_\d{{9,}}/a_{_ID}_[A-Za-z0-9][A-Za-z0-9._-]*"),
    ("`pending-{ID}.json`", rf"step_\d{{9,}}/pending-{_ID}\.json"),
    ("`manifest.json`", r"step_\d{9,}/manifest\.json"),
    ("`rolled-back-{ID}.json`", rf"step_\d{{9,}}/rolled-back-{_ID}\.json"),
    ("`fenced-{ID}.json`", rf"step_\d{{9,}}/fenced-{_ID}\.json"),
    ("`damaged-manifest-{HEX}.json`", r"step_\d{9,}/damaged-manifest-[0-9a-f]+\.json"),
    ("`NAME.tmp-{HEX}`", r".*\.tmp-[0-9a-f]+"),
    ("`_lease.json.swap-lock/`", r"_lease\.json\.swap-lock/"),
    ("`peer-{NODE}/`", r"peer-\d+/"),
]


def _section(title: str) -> str:
    """The text of the spec's section ``title`` (up to the next heading of any level)."""
    m = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#+ |\Z)", SPEC, re.M | re.S)
    assert m, f"docs/format.md has no section {title!r}"
    return m.group(1)


def _root(tmp_path) -> str:
    root = str(tmp_path / "root")
    state = {"w": torch.arange(6.0).reshape(2, 3), "n": 1}
    ckpt.save(state, root, 1, attachments={"config.json": b"{}"})
    ckpt.save(state, root, 2)
    storage = Storage(root)
    life = acquire_lease(storage, ttl_seconds=30, job_name="spec")
    try:
        life.uncommit(2)
        life.begin(3, "abcdef123456")  # an attempt that never commits
    finally:
        release_lease(life)
    save_chunked(storage, 4, {"w": torch.arange(6.0)}, {"w": [([0], [2]), ([2], [4])]})
    # One node's share of a job-wide checkpoint (a local tier's version on several nodes).
    save_chunked(storage, 5, {"w": torch.arange(6.0)}, {"w": [([2], [4])]},
                 span=Span(node=0, nodes=2, ranks=(0,), world_size=1))
    store = CheckpointStore(storage)
    set_pinned(store, 1)
    write_history(storage, FailureHistory())
    record_retention(store, [KeepBest(store, "loss", k=2)])
    _copy(storage, 1, Storage(f"{root}/peer-0"))
    return root


def _copy(source: Storage, step: int, into: Storage) -> None:
    """Copy committed ``step`` of ``source`` into ``into`` as the two-tier job does."""
    manifest = CheckpointStore(source).read_manifest(step)
    into.makedirs("")
    life = acquire_lease(into, ttl_seconds=30, job_name="spec")
    try:
        life.begin(step, manifest.save_id)
        for name in manifest.files:
            rel = f"step_{step:09d}/{name}"
            into.write_bytes(rel, source.read_bytes(rel))
        life.commit_copy(manifest, source.url)
    finally:
        release_lease(life)


def _files(root: str) -> list[str]:
    out = []
    for folder, dirs, files in os.walk(root):
        rel = os.path.relpath(folder, root)
        out += [("" if rel == "." else rel + "/") + name for name in files]
        out += [("" if rel == "." else rel + "/") + name + "/" for name in dirs]
    return sorted(out)


def test_every_file_of_a_root_is_a_name_the_spec_lists(tmp_path):
    for spelled, _ in NAMES:
        assert f"\n| {spelled} |" in SPEC, f"docs/format.md's tables no longer list {spelled}"
    patterns = [re.compile(p) for _, p in NAMES] + [re.compile(r"_fence/")]
    patterns += [re.compile(r"peer-\d+/" + p.pattern) for p in patterns]  # a root of its own
    files = _files(_root(tmp_path))
    assert any(f.startswith("peer-0/step_") for f in files)
    assert any(f.endswith(".bin") for f in files) and any("/a_" in f for f in files)
    assert any("/part-" in f for f in files)
    for f in files:
        assert any(p.fullmatch(f) for p in patterns), \
            f"{f} is written by ckpt but docs/format.md does not list its name"


def _documented(keys, text: str, what: str) -> None:
    for key in keys:
        assert f'"{key}"' in text or f"`{key}`" in text, \
            f"docs/format.md does not name the member {key!r} of {what}"


def test_every_member_of_the_roots_records_is_in_the_spec(tmp_path):
    root = _root(tmp_path)

    def doc(rel):
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            return json.load(f)

    _documented(doc("_lease.json"), _section("Lease"), "the lease")
    fence = _section("Fencing")
    names = os.listdir(os.path.join(root, "_fence"))
    assert {n.rsplit(".", 1)[1] for n in names} == {"open", "closing", "json"}
    for name in names:
        _documented(doc(f"_fence/{name}"), fence, f"_fence/{name}")
    folder = _section("A checkpoint folder")
    (marker,) = [n for n in os.listdir(os.path.join(root, "step_000000003"))
                 if n.startswith("pending-")]
    _documented(doc(f"step_000000003/{marker}"), folder, "an attempt marker")
    table = _section("manifest.json")
    manifest = doc("step_000000001/manifest.json")
    _documented(manifest, table, "the manifest")
    writer_row = next(line for line in table.splitlines() if line.startswith("| `writer`"))
    _documented(manifest["writer"], writer_row, "the manifest's writer")
    copied = doc("peer-0/step_000000001/manifest.json")["writer"]
    _documented(copied, writer_row, "a copy's writer")
    _documented(copied["copied_from"], writer_row + _section("Copies"),
                "a copy's original writer")
    pins = doc("pins.json")
    _documented(pins, SPEC, "pins.json")
    retention = doc("_retention.json")
    _documented(retention, SPEC, "_retention.json")
    _documented(retention["best"][0], SPEC, "_retention.json's policies")
    (part,) = [n for n in os.listdir(os.path.join(root, "step_000000004"))
               if n.startswith("part-")]
    _documented(doc(f"step_000000004/{part}"), _section("Parts"), "a part")
    _documented(doc("step_000000004/manifest.json")["tensors"]["w"], table,
                "the manifest's tensors")
    share = doc("step_000000005/manifest.json")
    _documented(share, table, "a share's manifest")
    _documented(share["span"], _section("Span"), "the manifest's span")


def test_the_spec_lists_exactly_the_dtypes_the_code_accepts():
    from ckpt.format import DTYPE_NAMES
    from ckpt.format._schema import FORMAT_DTYPE_NAMES

    m = re.search(r"^`dtype` is one of `([^`]*)`", SPEC, re.M)
    assert m, "docs/format.md no longer says which dtypes a manifest may hold"
    listed = m.group(1).split()
    assert len(listed) == len(set(listed))
    assert set(listed) == set(FORMAT_DTYPE_NAMES) == set(DTYPE_NAMES)
