"""Fault points inside a writer process, for tests/ckpt/job/test_writer_process.py.

A test puts this folder first on ``PYTHONPATH`` and names a point in ``CKPT_TEST_WRITER_AT``
before the manager starts (or restarts) its writer process: Python imports
``sitecustomize`` at start-up, so only processes started after that (the writer) take the
point; the test process itself started without it. At the point the writer stops itself
(``stop_*``: SIGSTOP, for the test to act while a save is in flight; continued, it goes
on) or dies (``kill_*``: SIGKILL), the first time it gets there:

- ``*_mid_write``: half-way through writing its first data file (half of it on disk);
- ``*_before_commit``: right before the manifest is created;
- ``kill_after_commit``: after the manifest exists, before the attempt's marker is removed;
- ``kill_at_rendezvous``: as it comes to a save's rendezvous, before it counts itself;
- ``kill_at_retention``: as retention is about to delete a committed step's manifest.

``CKPT_TEST_WRITER_STEP``: the storage points act at that step only (else at any).
"""

import os
import signal

_POINT = os.environ.get("CKPT_TEST_WRITER_AT", "")
_STEP = os.environ.get("CKPT_TEST_WRITER_STEP")


_done = []


def _act(kind: str) -> None:
    """Stop or die, the first time only (a stopped writer goes on when continued)."""
    if not _done:
        _done.append(kind)
        os.kill(os.getpid(), signal.SIGSTOP if kind == "stop" else signal.SIGKILL)


def _at_step(rel: str) -> bool:
    from ckpt.format import step_dirname

    return _STEP is None or rel.startswith(step_dirname(int(_STEP)) + "/")


if _POINT:
    from ckpt.storage import Storage

    _kind, _, _where = _POINT.partition("_")
    if _where == "at_rendezvous":
        from ckpt.job._writer_process import _Writer

        _group = _Writer._group

        def _group_or_die(self, seq):
            _act(_kind)
            return _group(self, seq)
        _Writer._group = _group_or_die
    elif _where == "mid_write":
        _write = Storage.write_buffers

        def write_buffers(self, rel, buffers, **kwargs):
            if rel.endswith(".bin") and not _done and _at_step(rel):
                data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
                _write(self, rel, [data[: len(data) // 2]], **kwargs)
                _act(_kind)
            return _write(self, rel, buffers, **kwargs)
        Storage.write_buffers = write_buffers
    elif _where == "before_commit":
        _create = Storage.create_exclusive

        def create_exclusive(self, rel, data):
            if rel.endswith("/manifest.json") and _at_step(rel):
                _act(_kind)
            return _create(self, rel, data)
        Storage.create_exclusive = create_exclusive
    elif _where == "after_commit":
        _delete = Storage.delete

        def delete(self, rel, recursive=False):
            if "/pending-" in rel and _at_step(rel):
                _act(_kind)
            return _delete(self, rel, recursive)
        Storage.delete = delete
    elif _where == "at_retention":
        _delete_manifest = Storage.delete

        def delete(self, rel, recursive=False):
            if rel.endswith("/manifest.json"):
                _act(_kind)
            return _delete_manifest(self, rel, recursive)
        Storage.delete = delete
    else:
        raise ValueError(f"unknown CKPT_TEST_WRITER_AT {_POINT!r}")
