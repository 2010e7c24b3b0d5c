"""Exit codes that tell the truth about the last checkpoint (docs/trainer.md).

A run that trained to the end but whose final save did not commit must not exit 0 ("finished,
last step checkpointed"), and neither may a run that lost its checkpoint root's write lease
to another job. Each case runs the real trainer with storage faults injected from one step on
(tests/e2e/_faulty_storage.py).
"""

from __future__ import annotations

import json

import pytest

from ckpt.root import CheckpointStore
from tests.e2e._jobs import ROOT, Job, base_env, trainer_argv
from trainer.distributed import EXIT_LEASE_LOST, EXIT_NOT_CHECKPOINTED, EXIT_OK

pytestmark = pytest.mark.timeout(240)
FAULTY = ROOT / "tests/e2e/_faulty_storage.py"


def _run(tmp_path, name: str, nproc, **env: str) -> tuple[Job, object]:
    root, jsonl = tmp_path / "ckpt", tmp_path / "events.jsonl"
    job = Job(trainer_argv("--training.steps=20", "--checkpoint.interval=5",
                           "--training.log_every=5",
                           f"--checkpoint.root={root}", f"--metrics.jsonl_path={jsonl}",
                           nproc=nproc, script=FAULTY),
              tmp_path, name, jsonl, env=base_env(**env))
    return job, root


@pytest.mark.parametrize("nproc", [None, 2])
def test_final_save_that_does_not_commit_is_not_exit_0(tmp_path, nproc):
    job, root = _run(tmp_path, "unwritable", nproc, E2E_FAIL_FROM_STEP="20")
    code = job.wait(180)
    if nproc is None:
        assert code == EXIT_NOT_CHECKPOINTED, job.tails()
    else:  # torchrun exits 1 for any failed worker; each worker's own code is in its report
        assert code != 0 and job.stderr.count(f"exitcode  : {EXIT_NOT_CHECKPOINTED} ") == 2, \
            job.tails()
    assert "trained to step 20 but its checkpoint did not commit" in job.stderr, job.tails()
    if nproc is None:  # (torchrun prints its own traceback for a failed worker)
        assert "Traceback" not in job.stderr.split("did not commit")[-1], job.tails()
    committed = CheckpointStore(root).committed_steps()  # a save may be skipped while
    assert committed and 20 not in committed and committed[0] == 5, committed  # one persists


def test_lost_lease_stops_the_job_with_its_own_code(tmp_path):
    job, root = _run(tmp_path, "stolen", None, E2E_STEAL_LEASE_AT_STEP="10")
    code = job.wait(180)
    assert code == EXIT_LEASE_LOST, job.tails()
    assert "another job took over the write lease" in job.stderr, job.tails()
    last = max(e["step"] for e in job.events() if e["kind"] == "train_step")
    assert last < 20  # stopped instead of training on with saves that cannot count
    committed = CheckpointStore(root).committed_steps()
    assert committed and committed[0] == 5 and committed[-1] < last, (committed, last)
    assert json.loads((root / "_lease.json").read_text())["holder"] == "intruder0000000"


def test_clean_run_still_exits_0(tmp_path):
    job, root = _run(tmp_path, "clean", None)
    assert job.wait(180) == EXIT_OK, job.tails()
    assert CheckpointStore(root).committed_steps()[-1] == 20
