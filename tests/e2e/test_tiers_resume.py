"""Two tiers end to end: a job saving to a local tier every 3 steps and to the durable root
every 29 is SIGKILLed (every process at once) just after a local commit, before any durable
one; the same command resumes from the local tier and ends bit for bit where an
uninterrupted run (durable tier only) ends: the same loss at every step, the same final
checkpoint. The restart is not counted as a node loss in the durable tier's history."""

from __future__ import annotations

import json
import re

import pytest

from tests.e2e._jobs import (
    ABORT_MARK,
    COMMON,
    STEPS,
    Job,
    all_losses,
    assert_same_checkpoint,
    loss_history,
    straight_run,
    trainer_argv,
)

pytestmark = pytest.mark.slow

LOCAL_INTERVAL = 3
DURABLE_INTERVAL = 29  # the reference run saves every 7: the schedule changes no state


def test_killed_after_a_local_save_resumes_from_the_local_tier_bit_for_bit(tmp_path):
    straight_root, straight_events = straight_run(COMMON)
    root, local, jsonl = tmp_path / "ckpt", tmp_path / "local", tmp_path / "events.jsonl"
    argv = trainer_argv(*COMMON, f"--checkpoint.interval={DURABLE_INTERVAL}",
                        f"--checkpoint.root={root}", f"--checkpoint.local_root={local}",
                        f"--checkpoint.local_interval={LOCAL_INTERVAL}",
                        f"--metrics.jsonl_path={jsonl}", nproc=2)
    first = Job(argv, tmp_path, "killed", jsonl)
    # A local step, before the first durable one (29); a local save may be skipped while
    # the previous one persists (busy="skip"), so any local step from 6 on will do.
    first.wait_event(lambda e: e["kind"] == "local_save_committed"
                     and e["step"] >= 6, what="a local commit from step 6 on")
    first.kill_all()
    before = first.events()
    last_logged = max(e["step"] for e in before if e["kind"] == "train_step")
    assert last_logged < DURABLE_INTERVAL
    local_saves = sorted({e["step"] for e in before if e["kind"] == "local_save_committed"})
    assert not [e for e in before if e["kind"] == "save_committed"]
    assert local_saves[0] == 3 and all(s % 3 == 0 for s in local_saves), local_saves

    second = Job(argv, tmp_path, "resumed", jsonl).wait_ok()
    assert ABORT_MARK not in second.stderr, second.tails()
    m = re.search(r"resumed from the local tier \(\S+\) step (\d+)", second.stderr)
    # The newest local commit may have landed in the instant between its manifest and event.
    assert m and max(local_saves) <= int(m.group(1)) <= last_logged, second.tails()
    events = second.events()
    assert any(e["kind"] == "failure_reclassified" for e in events), second.tails()
    history = json.loads((root / "_history.json").read_text())
    assert history["failure_times"] == [], history

    ref = loss_history(straight_events)
    got = loss_history(events)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == ref, {s: (got[s], ref[s]) for s in ref if got.get(s) != ref[s]}
    for step, values in all_losses(events).items():
        assert all(v == ref[step] for v in values), (step, values, ref[step])
    assert_same_checkpoint(straight_root, root, STEPS)
    # The final step is due on both tiers: staged once (durable), persisted by both.
    final = [(e["kind"], e["reused"]) for e in events
             if e["kind"] in ("save_staged", "local_save_staged") and e["step"] == STEPS]
    assert sorted(final) == [("local_save_staged", True), ("save_staged", False)], final
    # The local tier keeps its last 2 (a local save may be skipped while one persists).
    kept = sorted(p.name for p in local.glob("step_*"))
    assert len(kept) == 2 and kept[-1] == f"step_{STEPS:09d}", kept
