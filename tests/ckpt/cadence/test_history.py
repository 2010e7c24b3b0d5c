"""The job's failure history under the root feeds the auto cadence's MTBF estimate."""

from __future__ import annotations

import json
import time

import torch

from ckpt.cadence import HISTORY_NAME
from ckpt.cadence.policies import Auto
from ckpt.job import CheckpointManager


def _dead_lease(root):
    (root / "_lease.json").write_text(json.dumps({
        "holder": "dead", "job": "old", "host": "elsewhere", "pid": 1,
        "acquired_unix": time.time() - 3600, "heartbeat_unix": time.time() - 3600,
        "ttl_seconds": 60}))


def test_clean_starts_record_no_failure(tmp_path):
    for _ in range(2):
        mgr = CheckpointManager(str(tmp_path), cadence=Auto(mtbf_seconds=3600.0))
        assert mgr.history.num_failures == 0
        mgr.close()
    assert json.loads((tmp_path / HISTORY_NAME).read_text())["failure_times"] == []


def test_a_start_after_a_dead_job_records_a_failure_and_shortens_mtbf(tmp_path):
    state = {"w": torch.zeros(4)}
    mgr = CheckpointManager(str(tmp_path), cadence=Auto(mtbf_seconds=3600.0))
    for step in range(1, 4):
        mgr.maybe_save(step, state)
        time.sleep(0.01)
    mgr.save(3, state, block=True, force=True)
    uptime = mgr.history.uptime_seconds
    assert uptime > 0
    mgr.close()
    _dead_lease(tmp_path)                       # the next start finds a dead holder
    auto = Auto(mtbf_seconds=3600.0)
    mgr = CheckpointManager(str(tmp_path), cadence=auto)
    assert mgr.history.num_failures == 1
    assert auto.history is mgr.history          # one history per job, shared with cadence
    assert auto.history.mtbf(3600.0) < 3600.0   # (1 * 3600 + uptime) / (1 + 1)
    assert mgr.events.of_kind("failure_recorded")
    mgr.close()
    saved = json.loads((tmp_path / HISTORY_NAME).read_text())
    assert len(saved["failure_times"]) == 1 and saved["uptime_seconds"] >= uptime
