"""A library user's own loop with ``CheckpointManager``, one process: what a resume settles.

A damaged newest checkpoint is un-committed after the fall-back, so the run saves that step
again and the next resume does not fall back again (as the trainer does: one definition, in
the manager); a forced save that cannot save raises; a manager without a cadence says that
``maybe_save`` never saves; ``latest_step``/``all_steps``.
"""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
import torch

from ckpt import CheckpointManager, CheckpointStore, EventBus, ManagerOptions, ModelState, RNGState
from ckpt.cli import main as cli_main
from ckpt.errors import LeaseLostError
from ckpt.root.lease import LEASE_NAME
from tests.ckpt._helpers import flip_byte
from tests.ckpt._mgr_util import wait_for

pytestmark = pytest.mark.timeout(120)


def _own_loop(root: str, steps: int = 20, events: EventBus | None = None) -> dict:
    """The README's loop, ``cadence="5"``; returns what it saw."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"app": ModelState(model, optim), "rng": RNGState(), "progress": {"step": 0}}
    bus = events or EventBus()
    with CheckpointManager(root, busy="wait", cadence="5", events=bus) as mgr:
        resumed = mgr.load_latest(state)
        start = resumed.step if resumed else 0
        for step in range(start + 1, steps + 1):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            state["progress"]["step"] = step
            mgr.maybe_save(step, state, user_metadata={"loss": loss.item()})
        final = mgr.save(steps, state, block=True, force=True)
    return {"start": start, "final": final, "events": bus}


def _data_file(root: str, step: int) -> str:
    d = os.path.join(root, f"step_{step:09d}")
    return os.path.join(d, sorted(n for n in os.listdir(d) if n.endswith(".bin"))[0])


def _listing(capsys, root: str) -> list[dict]:
    capsys.readouterr()
    assert cli_main(["list", root, "--all", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_damaged_newest_is_uncommitted_and_saved_again(tmp_path, caplog, capsys):
    root = str(tmp_path / "ckpt")
    first = _own_loop(root)
    assert first["start"] == 0 and first["final"] is True
    # The final forced save found step 20 saved by this run: no second save of it.
    assert [e.step for e in first["events"].of_kind("save_staged")] == [5, 10, 15, 20]
    old_id = CheckpointStore(root).read_manifest(20).save_id
    flip_byte(_data_file(root, 20), 3)

    with caplog.at_level(logging.WARNING):
        second = _own_loop(root)
    assert second["start"] == 15 and second["final"] is True
    bus = second["events"]
    assert [e.step for e in bus.of_kind("load_fallback")] == [20]
    assert "checkpoint step 20 failed verification while loading (checksum mismatch" in \
        bus.of_kind("load_fallback")[0].fields["reason"]
    assert [(e.step, e.fields["resumed_step"]) for e in bus.of_kind("checkpoint_uncommitted")] \
        == [(20, 15)]
    assert "un-committed checkpoint step 20 (newer than the step 15 resumed from" in caplog.text
    # This run wrote step 20 again: a new version, committed; the damaged one kept aside.
    assert [e.step for e in bus.of_kind("save_committed")] == [20]
    assert not bus.of_kind("save_skipped")
    rows = {(r["step"], r["id"]): r["status"] for r in _listing(capsys, root)}
    new_id = CheckpointStore(root).read_manifest(20).save_id
    assert new_id != old_id
    assert rows[(20, new_id)] == "committed" and rows[(20, old_id)] == "rolled-back"

    third = _own_loop(root)  # resumes from the new 20 at once: no fall-back any more
    assert third["start"] == 20 and third["final"] is True
    assert not third["events"].of_kind("load_fallback")
    assert not third["events"].of_kind("save_staged")  # its final save: the step resumed


def test_forced_save_that_cannot_save_raises(tmp_path):
    root = str(tmp_path / "ckpt")
    state = {"w": torch.ones(3), "progress": {"step": 0}}
    with CheckpointManager(root, retention=[]) as mgr:
        assert mgr.save(10, state, block=True) is True
    with CheckpointManager(root, retention=[]) as mgr:
        # Not resumed: step 10 is an earlier run's. Skipped when not forced...
        assert mgr.save(10, state, block=True) is False
        # ... and refused, loudly, when forced: it is not this run's state.
        with pytest.raises(FileExistsError, match="step 10 not saved: .*step_000000010 is "
                                                  "committed by an earlier run"):
            mgr.save(10, state, block=True, force=True)
        assert mgr.load_latest(state).step == 10
        assert mgr.save(10, state, block=True, force=True) is True  # resumed from it
        assert mgr.save(11, state, block=True, force=True) is True

    with CheckpointManager(root, ManagerOptions(lease_ttl_seconds=1.0), retention=[]) as mgr:
        now = time.time()
        mgr.storage.write_bytes(LEASE_NAME, json.dumps(
            {"holder": "feedfacecafe0000", "job": "elsewhere", "host": "other-host",
             "pid": 4242, "acquired_unix": now, "heartbeat_unix": now,
             "ttl_seconds": 60}).encode())
        assert wait_for(lambda: mgr.lease.lost, timeout=10)
        assert mgr.save(12, state) is False  # a due save is skipped (and reported)
        with pytest.raises(LeaseLostError, match="step 13 not saved: another job took over"):
            mgr.save(13, state, block=True, force=True)
    assert CheckpointStore(root).committed_steps() == [10, 11]


def test_no_cadence_warns_once_and_orbax_style_steps(tmp_path, caplog):
    root = str(tmp_path / "ckpt")
    state = {"w": torch.ones(3)}
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        with CheckpointManager(root, retention=[]) as mgr:
            assert mgr.latest_step() is None and mgr.all_steps() == []
            assert not any(mgr.maybe_save(step, state) for step in range(1, 101))
            mgr.save(7, state, block=True)
            mgr.save(3, state, block=True)
            assert mgr.all_steps() == [3, 7] and mgr.latest_step() == 7
    warned = [r.getMessage() for r in caplog.records if "no cadence" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "maybe_save() never saves" in warned[0] and "cadence=" in warned[0]
    assert root in warned[0]
