"""Counting the storage requests of a save: a counting ``Storage`` and an S3 request log.

:class:`CountingStorage` is a real :class:`ckpt.storage.Storage` (every call reaches the
backend) that counts each call by kind: ``read``, ``list``, ``exists``, ``size``, ``write``,
``create`` (exclusive create), ``swap`` (compare-and-swap), ``delete`` (a bulk delete: one
per file, or per 1,000 on S3), ``mkdir`` and ``rmdir`` (where folders exist);
writes and single deletes of data files (``r<rank>_<id>_<k>.bin``) count apart, as ``data``
and ``data_delete``, since their number follows the bytes, not the save. One call is one request on a local root; on S3 some calls
are two HTTP requests (a swap is GET + PUT, s3fs's whole-object read may ask the size
first, a miss may list), which :class:`S3RequestLog` counts at the HTTP level (botocore's
``before-send`` event on every client the backend uses). Used by ``bench/bench_requests.py``
and by ``tests/ckpt/job/test_commit_requests.py``.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from ckpt.format._schema import is_data_file
from ckpt.storage import Storage

__all__ = ["CountingStorage", "S3RequestLog", "KINDS", "DATA_KINDS"]

KINDS = ("read", "list", "exists", "size", "write", "create", "swap", "delete", "mkdir",
         "rmdir", "data", "data_delete")
DATA_KINDS = ("data", "data_delete")


def _is_data(path: str) -> bool:
    return is_data_file(path.rsplit("/", 1)[-1])


class CountingStorage(Storage):
    """A ``Storage`` that counts its calls (see the module docstring): ``counts`` by kind,
    ``log`` as ``(kind, path)`` in call order. ``snapshot()`` and ``since(snapshot)`` give
    the counts of a span of calls."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, **kwargs: Any):
        super().__init__(url, storage_options, **kwargs)
        self._count_lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.log: list[tuple[str, str]] = []

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_count_lock", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._count_lock = threading.Lock()

    def _count(self, kind: str, rel: str) -> None:
        with self._count_lock:
            self.counts[kind] += 1
            self.log.append((kind, rel))

    def snapshot(self) -> tuple[Counter[str], int]:
        with self._count_lock:
            return Counter(self.counts), len(self.log)

    def since(self, snapshot: tuple[Counter[str], int]) -> tuple[Counter[str], list]:
        """Counts by kind and the log of the calls made after ``snapshot``."""
        with self._count_lock:
            counts = Counter(self.counts)
            counts.subtract(snapshot[0])
            return +counts, self.log[snapshot[1]:]

    def exists(self, rel):
        self._count("exists", rel)
        return super().exists(rel)

    def size(self, rel):
        self._count("size", rel)
        return super().size(rel)

    def read_bytes(self, rel, start=None, end=None, **kwargs):
        self._count("read", rel)
        return super().read_bytes(rel, start, end, **kwargs)

    def listdir(self, rel=""):
        self._count("list", rel)
        return super().listdir(rel)

    def makedirs(self, rel):
        if self.has_folders:  # S3 makes none: no request
            self._count("mkdir", rel)
        return super().makedirs(rel)

    def write_buffers(self, rel, buffers, **kwargs):
        self._count("data" if _is_data(rel) else "write", rel)
        return super().write_buffers(rel, buffers, **kwargs)

    def create_exclusive(self, rel, data):
        self._count("create", rel)
        return super().create_exclusive(rel, data)

    def replace_if_unchanged(self, rel, data, expected):
        self._count("swap", rel)
        return super().replace_if_unchanged(rel, data, expected)

    def delete(self, rel, recursive=False):
        self._count("data_delete" if _is_data(rel) else "delete", rel)
        return super().delete(rel, recursive=recursive)

    def delete_many(self, rels):
        # A bulk delete (S3) is one request per 1,000 files; elsewhere Storage calls
        # delete() for each file, counted there.
        rels = list(rels)
        if self.backend.bulk_delete:
            for rel in rels[::1000]:
                self._count("delete", rel)
        return super().delete_many(rels)

    def remove_empty_folder(self, rel):
        # Storage's own listing inside is counted by listdir; the removal here.
        if self.has_folders:
            self._count("rmdir", rel)
        return super().remove_empty_folder(rel)


class S3RequestLog:
    """Every HTTP request the S3 backend of ``storage`` sends, as ``(method, key)``.

    Hooks botocore's ``before-send`` event on s3fs's client (reads, listings, deletes) and
    on the backend's blocking client (writes). Same process only."""

    def __init__(self, storage: Storage):
        import fsspec.asyn

        from ckpt.storage._s3 import write_client

        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        fs = storage.fs
        fsspec.asyn.sync(fs.loop, fs.set_session)
        for client in (fs.s3, write_client(fs)):
            client.meta.events.register("before-send.s3", self._seen)

    def _seen(self, request, **_: Any) -> None:
        with self._lock:
            self.requests.append((request.method, request.url.split("?", 1)[0]))

    def __len__(self) -> int:
        return len(self.requests)

    def since(self, start: int) -> Counter[str]:
        """Requests by HTTP method after the first ``start`` ones; writes of data files
        (``PUT``, multipart parts included) apart, as ``data``."""
        with self._lock:
            return Counter("data" if m == "PUT" and _is_data(url) else m
                           for m, url in self.requests[start:])
