"""Slurm's side of the trainer (trainer.slurm) and the preemption grace (trainer.faults).

torch's ``env://`` variables from the ones srun gives each task, the first host of a Slurm
node list, the job's name and restart count in the lease record and ``ckpt history``, and
the one-line warning when a save takes longer than the grace a preemption or time-limit
signal leaves (on a one-process Trainer run twice as a job and its requeue: when the save
commits, and when the requeued run starts from a checkpoint saved after it). The recipes
themselves run against a real Slurm in tests/e2e/test_slurm.py.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt.cli import main as ckpt_main
from ckpt.ranks import SlurmJob
from trainer.checkpointing import manager_options
from trainer.config import load_config
from trainer.distributed import DistEnv
from trainer.faults import Preemption
from trainer.slurm import export_torch_env, first_host, torch_env
from trainer.train import Trainer

ROOT = Path(__file__).resolve().parents[2]

# What srun gives the second task of a 4-task step on 2 nodes (job 4711, requeued twice).
TASK = {"SLURM_JOB_ID": "4711", "SLURM_RESTART_COUNT": "2", "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "gpu[007-008]",
        "SLURM_JOB_NODELIST": "gpu[007-008]"}


def test_an_srun_task_gets_torch_env_from_slurms():
    assert torch_env(TASK) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                               "GROUP_RANK": "1", "MASTER_ADDR": "gpu007",
                               "MASTER_PORT": str(20000 + 4711 % 10000)}


def test_variables_already_set_win_and_only_srun_steps_get_any():
    # torchrun inside srun, or a batch script that chose the rendezvous port: kept as set.
    launched = {**TASK, "RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "GROUP_RANK": "0",
                "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert torch_env(launched) == {}
    assert torch_env({**TASK, "MASTER_PORT": "1234"})["MASTER_ADDR"] == "gpu007"
    assert "MASTER_PORT" not in torch_env({**TASK, "MASTER_PORT": "1234"})
    # The batch script itself (python -m trainer there runs as one process), and no Slurm.
    batch = {k: v for k, v in TASK.items() if k != "SLURM_STEP_ID"}
    assert torch_env(batch) == {}
    assert torch_env({**TASK, "SLURM_STEP_ID": "batch"}) == {}
    # A one-task step (srun --pty bash, srun -n1 ...): one process, no group, as without Slurm.
    assert torch_env({**TASK, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}) == {}
    assert torch_env({}) == {}
    environ = dict(TASK)
    assert export_torch_env(environ)["RANK"] == "3" and environ["WORLD_SIZE"] == "4"


def test_malformed_slurm_variables_are_one_line_naming_the_variable():
    with pytest.raises(ValueError, match=r"SLURM_PROCID='x' is not a whole number"):
        torch_env({**TASK, "SLURM_PROCID": "x"})
    with pytest.raises(ValueError, match="SLURM_RESTART_COUNT"):
        SlurmJob.from_env({**TASK, "SLURM_RESTART_COUNT": "two"})
    with pytest.raises(ValueError, match=r"set MASTER_ADDR"):
        torch_env({**TASK, "SLURM_STEP_NODELIST": "", "SLURM_JOB_NODELIST": ""})
    with pytest.raises(ValueError, match=r"first host of the Slurm node list .n\[1-"):
        first_host("n[1-")


@pytest.mark.parametrize("nodelist, host", [
    ("vm", "vm"), ("gpu[007-008]", "gpu007"), ("node[03-08,11],gpu7", "node03"),
    ("a,b[1-2]", "a"), ("rack[1-2]-n[5-6]", "rack1-n5"), ("n[10,2-3]", "n10"),
    ("x[001]", "x001")])
def test_first_host_of_a_node_list(nodelist, host):
    assert first_host(nodelist) == host


def test_the_job_names_its_requeues():
    assert SlurmJob.from_env(TASK) == SlurmJob("4711", 2)
    assert SlurmJob.from_env(TASK).name == "slurm-4711-restart-2"
    first = {k: v for k, v in TASK.items() if k != "SLURM_RESTART_COUNT"}  # unset on run 1
    assert SlurmJob.from_env(first).name == "slurm-4711-restart-0"
    assert SlurmJob.from_env({}) is None


def test_python_m_trainer_names_a_malformed_slurm_variable(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "trainer", "--config", str(ROOT / "configs" / "tiny.toml")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **TASK,
             "SLURM_STEP_NUM_TASKS": "four"})
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "SLURM_STEP_NUM_TASKS='four'" in lines[0], out.stderr


def test_a_save_longer_than_the_grace_warns_once(caplog):
    with caplog.at_level(logging.WARNING, logger="trainer.faults"):
        assert not Preemption(0.0).check_save_seconds(500.0, 10)  # grace not known
        p = Preemption(30.0)
        assert not p.check_save_seconds(29.0, 10)
        assert not p.check_save_seconds(None, 10)
        assert p.check_save_seconds(45.5, 20)
        assert not p.check_save_seconds(90.0, 30)  # once per process
    [record] = caplog.records
    assert "\n" not in record.getMessage()
    assert ("the save of step 20 took 45.5s, longer than the preemption grace of 30s "
            "(fault.preemption_grace_seconds)") in record.getMessage()


def _trainer(tmp_path, steps: int):
    cfg = load_config(str(ROOT / "configs" / "tiny.toml"), [
        f"--training.steps={steps}", f"--checkpoint.root={tmp_path / 'ckpt'}",
        "--checkpoint.interval=2", "--checkpoint.async_save=false",
        "--fault.preemption_grace_seconds=0.000001"])
    return Trainer(cfg, DistEnv(0, 1, 0, torch.device("cpu"), None, 0))


def test_the_lease_is_named_after_the_slurm_job_and_its_restart(monkeypatch):
    """Every rank's manager options carry the run's name (the lease record and the run log
    take it); with replica groups, the group's after it. Outside Slurm: none given (the
    lease names the program or torchrun's run id)."""
    cfg = load_config(str(ROOT / "configs" / "tiny.toml"), [])
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    assert manager_options(cfg, 1, "fp").job_name is None
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert manager_options(cfg, 1, "fp").job_name == "slurm-4711-restart-2"
    ft = load_config(str(ROOT / "configs" / "tiny.toml"), [
        "--parallel.dp_replicate=2", "--fault_tolerance.enabled=true",
        "--fault_tolerance.group_id=1"])
    assert manager_options(ft, 1, "fp").job_name == "slurm-4711-restart-2/replica-group-1"


def test_a_requeued_slurm_run_names_its_restart_and_warns_of_a_save_longer_than_the_grace(
        tmp_path, caplog, capsys, monkeypatch):
    """A Slurm job's first run and its requeue (``SLURM_RESTART_COUNT`` 0, then 1) on one
    root: the lease record and ``ckpt history`` name both runs ``slurm-<id>-restart-<n>``.
    Each save records what the newest one before it took (``last_save``): the requeued run
    checks that against its grace as it starts, before it trains."""
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    with caplog.at_level(logging.INFO):
        assert _trainer(tmp_path, 4).fit() == 0
    warned = [r.getMessage() for r in caplog.records if "preemption grace" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("the save of step 2 took"), warned
    caplog.clear()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with caplog.at_level(logging.INFO):
        assert _trainer(tmp_path, 6).fit() == 0
    messages = [r.getMessage() for r in caplog.records]
    warned = [i for i, m in enumerate(messages) if "preemption grace" in m]
    resumed = [i for i, m in enumerate(messages) if m.startswith("resumed from")]
    assert len(warned) == 1 and messages[warned[0]].startswith("the save of step 2 took")
    assert warned[0] < resumed[0], messages
    root = tmp_path / "ckpt"
    lease = json.loads((root / "_lease.json").read_text())
    assert lease["job"] == "slurm-4711-restart-1" and lease["released"], lease
    capsys.readouterr()
    assert ckpt_main(["history", str(root)]) == 0
    history = capsys.readouterr().out
    for run in (0, 1):
        assert f"job slurm-4711-restart-{run}" in history, history
