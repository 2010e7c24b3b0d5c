"""A separate job for the lease tests: ``python -m tests.ckpt.root._mgr_lease_child ROOT TTL [OPTS]``.

Opens a CheckpointManager on ROOT (the lease with ``ttl_seconds=TTL``; OPTS is the
storage_options as JSON), commits step 1, then starts saving step 2 with data-file writes
that never finish, prints one line ``READY {"holder", "pid", "took_over"}`` and sleeps until
killed: a job that dies holding the lease with a save in flight. If the lease is held it
prints ``HELD <message as JSON>`` and exits with status 3.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def main() -> int:
    root, ttl = sys.argv[1], float(sys.argv[2])
    options = json.loads(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] else None
    import torch

    from ckpt.errors import LeaseHeldError
    from ckpt.job import CheckpointManager, ManagerOptions
    from tests.ckpt._mgr_util import FaultyStorage

    never = threading.Event()
    storage = FaultyStorage(root, options)
    try:
        mgr = CheckpointManager(storage, ManagerOptions(lease_ttl_seconds=ttl, job_name="child"),
                                retention=[])
    except LeaseHeldError as exc:
        print("HELD", json.dumps(str(exc)), flush=True)
        return 3
    state = {"w": torch.arange(6, dtype=torch.float32)}
    mgr.save(1, state, block=True)
    storage.block = never  # the next save's data files never finish writing
    storage.writing.clear()
    mgr.save(2, state)
    if not storage.writing.wait(60):
        print("FAILED to start the second save", flush=True)
        return 4
    print("READY", json.dumps({"holder": mgr.owner, "pid": os.getpid(),
                               "took_over": mgr.lease.took_over is not None}), flush=True)
    time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
