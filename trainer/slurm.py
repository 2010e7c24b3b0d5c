"""Running under Slurm: the job's identity, and torch's environment for ranks srun starts.

The recipes in ``scripts/slurm/`` start one task per rank with ``srun python -m trainer``
(no torchrun; docs/trainer.md, "Slurm", says why). Each task then finds Slurm's variables,
not torch's: :func:`export_torch_env` (called by ``python -m trainer`` before anything reads
them) sets torch's ``env://`` variables from them.

| torch's | from Slurm's (a task of an srun step) |
|---|---|
| ``RANK`` | ``SLURM_PROCID`` |
| ``WORLD_SIZE`` | ``SLURM_STEP_NUM_TASKS`` |
| ``LOCAL_RANK`` | ``SLURM_LOCALID`` (also the metrics port offset) |
| ``GROUP_RANK`` | ``SLURM_NODEID`` (the node's index: the local checkpoint tier's folder) |
| ``MASTER_ADDR`` | the first host of ``SLURM_STEP_NODELIST`` (:func:`first_host`) |
| ``MASTER_PORT`` | :data:`MASTER_PORT_BASE` + job id mod :data:`MASTER_PORT_SPAN` |

A variable already set wins (a launcher such as torchrun set it, or the batch script chose
``MASTER_PORT``); nothing is set outside an srun step of two or more tasks (the batch script
itself, an allocation's shell, ``srun --pty bash``: a ``python -m trainer`` there runs as one
process, as it does without Slurm).

What a Slurm event means to the trainer: the time limit's warning (``--signal=B:USR1@N``,
forwarded to the ranks by the batch script) and a preemption or ``scancel --signal=TERM``
are both :class:`trainer.faults.Preemption`: save the current step, blocking, and exit 75;
the batch script requeues the job on 75 (``scontrol requeue``), and the requeued run (the
same job id, ``SLURM_RESTART_COUNT`` one higher) resumes from that checkpoint. The job and
its restart count (:class:`ckpt.ranks.SlurmJob`) name the run in the checkpoint root's lease
and run log, and let the requeued run take over at once the lease of a run killed before it
could release it.
"""

from __future__ import annotations

import os
import re
from typing import Mapping, MutableMapping

from ckpt.ranks import slurm_int

__all__ = ["export_torch_env", "first_host", "torch_env", "MASTER_PORT_BASE",
           "MASTER_PORT_SPAN"]

# MASTER_PORT when the batch script sets none: stable across a job's requeues, different for
# jobs whose ids differ by less than the span, and below Linux's ephemeral range (32768-).
MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 10000


_BRACKET = re.compile(r"\[([^\]]*)\]")


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist expression (``node[03-08,11],gpu7`` -> ``node03``,
    ``rack[1-2]-n[5-6]`` -> ``rack1-n5``), as ``scontrol show hostnames`` lists it first.

    Raises ValueError naming the expression when it has no host."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            end = i
            break
    head = nodelist[:end].strip()

    def lowest(m: re.Match) -> str:
        return m.group(1).split(",")[0].split("-")[0].strip()

    host = _BRACKET.sub(lowest, head)
    if not host or "[" in host or "]" in host:
        raise ValueError(f"cannot read the first host of the Slurm node list {nodelist!r}; "
                         f"set MASTER_ADDR to the first node's address in the batch script")
    return host


def torch_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """torch's ``env://`` variables for a task that srun started directly, those missing
    from ``environ`` only (see the module's table). Empty outside an srun step of two or
    more tasks."""
    environ = os.environ if environ is None else environ
    if (environ.get("SLURM_STEP_ID", "batch") in ("batch", "extern")
            or not environ.get("SLURM_STEP_NUM_TASKS")
            or slurm_int(environ, "SLURM_STEP_NUM_TASKS") < 2):
        return {}
    wanted = {
        "RANK": lambda: str(slurm_int(environ, "SLURM_PROCID")),
        "WORLD_SIZE": lambda: str(slurm_int(environ, "SLURM_STEP_NUM_TASKS")),
        "LOCAL_RANK": lambda: str(slurm_int(environ, "SLURM_LOCALID")),
        "GROUP_RANK": lambda: str(slurm_int(environ, "SLURM_NODEID")),
        "MASTER_ADDR": lambda: first_host(environ.get("SLURM_STEP_NODELIST")
                                          or environ.get("SLURM_JOB_NODELIST", "")),
        "MASTER_PORT": lambda: str(MASTER_PORT_BASE
                                   + slurm_int(environ, "SLURM_JOB_ID") % MASTER_PORT_SPAN),
    }
    return {name: make() for name, make in wanted.items() if not environ.get(name)}


def export_torch_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set :func:`torch_env`'s variables in ``environ`` (default ``os.environ``); returns
    what it set. Raises ValueError naming the variable when Slurm's are malformed."""
    environ = os.environ if environ is None else environ
    env = torch_env(environ)
    environ.update(env)
    return env
