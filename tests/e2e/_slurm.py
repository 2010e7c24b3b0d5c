"""A real single-node Slurm cluster on this host, for the tests of the Slurm recipes.

:class:`SlurmCluster` starts munged, slurmctld and slurmd in the foreground (``-F``/``-D``) as
child processes of the test, with every file they use (munge key and socket, slurm.conf,
state, spool, logs) in a temp folder and their ports free ones; one node, this host, with 2
CPUs. ``stop`` cancels the jobs submitted through it, waits for them to leave, then stops the
three daemons by pid. :func:`missing` says in one line why no cluster can run here (Slurm or
munge not installed, not root), for a skip; ``scripts/test.sh`` installs them as root.

slurm.conf is set for a container and for fast tests: process tracking by /proc (no
cgroups), no task plugin, a requeued job may start again 5 s after (``cred_expire``, default
120 s), time limits kill 5 s after their SIGTERM (``KillWait``). slurmctld tests the jobs'
time limits (and sends ``--signal`` warnings) once every 30 s; it logs each round at debug2,
and :meth:`SlurmCluster.next_time_limit_check` reads when the next one comes.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.dist import free_port

__all__ = ["SlurmCluster", "SlurmJobRun", "missing", "read_events", "TIME_LIMIT_PERIOD"]

_DAEMONS = ("munged", "slurmctld", "slurmd")
_CLIENTS = ("sbatch", "scontrol", "scancel", "squeue", "sinfo")
_SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")
TIME_LIMIT_PERIOD = 30.0  # slurmctld's PERIODIC_TIMEOUT: how often it tests time limits
_CHECK_LINE = re.compile(r"^\[(\S+)\] debug2: Testing job time limits", re.M)


def _which(name: str) -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", ""), *_SBIN])
    return shutil.which(name, path=path)


def missing() -> str | None:
    """Why no cluster can be started here (one line), or None."""
    absent = [n for n in (*_DAEMONS, *_CLIENTS) if _which(n) is None]
    if absent:
        return (f"Slurm is not installed ({', '.join(absent)} missing): as root, "
                f"apt-get install slurm-wlm munge (scripts/test.sh does)")
    if os.geteuid() != 0:
        return "the Slurm tests start slurmd, which runs jobs as their user: run them as root"
    return None


@dataclass
class SlurmJobRun:
    """One submitted batch job: its id, and its record as ``scontrol show job`` gives it."""

    cluster: "SlurmCluster"
    job_id: str
    output: Path

    def info(self) -> dict[str, str]:
        out = self.cluster.command("scontrol", "show", "job", "-o", self.job_id).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    @property
    def state(self) -> str:
        return self.info().get("JobState", "?")

    def wait_state(self, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        """Block until the job is in one of ``states``; fail with its output otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"job {self.job_id} not {'/'.join(states)} within "
                                     f"{timeout:.0f}s: {info.get('JobState')} "
                                     f"({info.get('Reason')})\n{self.tail()}")
            time.sleep(0.2)

    def text(self) -> str:
        """The job's output so far ("" before slurmd made the file)."""
        try:
            return self.output.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, n: int = 6000) -> str:
        return f"--- job {self.job_id} output ({self.output})\n{self.text()[-n:]}\n" + \
            self.cluster.log_tail()


def read_events(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a trainer's JSONL event log so far."""
    if not path.exists():
        return []
    data = path.read_bytes()
    return [json.loads(line) for line in data[:data.rfind(b"\n") + 1].splitlines()
            if line.strip()]


class SlurmCluster:
    """munged + slurmctld + slurmd on this host; ``command`` runs a client against it."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="slurm-"))
        os.chmod(self.dir, 0o700)  # munged refuses a socket folder others may write
        self.node = socket.gethostname()
        self.conf = self.dir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.env["PATH"] = os.pathsep.join([self.env.get("PATH", ""), *_SBIN])
        self.procs: dict[str, subprocess.Popen] = {}
        self.jobs: list[str] = []
        self.started_unix = 0.0

    # -- life ----------------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> "SlurmCluster":
        d = self.dir
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        socket_path = d / "munge.socket"
        self._spawn("munged", "-F", "--force", f"--key-file={key}", f"--socket={socket_path}",
                    f"--pid-file={d / 'munged.pid'}", f"--seed-file={d / 'munged.seed'}",
                    f"--log-file={d / 'munged.log'}")
        self._until(lambda: socket_path.exists(), timeout, "munged's socket")
        (d / "state").mkdir()
        (d / "spool").mkdir()
        self.conf.write_text(self._slurm_conf(socket_path))
        self.started_unix = time.time()
        self._spawn("slurmctld", "-D", "-i", "-f", str(self.conf))
        self._spawn("slurmd", "-D", "-N", self.node, "-f", str(self.conf))
        self._until(self._node_idle, timeout, f"node {self.node} idle in sinfo")
        return self

    def _slurm_conf(self, munge_socket: Path) -> str:
        d = self.dir
        return "\n".join([
            "ClusterName=ckpt-tests",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket},cred_expire=5",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'slurmd.log'}",
            "SlurmctldDebug=debug2",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=1",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",  # 2 CPUs, whatever this host has
            "ReturnToService=2",
            "KillWait=5",
            "MinJobAge=600",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN",
            "PartitionName=tests Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            ""])

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.dir / f"{name}.out", "wb")
        self.procs[name] = subprocess.Popen([_which(name) or name, *args], env=self.env,
                                            stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def _until(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"Slurm test cluster: no {what} within {timeout:.0f}s"
                                   f"{' (' + ', '.join(dead) + ' exited)' if dead else ''}\n"
                                   + self.log_tail())
            time.sleep(0.2)

    def _node_idle(self) -> bool:
        out = self.command("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split()
        return out == ["idle"]

    def stop(self) -> None:
        """Cancel the jobs submitted here and wait for them to end; stop the daemons by pid."""
        if self.jobs and self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            self.command("scancel", *self.jobs, check=False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.command(
                    "squeue", "-h", "-t", "PD,R,CG,S", "-o", "%i", check=False).stdout.strip():
                time.sleep(0.2)
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=15)
        self.procs.clear()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- use -----------------------------------------------------------------------------------
    def command(self, *argv: str, check: bool = True, env: dict[str, str] | None = None,
                timeout: float = 30.0) -> subprocess.CompletedProcess:
        out = subprocess.run(list(argv), env={**self.env, **(env or {})}, capture_output=True,
                             text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited with {out.returncode}: "
                                 f"{out.stderr.strip()}\n{self.log_tail()}")
        return out

    def submit(self, script: Path, *args: str, sbatch: tuple[str, ...] = (),
               env: dict[str, str] | None = None, cwd: Path | None = None,
               output: Path) -> SlurmJobRun:
        """``sbatch [sbatch options] script [args]``, the job's output into ``output``."""
        out = self.command("sbatch", "--parsable", f"--output={output}", *sbatch,
                           *(["--chdir", str(cwd)] if cwd else []), str(script), *args,
                           env=env)
        job_id = out.stdout.strip().split(";")[0]
        self.jobs.append(job_id)
        return SlurmJobRun(self, job_id, output)

    def next_time_limit_check(self) -> float:
        """Unix time of slurmctld's next round of time-limit tests (its log has the last)."""
        log = self.dir / "slurmctld.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        rounds = _CHECK_LINE.findall(text)
        last = (datetime.datetime.fromisoformat(rounds[-1]).timestamp() if rounds
                else self.started_unix)
        now = time.time()
        while last + TIME_LIMIT_PERIOD < now:
            last += TIME_LIMIT_PERIOD
        return last + TIME_LIMIT_PERIOD

    def log_tail(self, n: int = 3000) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "munged.out", "slurmctld.out", "slurmd.out"):
            p = self.dir / name
            if p.exists():
                text = p.read_text(errors="replace")
                if name == "slurmctld.log":  # debug2 is chatty: the lines that say something
                    text = "\n".join(line for line in text.splitlines()
                                     if "debug" not in line)
                parts.append(f"--- {name} (tail)\n{text[-n:]}")
        return "\n".join(parts)
