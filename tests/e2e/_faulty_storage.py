"""``python -m trainer`` whose checkpoint storage fails in one chosen way from one step on.

Run it like the trainer with the same arguments, plus one of:

* ``E2E_FAIL_FROM_STEP=N``: every data-file write of a checkpoint at step N or later fails
  with a permission error (storage that became unwritable: no retry helps);
* ``E2E_STEAL_LEASE_AT_STEP=N``: when the first save of step N or later starts, another
  job (a live record from another host) takes the root's write lease over, as ``--force``
  would.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time

from ckpt.commit import data_file_id, marker_name
from ckpt.lease import LEASE_NAME
from ckpt.manifest import parse_step_dirname
from ckpt.storage import Storage

_FAIL_FROM = int(os.environ.get("E2E_FAIL_FROM_STEP", "-1"))
_STEAL_AT = int(os.environ.get("E2E_STEAL_LEASE_AT_STEP", "-1"))
_write_buffers = Storage.write_buffers
_STOLEN: list[int] = []


def _faulty_write_buffers(self, rel, buffers, **kwargs):
    parts = rel.split("/")
    step = parse_step_dirname(parts[0]) if len(parts) == 2 else None
    name = parts[-1]
    if step is not None and 0 <= _FAIL_FROM <= step and data_file_id(name):
        raise PermissionError(errno.EACCES, f"injected: {rel} is not writable")
    if step is not None and 0 <= _STEAL_AT <= step and not _STOLEN and \
            name.startswith(marker_name("")[:8]):
        _STOLEN.append(step)  # the first save at or after that step (one may be skipped)
        now = time.time()
        _write_buffers(self, LEASE_NAME, [json.dumps({
            "holder": "intruder0000000", "job": "intruder", "host": "another-host",
            "pid": 1, "heartbeat_unix": now + 3600, "acquired_unix": now,
            "ttl_seconds": 3600, "generation": 999}).encode()])
    return _write_buffers(self, rel, buffers, **kwargs)


Storage.write_buffers = _faulty_write_buffers

if __name__ == "__main__":
    from trainer.__main__ import main

    sys.exit(main())
