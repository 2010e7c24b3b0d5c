"""Every checkpoint damaged: the trainer refuses to start over unless told to.

A short run (one process) leaves checkpoints at steps 2, 4 and 6. Each gets a different
damage in a file holding model state: a flipped byte, a truncation, a deleted file. A resume
then exits non-zero with one log line naming every step, its reason and the flag that
starts fresh on purpose; it trains nothing and changes nothing under the root. With
``--checkpoint.allow_fresh_start_over_damaged=true`` the run starts at step 0 and its
losses equal, bit for bit, those of a run on an empty root: the failed loads left the
model, optimizer, schedule and data position untouched (before loads were transactional,
the first loss differed).
"""

from __future__ import annotations

import os

from ckpt.root import CheckpointStore
from tests.ckpt._helpers import flip_byte
from tests.e2e._jobs import Job, loss_history, trainer_argv

STEPS = ("--training.steps=6", "--checkpoint.interval=2", "--checkpoint.keep_last=0",
         "--checkpoint.async_save=false", "--fault.handle_preemption=false")
FLAG = "--checkpoint.allow_fresh_start_over_damaged=true"


def _run(tmp_path, name: str, root, *extra: str) -> Job:
    jsonl = tmp_path / f"{name}.jsonl"
    return Job(trainer_argv(*STEPS, f"--checkpoint.root={root}", f"--metrics.jsonl_path={jsonl}",
                            *extra), tmp_path, name, jsonl)


def _model_item(root, step: int):
    manifest = CheckpointStore(str(root)).read_manifest(step, complete=True)
    name = sorted(k for k in manifest.tensors if k.startswith("app."))[0]
    loc = manifest.tensors[name]["chunks"][0]["location"]
    return os.path.join(root, f"step_{step:09d}", loc.file), loc


def test_all_damaged_refuses_then_starts_fresh_on_purpose(tmp_path):
    root = tmp_path / "ckpt"
    _run(tmp_path, "first", root).wait_ok()
    store = CheckpointStore(str(root))
    assert store.committed_steps() == [2, 4, 6]

    path, loc = _model_item(root, 2)
    flip_byte(path, loc.offset + 1)
    path, loc = _model_item(root, 4)
    with open(path, "r+b") as f:
        f.truncate(loc.offset)
    path, _ = _model_item(root, 6)
    os.remove(path)

    refused = _run(tmp_path, "refused", root)
    code = refused.wait()
    assert code != 0, refused.tails()
    lines = [ln for ln in refused.stderr.splitlines() if "every checkpoint under" in ln]
    assert len(lines) == 1, refused.tails()
    line = lines[0]
    for step, reason in ((6, "missing"), (4, "the manifest says"), (2, "checksum mismatch")):
        assert f"step {step}: " in line and reason in line, line
    assert FLAG in line, line
    assert loss_history(refused.events()) == {}, "a refused run must not train"
    assert store.committed_steps() == [2, 4, 6], "a refused run must not change the root"

    over = _run(tmp_path, "over", root, FLAG).wait_ok()
    fresh = _run(tmp_path, "fresh", tmp_path / "empty").wait_ok()
    losses = loss_history(over.events())
    assert sorted(losses) == [1, 2, 3, 4, 5, 6], over.tails()
    assert losses == loss_history(fresh.events())
    # The damaged steps were un-committed and written again by this run.
    assert store.committed_steps() == [2, 4, 6]
    for step in (2, 4, 6):
        store.verify(step)
    # The fresh start is a trajectory of its own, recorded before it un-committed anything:
    # its versions name the run log's tip, and the first run's (rolled back) are abandoned,
    # so that no resume takes one even if it came back (it used to save as a run the log
    # never knew, with the first run still the tip).
    trajectory = store.trajectory()
    for step in (2, 4, 6):
        lineage = store.read_manifest(step).lineage
        assert lineage.run == trajectory.tip and lineage.parent is None, (step, lineage)
        old = [store.life.find(e.id) for e in store.entries(step) if e.status == "rolled-back"]
        assert old and all(trajectory.why_abandoned(step, e.id, e.manifest.lineage)
                           for e in old), (step, old)


def test_damaged_rng_state_falls_back_with_the_rest(tmp_path):
    """The RNG streams load in the same transaction as the model: a damaged RNG item makes
    the whole checkpoint fall back to the previous one (not a checksum error after the model
    was already loaded), and the run continues from there bit for bit."""
    root = tmp_path / "ckpt"
    _run(tmp_path, "first", root).wait_ok()
    manifest = CheckpointStore(str(root)).read_manifest(6, complete=True)
    rng = sorted([*(k for k in manifest.tensors if k.startswith("rng.")),
                  *(k for k in manifest.objects if k.startswith("rng."))])
    assert rng, "the trainer saves its RNG streams"
    key = rng[0]
    loc = manifest.tensors[key]["chunks"][0]["location"] if key in manifest.tensors \
        else manifest.objects[key]
    flip_byte(os.path.join(root, "step_000000006", loc.file), loc.offset + loc.length // 2)
    again = _run(tmp_path, "again", root, "--training.steps=8").wait_ok()
    assert "resumed from" in again.stderr and " step 4" in again.stderr, again.tails()
    assert sorted(loss_history(again.events())) == [5, 6, 7, 8], again.tails()
    straight = _run(tmp_path, "straight", tmp_path / "other", "--training.steps=8").wait_ok()
    ref = loss_history(straight.events())
    assert all(ref[s] == v for s, v in loss_history(again.events()).items())
