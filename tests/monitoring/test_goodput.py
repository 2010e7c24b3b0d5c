"""The goodput ledger: where a job's wall time went, by category, from its events and across
its restarts (the record in the root's ``_history.json``), as the exporter serves it and
``ckpt history`` prints it. The same ledger against a real job's raw event log, SIGKILLed at
known times, is ``bench/bench_goodput.py``, run by test_alerts_e2e.py."""

from __future__ import annotations

import json
import logging
import math
import time

import pytest

from ckpt.cadence import (
    GOODPUT_CATEGORIES,
    FailureHistory,
    GoodputLedger,
    load_goodput,
    load_history,
    write_history,
)
from ckpt.cadence.history import HISTORY_NAME
from ckpt.events import Event, EventBus
from ckpt.storage import Storage
from monitoring import Metrics
from tests.monitoring.test_metrics import _value


def _feed(ledger: GoodputLedger, *events: tuple) -> None:
    """``(time, kind, step, fields)`` events, in order."""
    for t, kind, step, fields in events:
        ledger.on_event(Event(kind, step, fields, time=t))


def _step(t: float, step: int, seconds: float = 1.0) -> tuple:
    return (t, "train_step", step, {"loss": 1.0, "step_seconds": seconds})


def _adds_up(b: dict) -> None:
    assert sum(b["seconds"].values()) == pytest.approx(b["wall_seconds"])
    assert set(b["seconds"]) == set(GOODPUT_CATEGORIES)


def test_a_fresh_job_splits_its_time():
    g = GoodputLedger.start(None, process_start_unix=1000.0)
    _feed(g, _step(1010.0, 1, 2.0),  # start-up: 1000..1008
          (1010.5, "save_staged", 1, {"stall_seconds": 0.5, "bytes": 1}),
          (1010.6, "local_save_staged", 1, {"stall_seconds": 0.25, "tier": "local"}),
          _step(1013.0, 2, 2.0))  # 1010..1011: 0.75 stall, 0.25 other
    b = g.breakdown()
    assert b["seconds"] == {**dict.fromkeys(GOODPUT_CATEGORIES, 0.0), "productive": 4.0,
                            "startup": 8.0, "checkpoint_stall": 0.75, "other": 0.25}
    assert b["wall_seconds"] == 13.0 and b["goodput"] == pytest.approx(4 / 13)
    live = g.breakdown(1015.0)  # the time since the last step, live
    assert live["seconds"]["other"] == 2.25 and live["wall_seconds"] == 15.0
    _adds_up(live)
    assert GoodputLedger.start(None, process_start_unix=5.0).breakdown()["goodput"] is None


def _first_process() -> GoodputLedger:
    """Started at 0, trained steps 1-10 (1 s each, the last ending at 15); its save at
    step 5 carried productive_seconds=5; its last record at 15."""
    a = GoodputLedger.start(None, process_start_unix=0.0)
    _feed(a, *[_step(5.0 + i, i) for i in range(1, 11)])
    return a


def test_a_restart_continues_the_tally_and_moves_the_lost_work():
    record = _first_process().to_dict()
    b = GoodputLedger.start(record, process_start_unix=30.0)
    _feed(b, (32.0, "resumed", 5, {"same_layout": True, "productive_seconds": 5.0}),
          _step(41.0, 6))  # began at 40
    got = b.breakdown()
    # Steps 6-10 were trained again: 5 s recomputed; down from 15 to 40: restart.
    assert got["seconds"]["productive"] == 6.0 and got["seconds"]["recomputed"] == 5.0
    assert got["seconds"]["restart"] == 25.0 and got["seconds"]["startup"] == 5.0
    assert got["wall_seconds"] == 41.0 and got["first_start_unix"] == 0.0
    _adds_up(got)


def test_a_checkpoint_newer_than_the_last_record_is_productive_time_from_the_gap():
    """The last record (15) predates a commit at step 8: the resume knows 8 s are kept;
    they came out of the time counted as down."""
    b = GoodputLedger.start(_first_process().to_dict(), process_start_unix=30.0)
    _feed(b, (32.0, "resumed", 8, {"productive_seconds": 13.0}), _step(41.0, 9))
    got = b.breakdown()
    assert got["seconds"]["productive"] == 14.0 and got["seconds"]["recomputed"] == 0.0
    assert got["seconds"]["restart"] == 25.0 - 3.0
    _adds_up(got)
    # A claim beyond the whole gap is not believed: never more productive than wall time.
    c = GoodputLedger.start(_first_process().to_dict(), process_start_unix=30.0)
    _feed(c, (32.0, "resumed", 8, {"productive_seconds": 500.0}), _step(41.0, 9))
    _adds_up(c.breakdown())
    assert c.breakdown()["seconds"]["restart"] == 0.0
    # A checkpoint without the figure (written before it existed): nothing moves.
    d = GoodputLedger.start(_first_process().to_dict(), process_start_unix=30.0)
    _feed(d, (32.0, "resumed", 5, {"productive_seconds": None}), _step(41.0, 6))
    assert d.breakdown()["seconds"]["recomputed"] == 0.0
    _adds_up(d.breakdown())


def test_a_restart_from_scratch_recomputes_everything_trained_before():
    """Killed before its first commit: the next process starts at step 1 again."""
    b = GoodputLedger.start(_first_process().to_dict(), process_start_unix=30.0)
    _feed(b, _step(41.0, 1))
    got = b.breakdown()
    assert got["seconds"]["productive"] == 1.0 and got["seconds"]["recomputed"] == 10.0
    _adds_up(got)


def test_a_new_tally_ignores_a_checkpoints_figure():
    """No record (a root without history): the figure of an unknown earlier life is not
    imported into a tally that starts now."""
    g = GoodputLedger.start(None, process_start_unix=100.0)
    _feed(g, (101.0, "resumed", 50, {"productive_seconds": 900.0}), _step(106.0, 51))
    assert g.breakdown()["seconds"] == {**dict.fromkeys(GOODPUT_CATEGORIES, 0.0),
                                        "productive": 1.0, "startup": 5.0}


def test_a_normal_end_leaves_the_pause_until_the_next_start_out():
    a = _first_process()
    _feed(a, (20.0, "run_ended", 10, {"exit_code": 0}))
    record = a.to_dict()
    assert record["ended"] is True and record["recorded_unix"] == 20.0
    b = GoodputLedger.start(record, process_start_unix=1000.0)
    _feed(b, (1003.0, "resumed", 10, {"productive_seconds": 10.0}), _step(1011.0, 11))
    got = b.breakdown()
    assert got["wall_seconds"] == 20.0 + 11.0  # 20..1000 is not the job's time
    assert got["seconds"]["startup"] == 5.0 + 10.0 and got["seconds"]["restart"] == 0.0
    _adds_up(got)
    # A run that stopped otherwise (exit 75, preempted) counts the pause as restart.
    c = _first_process()
    _feed(c, (20.0, "run_ended", 10, {"exit_code": 75}))
    d = GoodputLedger.start(c.to_dict(), process_start_unix=1000.0)
    _feed(d, _step(1011.0, 11))
    assert d.breakdown()["seconds"]["restart"] == 1010.0 - 20.0


def test_a_crash_records_its_time_and_the_next_start_counts_from_it():
    a = _first_process()
    a.close(18.0)  # the run's finally, after a peer died
    assert a.to_dict()["recorded_unix"] == 18.0 and a.to_dict()["ended"] is False
    b = GoodputLedger.start(a.to_dict(), process_start_unix=25.0)
    _feed(b, _step(31.0, 11))
    got = b.breakdown()
    assert got["seconds"]["other"] == 3.0 and got["seconds"]["restart"] == 30.0 - 18.0


def test_replica_groups_reduced_and_uncommitted_steps():
    g = GoodputLedger.start(None, process_start_unix=0.0)
    _feed(g, (4.0, "ft_step", 1, {"committed": True, "quorum_size": 2, "replica_groups": 2}),
          _step(5.0, 1, 2.0),
          (6.0, "ft_step", 2, {"committed": True, "quorum_size": 1, "replica_groups": 2}),
          _step(8.0, 2, 2.0),  # half of it with one group of two
          (11.0, "ft_step", 3, {"committed": False, "quorum_size": 1, "replica_groups": 2}),
          (12.0, "ft_step", 3, {"committed": True, "quorum_size": 2, "replica_groups": 2}),
          _step(14.0, 3, 2.0))
    s = g.breakdown()["seconds"]
    assert s["productive"] == 2.0 + 1.0 + 2.0 and s["reduced_quorum"] == 1.0
    assert s["uncommitted"] == 3.0 and s["other"] == 2.0 and s["startup"] == 3.0


def test_every_event_hands_the_record_on():
    records = []
    g = GoodputLedger.start(None, process_start_unix=0.0, on_record=records.append)
    _feed(g, _step(5.0, 1), (5.5, "lease_acquired", None, {}), _step(7.0, 2))
    assert len(records) == 2 and records[-1] == g.to_dict()
    assert json.loads(json.dumps(records[-1])) == records[-1]


@pytest.mark.parametrize("bad, field", [
    ({"version": 2}, "version"),
    ({"first_start_unix": "yesterday"}, "first_start_unix"),
    ({"recorded_unix": -1.0}, "recorded_unix"),
    ({"seconds": [1, 2]}, "seconds"),
    ({"seconds": {"productive": math.inf}}, "seconds.productive"),
    ({"ended": "no"}, "ended"),
])
def test_a_damaged_record_names_its_field(bad, field):
    record = {**_first_process().to_dict(), **bad}
    with pytest.raises(ValueError, match=field):
        GoodputLedger.start(record, process_start_unix=100.0)


def test_a_category_a_later_version_adds_counts_as_other():
    record = _first_process().to_dict()
    record["seconds"]["paused_for_maintenance"] = 7.0
    got = GoodputLedger.from_dict(record).breakdown()
    assert got["seconds"]["other"] == record["seconds"]["other"] + 7.0
    _adds_up(got)


# -- the record in the root's history -------------------------------------------------------------
def test_the_history_keeps_the_record_and_old_files_still_read(tmp_path):
    storage = Storage(str(tmp_path))
    assert load_goodput(storage) is None  # no history
    old = FailureHistory(failure_times=[1.0], uptime_seconds=2.0)
    assert "goodput" not in old.to_dict()  # a history without a record writes as before
    write_history(storage, old)
    assert load_goodput(storage) is None  # a file from before the record
    record = _first_process().to_dict()
    write_history(storage, FailureHistory(failure_times=[1.0], goodput=record))
    stored = json.loads((tmp_path / HISTORY_NAME).read_text())
    assert stored["version"] == 1 and stored["goodput"] == record
    assert load_history(storage).goodput == record
    assert load_goodput(storage).breakdown() == GoodputLedger.from_dict(record).breakdown()
    stored["goodput"]["seconds"] = "lots"
    (tmp_path / HISTORY_NAME).write_text(json.dumps(stored))
    with pytest.raises(ValueError, match=rf"{HISTORY_NAME}.*goodput record.*seconds"):
        load_goodput(storage)


def test_a_trainer_process_continues_the_stored_record_and_a_damaged_one_starts_over(
        tmp_path, caplog):
    from trainer.goodput import GoodputRecorder

    storage = Storage(str(tmp_path))
    a = _first_process()
    write_history(storage, FailureHistory(goodput=a.to_dict()))
    rec = GoodputRecorder(EventBus(), coordinator=True, storage=storage)
    assert rec.ledger.first_start_unix == 0.0  # continued (read only: no manager)
    write_history(storage, FailureHistory(goodput={**a.to_dict(), "version": 9}))
    with caplog.at_level(logging.WARNING):
        rec = GoodputRecorder(EventBus(), coordinator=True, storage=storage)
    assert rec.ledger.first_start_unix > 0.0 and "not version" in caplog.text


def test_a_coordinator_writes_the_ledger_while_it_trains_and_at_its_end(tmp_path,
                                                                       monkeypatch):
    """With a manager: every change goes into its history; from start() on the history is
    written every RECORD_SECONDS, and stop() writes it with the run's end (a killed
    process loses at most that much of its account)."""
    import trainer.goodput
    from ckpt.job import CheckpointManager
    from trainer.goodput import GoodputRecorder

    monkeypatch.setattr(trainer.goodput, "RECORD_SECONDS", 0.1)
    bus = EventBus()
    storage = Storage(str(tmp_path))
    with CheckpointManager(str(tmp_path), events=bus) as mgr:
        rec = GoodputRecorder(bus, coordinator=True, manager=mgr)
        bus.emit("train_step", 1, loss=1.0, step_seconds=0.01)
        assert mgr.history.goodput == rec.ledger.to_dict()  # in the history it writes
        time.sleep(0.5)
        assert load_goodput(storage) is None or load_goodput(storage).breakdown()[
            "seconds"]["productive"] == 0.0  # not written before the loop starts
        rec.start()
        bus.emit("train_step", 2, loss=1.0, step_seconds=0.01)
        deadline = time.monotonic() + 10
        while (load_goodput(storage) is None
               or load_goodput(storage).breakdown()["seconds"]["productive"] < 0.02):
            assert time.monotonic() < deadline, "the ledger was not written while training"
            time.sleep(0.05)
        rec.stop(ended=True)
        stored = json.loads((tmp_path / HISTORY_NAME).read_text())["goodput"]
        assert stored["ended"] is True and stored == rec.ledger.to_dict()


def test_the_exporter_serves_the_trainers_ledger_once_handed_it():
    bus = EventBus()
    m = Metrics(bus)
    time.sleep(0.05)
    bus.emit("train_step", 1, loss=1.0, step_seconds=0.01)
    own = _value(m, "train_goodput_seconds", category="productive")
    assert own == 0.01  # its own ledger, from the exporter's start
    ledger = GoodputLedger.start(_first_process().to_dict(), process_start_unix=30.0)
    m.observe_goodput(ledger)
    bus.emit("train_step", 2, loss=1.0, step_seconds=0.5)  # fed by its owner, not the exporter
    assert _value(m, "train_goodput_seconds", category="productive") == 10.0
    assert _value(m, "train_goodput_job_start_timestamp_seconds") == 0.0
    assert _value(m, "train_goodput_wall_seconds") > 15.0  # live: up to now
    ratio = _value(m, "train_goodput_ratio")
    assert ratio == pytest.approx(10.0 / _value(m, "train_goodput_wall_seconds"), rel=1e-3)


def test_ckpt_history_prints_the_breakdown_before_the_trajectories(tmp_path, capsys):
    from ckpt.cli import main

    storage = Storage(str(tmp_path))
    a = _first_process()
    _feed(a, (20.0, "save_staged", 10, {"stall_seconds": 2.0}), (21.0, "run_ended", 10,
                                                                 {"exit_code": 0}))
    write_history(storage, FailureHistory(goodput=a.to_dict()))
    assert main(["history", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "goodput      47.6% of 21s since the job first started" in out, out
    assert "    productive             10s  47.6%" in out
    assert "    checkpoint stall        2s   9.5%" in out
    assert out.index("goodput ") < out.index("trajectories")
    assert main(["history", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["goodput"]["seconds"]["productive"] == 10.0
    assert info["goodput"]["wall_seconds"] == 21.0
    (tmp_path / HISTORY_NAME).unlink()
    assert main(["history", str(tmp_path)]) == 0
    assert "goodput      no record" in capsys.readouterr().out
