"""Which attempt of which run a process is (ckpt.ranks.launcher): torchrun's explicit run id
and restart count, else the Slurm job's id and restart count; what the lease records and
takes a live holder's lease over by (tests/ckpt/root/test_lifecycle.py)."""

from __future__ import annotations

import pytest

from ckpt.ranks import LauncherRun, SlurmJob, launcher_run

SLURM = {"SLURM_JOB_ID": "4711", "SLURM_RESTART_COUNT": "2"}


def test_slurms_job_and_restart_count_are_the_run_and_its_attempt():
    assert launcher_run(SLURM) == LauncherRun("slurm-4711", 2, "slurm-4711-restart-2")
    # The first run has no SLURM_RESTART_COUNT; a cluster's name keeps its job ids apart.
    assert launcher_run({"SLURM_JOB_ID": "4711", "SLURM_CLUSTER_NAME": "west"}) == \
        LauncherRun("slurm-4711@west", 0, "slurm-4711-restart-0")
    assert SlurmJob.from_env({**SLURM, "SLURM_CLUSTER_NAME": "west"}).name == \
        "slurm-4711-restart-2"


def test_torchruns_explicit_run_id_wins_and_its_default_is_none():
    elastic = {"TORCHELASTIC_RUN_ID": "job-42", "TORCHELASTIC_RESTART_COUNT": "3"}
    assert launcher_run(elastic) == LauncherRun("job-42", 3, "job-42")
    assert launcher_run({**SLURM, **elastic}) == LauncherRun("job-42", 3, "job-42")
    assert launcher_run({**SLURM, "TORCHELASTIC_RUN_ID": "none"}).run_id == "slurm-4711"
    assert launcher_run({"TORCHELASTIC_RUN_ID": "none"}) is None
    assert launcher_run({}) is None


def test_a_malformed_slurm_restart_count_names_the_variable():
    with pytest.raises(ValueError, match=r"SLURM_RESTART_COUNT='two' is not a whole number"):
        launcher_run({**SLURM, "SLURM_RESTART_COUNT": "two"})
