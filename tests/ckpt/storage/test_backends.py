"""Which backend serves which root, and that each one is the whole interface.

What the backends do is checked by the conformance suite (test_storage_conformance.py), run
on every one of them; this file checks the choice between them."""

from __future__ import annotations

import pickle

import pytest

from ckpt.storage import RetryPolicy, Storage
from ckpt.storage._base import Backend, FsspecBackend
from ckpt.storage._local import LocalBackend
from ckpt.storage._s3 import S3Backend
from ckpt.storage._storage import open_backend


@pytest.mark.parametrize("url, cls", [
    ("{tmp}/root", LocalBackend), ("file://{tmp}/root", LocalBackend),
    ("memory://backends-test/root", FsspecBackend),
    ("s3://some-bucket/prefix", S3Backend), ("s3a://some-bucket/prefix", S3Backend)])
def test_each_root_gets_its_backend(tmp_path, url, cls):
    storage = Storage(url.format(tmp=tmp_path), {"anon": True} if "s3" in url else None)
    backend = storage.backend
    assert type(backend) is cls and isinstance(backend, Backend)
    local, s3 = cls is LocalBackend, cls is S3Backend
    assert (storage.local_path("a/b") is not None) == local
    if local:
        assert storage.local_path("a/b") == storage.path("a/b") == str(tmp_path / "root/a/b")
    assert (storage.has_folders, storage.default_threads) == ((False, 16) if s3 else (True, 4))
    assert storage.preferred_file_bytes == (32 << 20 if s3 else None)
    assert storage.fs is backend.fs and storage.root == backend.root
    assert backend.retry is storage.retry  # the backend's own retries count in the policy
    clone = pickle.loads(pickle.dumps(storage))
    assert type(clone.backend) is cls and clone.path("a/b") == storage.path("a/b")


def test_every_backend_implements_every_primitive():
    for cls in (LocalBackend, S3Backend, FsspecBackend):
        assert not cls.__abstractmethods__, cls
    assert Backend.__abstractmethods__ == {
        "exists", "size", "read", "listdir", "makedirs", "write", "create_exclusive",
        "replace_if_unchanged", "delete", "rmdir"}


def test_open_backend_names_a_root_it_cannot_open():
    with pytest.raises(ValueError, match="cannot open checkpoint root 'nosuchproto://x'"):
        open_backend("nosuchproto://x", {}, RetryPolicy())
    with pytest.raises(ValueError, match="names no bucket"):
        open_backend("s3://", {}, RetryPolicy())


def test_nothing_outside_the_storage_package_knows_a_backend():
    """Callers ask the Storage what a root can do (``local_path``, ``has_folders``,
    ``default_threads``, ``preferred_file_bytes``, ``Storage.location``), never which backend
    it is on: no backend class, no ``is_local``/``is_s3``/``protocol``, no URL scheme spelt."""
    import ast
    from pathlib import Path

    import ckpt

    repo = Path(ckpt.__file__).resolve().parents[1]
    prefixes = {"s3", "s3a", "file", "memory"}  # as the start of a URL
    backends = {"LocalBackend", "S3Backend", "FsspecBackend", "open_backend"}
    found = []
    for pkg in ("ckpt", "trainer", "monitoring"):
        for path in sorted((repo / pkg).rglob("*.py")):
            if path.is_relative_to(repo / "ckpt" / "storage"):
                continue
            where = path.relative_to(repo)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in (
                        {"is_local", "is_s3", "protocol"} | backends):
                    found.append(f"{where}:{node.lineno}: .{node.attr}")
                elif isinstance(node, ast.alias) and node.name in backends:
                    found.append(f"{where}:{node.lineno}: imports {node.name}")
                elif isinstance(node, ast.Compare):
                    for side in (node.left, *node.comparators):
                        if isinstance(side, ast.Constant) and "://" in str(side.value):
                            found.append(f"{where}:{node.lineno}: compares with {side.value!r}")
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr in ("startswith", "endswith", "partition", "split"):
                    for arg in node.args:
                        if isinstance(arg, ast.Constant) and ("://" in str(arg.value) or (
                                node.func.attr == "startswith" and arg.value in prefixes)):
                            found.append(f"{where}:{node.lineno}: {node.func.attr}"
                                         f"({arg.value!r})")
    assert not found, "\n".join(found)
