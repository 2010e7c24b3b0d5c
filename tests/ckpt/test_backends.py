"""Which backend serves which root, and that each one is the whole interface.

What the backends do is checked by the conformance suite (test_storage_conformance.py), run
on every one of them; this file checks the choice between them."""

from __future__ import annotations

import pickle

import pytest

from ckpt.storage import (
    Backend,
    FsspecBackend,
    LocalBackend,
    RetryPolicy,
    S3Backend,
    Storage,
    open_backend,
)


@pytest.mark.parametrize("url, cls", [
    ("{tmp}/root", LocalBackend), ("file://{tmp}/root", LocalBackend),
    ("memory://backends-test/root", FsspecBackend),
    ("s3://some-bucket/prefix", S3Backend), ("s3a://some-bucket/prefix", S3Backend)])
def test_each_root_gets_its_backend(tmp_path, url, cls):
    storage = Storage(url.format(tmp=tmp_path), {"anon": True} if "s3" in url else None)
    backend = storage.backend
    assert type(backend) is cls and isinstance(backend, Backend)
    assert (storage.is_local, storage.is_s3) == (cls is LocalBackend, cls is S3Backend)
    assert storage.fs is backend.fs and storage.root == backend.root
    assert backend.retry is storage.retry  # the backend's own retries count in the policy
    clone = pickle.loads(pickle.dumps(storage))
    assert type(clone.backend) is cls and clone.path("a/b") == storage.path("a/b")


def test_every_backend_implements_every_primitive():
    for cls in (LocalBackend, S3Backend, FsspecBackend):
        assert not cls.__abstractmethods__, cls
    assert Backend.__abstractmethods__ == {
        "exists", "size", "read", "listdir", "makedirs", "write", "create_exclusive",
        "replace_if_unchanged", "delete"}


def test_open_backend_names_a_root_it_cannot_open():
    with pytest.raises(ValueError, match="cannot open checkpoint root 'nosuchproto://x'"):
        open_backend("nosuchproto://x", {}, RetryPolicy())
    with pytest.raises(ValueError, match="names no bucket"):
        open_backend("s3://", {}, RetryPolicy())
