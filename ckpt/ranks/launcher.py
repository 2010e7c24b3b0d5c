"""Which run of which job this process is, as its launcher tells it.

| launcher | run id (the same in every attempt) | attempt | name |
|---|---|---|---|
| torchrun | ``TORCHELASTIC_RUN_ID``, set explicitly | ``TORCHELASTIC_RESTART_COUNT`` | the run id |
| Slurm | ``slurm-<job id>[@<cluster>]`` | ``SLURM_RESTART_COUNT`` (or 0) | below |

torchrun's run id is explicit with ``--rdzv-id`` or ``--standalone`` (a random one). Slurm's
run is ``SLURM_JOB_ID`` (``@SLURM_CLUSTER_NAME`` when set), its name
``slurm-<job id>-restart-<n>`` (:attr:`SlurmJob.name`).

torchrun's wins where both are set (``srun torchrun --rdzv-id ...``: its restarts happen
inside one Slurm run). torchrun's default run id ``none`` is no run id: unrelated jobs share
it. The lease (:mod:`ckpt.root.lease`) records the run id and attempt, and takes a live
holder's lease over at once only from an earlier attempt of the same run (a lower attempt,
the same job fingerprint): torchrun restarts every worker of an attempt, and Slurm requeues
a job only once its previous run has ended, so that holder is gone (a holder cut off from
the cluster but still running is fenced off by the take-over).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

__all__ = ["LauncherRun", "SlurmJob", "launcher_run", "slurm_int"]

_NO_RUN_ID = ("", "none")


def slurm_int(environ: Mapping[str, str], name: str) -> int:
    """Slurm's variable ``name`` of ``environ`` as a number; ValueError naming it otherwise."""
    value = environ.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"Slurm's environment variable {name}={value!r} is not a whole "
                         f"number; start the ranks with srun inside a Slurm job "
                         f"(scripts/slurm/)") from None


@dataclass(frozen=True)
class SlurmJob:
    """This process's Slurm job: its id and how often it was requeued (0 on the first run)."""

    job_id: str
    restart_count: int
    cluster: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "SlurmJob | None":
        """The job of ``environ`` (default this process's), None outside a Slurm job.
        Raises ValueError naming ``SLURM_RESTART_COUNT`` when it is not a whole number."""
        environ = os.environ if environ is None else environ
        job_id = environ.get("SLURM_JOB_ID", "")
        if not job_id:
            return None
        restart = (slurm_int(environ, "SLURM_RESTART_COUNT")
                   if environ.get("SLURM_RESTART_COUNT") else 0)
        return cls(job_id, restart, environ.get("SLURM_CLUSTER_NAME", ""))

    @property
    def name(self) -> str:
        """``slurm-<job id>-restart-<n>``: the run's name in the checkpoint root's lease
        record and run log (``ckpt list --all``, ``ckpt history``)."""
        return f"slurm-{self.job_id}-restart-{self.restart_count}"

    @property
    def run_id(self) -> str:
        """The same in every run of the job, different for another job (of another
        cluster too)."""
        return f"slurm-{self.job_id}" + (f"@{self.cluster}" if self.cluster else "")


@dataclass(frozen=True)
class LauncherRun:
    """An attempt of a run: ``run_id`` is the same in all of them, ``attempt`` counts them
    from 0; ``name`` names this attempt (a job's default name in the lease)."""

    run_id: str
    attempt: int
    name: str


def launcher_run(environ: Mapping[str, str] | None = None) -> LauncherRun | None:
    """The launcher's run of ``environ`` (default this process's; see the module's table),
    None without torchrun's explicit run id or Slurm's job. Raises ValueError naming the
    variable when Slurm's restart count is malformed."""
    environ = os.environ if environ is None else environ
    run_id = environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id not in _NO_RUN_ID:
        try:
            attempt = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        except ValueError:
            attempt = 0
        return LauncherRun(run_id, attempt, run_id)
    slurm = SlurmJob.from_env(environ)
    if slurm is None:
        return None
    return LauncherRun(slurm.run_id, slurm.restart_count, slurm.name)
