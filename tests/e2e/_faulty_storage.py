"""``python -m trainer`` whose checkpoint storage fails in one chosen way from one step on.

Run it like the trainer with the same arguments, plus one of:

* ``E2E_FAIL_FROM_STEP=N``: every data-file write of a checkpoint at step N or later fails
  with a permission error (storage that became unwritable: no retry helps);
* ``E2E_STEAL_LEASE_AT_STEP=N``: when the first save of step N or later starts, another
  job (a live record from another host) takes the root's write lease over, as ``--force``
  would.
* ``E2E_STEAL_LEASE_WHEN=PATH``: the same takeover, at the first save that starts after
  ``PATH`` exists (the test decides when).

and any of these, which combine with the above and with each other:

* ``E2E_TRANSIENT_FAILS=N``: the first N attempts of every data-file write of a checkpoint
  fail with a dropped connection (``ECONNRESET``, transient: the storage retry policy
  retries it, each retry counted);
* ``E2E_DELETE_FAILS=1``: deleting a checkpoint folder fails with a permission error
  (retention cannot free space);
* ``E2E_STAGE_DELAY_SECONDS=S``: every staging copy takes S seconds longer (host memory
  under pressure: the training stall per save);
* ``E2E_CRASH_AFTER_SECONDS=S``: S seconds after the metrics endpoint starts, the process
  dies (exit 1): under ``torchrun --max-restarts`` a worker in a restart loop.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time

from ckpt.format import data_file_id, marker_name, parse_step_dirname
from ckpt.root.lease import LEASE_NAME
from ckpt.storage import Storage

_FAIL_FROM = int(os.environ.get("E2E_FAIL_FROM_STEP", "-1"))
_STEAL_AT = int(os.environ.get("E2E_STEAL_LEASE_AT_STEP", "-1"))
_write_buffers = Storage.write_buffers
_STOLEN: list[int] = []
_STEAL_WHEN = os.environ.get("E2E_STEAL_LEASE_WHEN", "")
_TRANSIENT = int(os.environ.get("E2E_TRANSIENT_FAILS", "0"))
_DELETE_FAILS = os.environ.get("E2E_DELETE_FAILS", "") == "1"
_STAGE_DELAY = float(os.environ.get("E2E_STAGE_DELAY_SECONDS", "0"))
_CRASH_AFTER = float(os.environ.get("E2E_CRASH_AFTER_SECONDS", "0"))
_attempts: dict[str, int] = {}


def _faulty_write_buffers(self, rel, buffers, **kwargs):
    parts = rel.split("/")
    step = parse_step_dirname(parts[0]) if len(parts) == 2 else None
    name = parts[-1]
    if step is not None and 0 <= _FAIL_FROM <= step and data_file_id(name):
        raise PermissionError(errno.EACCES, f"injected: {rel} is not writable")
    steal = (0 <= _STEAL_AT <= (step if step is not None else -1)) or \
        (bool(_STEAL_WHEN) and step is not None and os.path.exists(_STEAL_WHEN))
    if step is not None and steal and not _STOLEN and name.startswith(marker_name("")[:8]):
        _STOLEN.append(step)  # the first save at or after that step (one may be skipped)
        now = time.time()
        _write_buffers(self, LEASE_NAME, [json.dumps({
            "holder": "intruder0000000", "job": "intruder", "host": "another-host",
            "pid": 1, "heartbeat_unix": now + 3600, "acquired_unix": now,
            "ttl_seconds": 3600, "generation": 999}).encode()])
    return _write_buffers(self, rel, buffers, **kwargs)


Storage.write_buffers = _faulty_write_buffers

if _TRANSIENT > 0:
    from ckpt.storage._local import LocalBackend

    _write_and_rename = LocalBackend._write_and_rename

    def _flaky_write_and_rename(self, rel, views, durable):
        parts = rel.split("/")
        if len(parts) == 2 and parse_step_dirname(parts[0]) is not None \
                and data_file_id(parts[1]):
            n = _attempts[rel] = _attempts.get(rel, 0) + 1
            if n <= _TRANSIENT:
                raise ConnectionResetError(errno.ECONNRESET, f"injected: {rel} connection reset")
        return _write_and_rename(self, rel, views, durable)

    LocalBackend._write_and_rename = _flaky_write_and_rename

if _DELETE_FAILS:
    from ckpt.root import Lifecycle

    def _faulty_delete(self, step):
        raise PermissionError(errno.EACCES, f"injected: checkpoint {step} cannot be deleted")

    Lifecycle.delete = _faulty_delete  # retention deletes through the root's life-cycle

if _STAGE_DELAY > 0:
    from ckpt.dcp import StagingBuffers

    _stage = StagingBuffers.stage

    def _slow_stage(self, state_dict):
        time.sleep(_STAGE_DELAY)
        return _stage(self, state_dict)

    StagingBuffers.stage = _slow_stage

if _CRASH_AFTER > 0:
    import threading

    from monitoring.metrics import Metrics

    _serve = Metrics.serve

    def _serve_then_crash(self, port, *args, **kwargs):
        out = _serve(self, port, *args, **kwargs)

        def crash():
            time.sleep(_CRASH_AFTER)
            sys.stderr.write("injected: worker crash\n")
            sys.stderr.flush()
            os._exit(1)
        threading.Thread(target=crash, daemon=True).start()
        return out

    Metrics.serve = _serve_then_crash

if __name__ == "__main__":
    from trainer.__main__ import main

    sys.exit(main())
