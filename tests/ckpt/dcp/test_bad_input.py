"""Bad input: unreachable or misconfigured storage, and broken, hostile or mismatched checkpoints.

Every failure must be a clear error naming what is wrong and where, must not hang, must not
run code from the checkpoint, and must leave every file of the root exactly as it was.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.format import MANIFEST_NAME, crc32c_of, step_dirname
from ckpt.format._check import manifest_bytes
from ckpt.storage import Storage
from ckpt.root import LINEAGE_NAME
from tests.conftest import make_s3_options
from tests.dist import free_port

STEP = 3


# -- storage that cannot be used --------------------------------------------------------------
def test_unreachable_endpoint_fails_fast_with_a_clear_error():
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    url = "s3://some-bucket/run1"
    opts = make_s3_options(endpoint)
    start = time.monotonic()
    with pytest.raises(ckpt.StorageUnavailableError) as info:
        ckpt.CheckpointStore(url, opts).list()
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert url in message and endpoint in message and "Check the endpoint" in message
    assert elapsed < 15, f"took {elapsed:.1f}s"  # default policy: 5 tries, <= 3 s of backoff

    storage = Storage(url, opts, retry=ckpt.storage.RetryPolicy(attempts=2, base_seconds=0.01))
    with pytest.raises(ckpt.StorageUnavailableError, match="run1/x.bin"):
        storage.write_bytes("x.bin", b"data")
    assert storage.retry.num_retries == 1
    with pytest.raises(ckpt.StorageUnavailableError, match="some-bucket/run1"):
        ckpt.save({"x": {"w": torch.zeros(2)}}, storage, STEP)
    with pytest.raises(ckpt.StorageUnavailableError):
        ckpt.load_latest({"x": {"w": torch.zeros(2)}}, storage)


def test_bad_credentials_are_named(s3_server, s3_root):
    # moto's server checks credentials when its IAM mode is on (enforce_auth); outside that
    # mode it accepts any key.
    with s3_server.enforce_auth() as (good_key, good_secret):
        good = Storage(s3_root.url, make_s3_options(s3_server.endpoint_url, good_key,
                                                    good_secret))
        good.write_bytes("ok.bin", b"fine")
        for key, secret in [("AKIAIOSFODNN7EXAMPLE", "wrong"), (good_key, "wrong-secret")]:
            bad = Storage(s3_root.url, make_s3_options(s3_server.endpoint_url, key, secret))
            for action in (lambda: bad.read_bytes("ok.bin"), lambda: bad.listdir(""),
                           lambda: bad.write_bytes("new.bin", b"x")):
                with pytest.raises(ckpt.StorageUnavailableError) as info:
                    action()
                assert s3_root.url in str(info.value)
                assert "credentials" in str(info.value)
            assert bad.retry.num_retries == 0  # a refusal is not retried
        # (Not good.listdir: moto's signature check rejects ListObjectsV2 even when signed
        # with valid keys, a moto limitation; GET/PUT/HEAD are checked correctly.)
        assert good.read_bytes("ok.bin") == b"fine"


def test_missing_bucket_is_named(s3_server):
    url = "s3://no-such-bucket-here/run1"
    storage = Storage(url, s3_server.storage_options)
    for action in (lambda: storage.listdir(""), lambda: storage.write_bytes("a", b"x"),
                   lambda: storage.exists("a"), lambda: ckpt.CheckpointStore(storage).list(),
                   lambda: ckpt.load_latest({"x": {"w": torch.zeros(1)}}, storage)):
        with pytest.raises(ckpt.StorageUnavailableError, match="bucket 'no-such-bucket-here' "
                                                               "does not exist"):
            action()
    assert storage.retry.num_retries == 0


@pytest.mark.parametrize("url", ["", "   ", None, "s3://"])
def test_empty_or_bucketless_url_is_a_value_error(url):
    with pytest.raises(ValueError, match="checkpoint root"):
        Storage(url)
    with pytest.raises(ValueError, match="checkpoint root"):
        ckpt.save({"x": {"w": torch.zeros(1)}}, url, 1)
    with pytest.raises(ValueError, match="checkpoint root"):
        ckpt.CheckpointStore(url)


# -- broken checkpoints -------------------------------------------------------------------------
def _state():
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(4, 3), "b": torch.randn(3),
                      "steps": torch.arange(5, dtype=torch.int64)},
            "extra": {"step": STEP, "name": "run"}}


def _blank():
    return {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3),
                      "steps": torch.zeros(5, dtype=torch.int64)},
            "extra": {"step": 0, "name": ""}}


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.fixture
def saved(tmp_path):
    """A committed checkpoint at STEP under tmp_path/root; returns (root, step dir, manifest)."""
    root = tmp_path / "root"
    manifest = ckpt.save(_state(), str(root), STEP)
    return root, root / step_dirname(STEP), manifest


def _rewrite_manifest(step_dir: Path, edit) -> None:
    """Edit the manifest as a hostile writer would: with a matching digest (the digest
    catches damage, not forgery)."""
    doc = json.loads((step_dir / MANIFEST_NAME).read_bytes())
    edit(doc)
    (step_dir / MANIFEST_NAME).write_bytes(manifest_bytes(doc))


def _location(manifest, fqn: str):
    return manifest.tensors[fqn]["chunks"][0]["location"]


def _expect_failure(root: Path, error, match: str, *, state=None, step=STEP,
                    fallback: bool = True, **kw):
    """``load`` fails with ``error`` matching ``match``; no file of the root changes."""
    before = _tree(root)
    with pytest.raises(error, match=match) as info:
        ckpt.load(state or _blank(), str(root), step, **kw)
    assert _tree(root) == before
    # The fallback path skips the (only) checkpoint without touching anything either.
    if fallback:
        assert ckpt.load_latest(_blank(), str(root)) is None
        assert _tree(root) == before
    return info.value


def test_missing_manifest(saved):
    root, step_dir, _ = saved
    err = _expect_failure(root, ckpt.CheckpointNotFoundError, step_dirname(7), step=7,
                          fallback=False)
    assert str(root) in str(err)
    (step_dir / MANIFEST_NAME).unlink()
    err = _expect_failure(root, ckpt.CheckpointNotFoundError, "manifest.json is absent")
    assert isinstance(err, FileNotFoundError)


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x00garbage", b"", b"[1, 2]"])
def test_manifest_not_json(saved, content):
    root, step_dir, _ = saved
    (step_dir / MANIFEST_NAME).write_bytes(content)
    err = _expect_failure(root, ckpt.CorruptCheckpointError, "manifest")
    assert err.path.endswith(f"{step_dirname(STEP)}/{MANIFEST_NAME}")


def test_manifest_of_another_format(saved):
    root, step_dir, _ = saved
    _rewrite_manifest(step_dir, lambda d: d.update(format="orbax"))
    _expect_failure(root, ckpt.CorruptCheckpointError, "written by another tool")
    _rewrite_manifest(step_dir, lambda d: d.pop("format"))
    _expect_failure(root, ckpt.CorruptCheckpointError, "not a ckpt manifest")


def test_future_format_version(saved):
    root, step_dir, _ = saved
    _rewrite_manifest(step_dir, lambda d: d.update(format_version=99))
    err = _expect_failure(root, ckpt.FormatVersionError, "upgrade ckpt")
    assert "99" in str(err)


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", ".hidden", "a/b.bin", "..", "x\x00y"])
def test_file_name_escaping_the_folder(saved, name, monkeypatch):
    root, step_dir, manifest = saved
    outside = root.parent / "x"
    outside.write_bytes(b"secret" * 100)
    loc = _location(manifest, "model.w")

    def edit(doc):
        rec = doc["files"].pop(loc.file)
        doc["files"][name] = rec
        for t in doc["tensors"].values():
            for c in t["chunks"]:
                if c["file"] == loc.file:
                    c["file"] = name
        for o in doc["objects"].values():
            if o["file"] == loc.file:
                o["file"] = name

    _rewrite_manifest(step_dir, edit)
    touched = []
    for method in ("read_bytes", "size", "exists"):
        original = getattr(Storage, method)

        def spy(self, rel, *args, _original=original, **kwargs):
            touched.append(rel)
            return _original(self, rel, *args, **kwargs)
        monkeypatch.setattr(Storage, method, spy)
    err = _expect_failure(root, ckpt.CorruptCheckpointError, "not a plain file name")
    assert repr(name) in str(err)
    # Only manifests (and the root's run log, which every resume reads) were read.
    assert all(rel.endswith(MANIFEST_NAME) or rel == LINEAGE_NAME for rel in touched), touched


def test_missing_data_file(saved):
    root, step_dir, manifest = saved
    name = _location(manifest, "model.w").file
    (step_dir / name).unlink()
    err = _expect_failure(root, ckpt.CorruptCheckpointError, f"{name} is missing")
    assert err.path.endswith(name)


def test_truncated_data_file(saved):
    root, step_dir, manifest = saved
    name = _location(manifest, "model.w").file
    data = (step_dir / name).read_bytes()
    (step_dir / name).write_bytes(data[:-5])
    err = _expect_failure(root, ckpt.CorruptCheckpointError, f"{name} is {len(data) - 5} bytes")
    assert (err.expected, err.actual) == (len(data), len(data) - 5)
    # Even without size checks the short read is caught.
    _expect_failure(root, ckpt.CorruptCheckpointError, "truncated", verify="none")


def test_flipped_byte_is_a_checksum_mismatch(saved):
    root, step_dir, manifest = saved
    loc = _location(manifest, "model.w")
    path = step_dir / loc.file
    data = bytearray(path.read_bytes())
    data[loc.offset + 7] ^= 0x10
    path.write_bytes(bytes(data))
    actual = crc32c_of([bytes(data[loc.offset:loc.offset + loc.length])])
    err = _expect_failure(root, ckpt.CorruptCheckpointError, "checksum mismatch")
    assert loc.file in str(err) and err.path.endswith(loc.file)
    assert err.expected == f"{loc.crc32c:08x}" and err.actual == f"{actual:08x}"
    assert f"expected crc32c {loc.crc32c:08x}, got {actual:08x}" in str(err)
    with pytest.raises(ckpt.CorruptCheckpointError, match="checksum mismatch"):
        ckpt.CheckpointStore(str(root)).verify(STEP)
    assert ckpt.CheckpointStore(str(root)).list(check="full")[0].status == "corrupt"


def test_state_mismatch_lists_every_problem(saved):
    root, _, _ = saved
    state = _blank()
    state["model"]["w"] = torch.zeros(4, 4)  # shape
    state["model"]["b"] = torch.zeros(3, dtype=torch.float64)  # dtype
    state["model"]["new"] = torch.zeros(2)  # not in the checkpoint
    del state["extra"]["name"]  # in the checkpoint, not in the state
    err = _expect_failure(root, ckpt.StateMismatchError, "does not match", state=state,
                          fallback=False)
    assert err.missing == ["model.new"]
    assert err.unexpected == ["extra.name"]
    assert len(err.mismatched) == 2
    text = str(err)
    for needle in ("model.new", "extra.name", "model.w", "[4, 3]", "[4, 4]", "model.b",
                   "float32", "float64", "strict=False"):
        assert needle in text, needle
    assert torch.equal(state["model"]["w"], torch.zeros(4, 4))  # nothing was loaded


# -- a checkpoint that tries to run code --------------------------------------------------------
class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # unpickling creates the marker file


@pytest.mark.parametrize("verify", ["full", "none"])
def test_pickle_payloads_are_never_unpickled(saved, tmp_path, verify):
    root, step_dir, manifest = saved
    marker = tmp_path / "PWNED"
    evil = pickle.dumps(_Payload(str(marker)))
    assert evil  # and loading `evil` with pickle would create the marker
    # A DCP-style metadata pickle next to the manifest, and a data file that is a pickle,
    # referenced (with a correct checksum: the attacker writes the manifest too) where the
    # object 'extra.step' is expected. Tensor bytes are reinterpreted, never unpickled.
    (step_dir / ".metadata").write_bytes(evil)
    (step_dir / "evil.bin").write_bytes(evil)
    crc = f"{crc32c_of([evil]):08x}"

    def edit(doc):
        doc["files"]["evil.bin"] = {"size": len(evil), "crc32c": crc, "rank": 0}
        doc["objects"]["extra.step"] = {"file": "evil.bin", "offset": 0,
                                        "length": len(evil), "crc32c": crc}

    _rewrite_manifest(step_dir, edit)
    err = _expect_failure(root, ckpt.CorruptCheckpointError, "'extra.step' is not a ckpt JSON",
                          verify=verify)
    assert "never unpickled" in str(err)
    assert not marker.exists()
    assert ckpt.CheckpointStore(str(root)).verify(STEP).step == STEP  # bytes match the manifest
    assert not marker.exists()


def test_stray_dcp_metadata_is_ignored(saved, tmp_path):
    root, step_dir, _ = saved
    marker = tmp_path / "PWNED"
    (step_dir / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    (step_dir / "__0_0.distcp").write_bytes(pickle.dumps(_Payload(str(marker))))
    state = _blank()
    ckpt.load(state, str(root), STEP)
    assert torch.equal(state["model"]["w"], _state()["model"]["w"])
    assert state["extra"] == {"step": STEP, "name": "run"}
    assert not marker.exists()
    assert os.path.exists(step_dir / ".metadata")  # left alone
