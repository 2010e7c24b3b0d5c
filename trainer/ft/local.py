"""A lighthouse and every replica group of a job on this machine: ``python -m trainer ft-local``.

For trying fault tolerance on one host, and what the demonstration (scripts/ft_demo.sh),
the goodput benchmark and the end-to-end tests drive::

    python -m trainer ft-local --groups 2 --out runs/ft --config configs/tiny.toml \\
        --checkpoint.root=runs/ft/ckpt

starts ``python -m trainer lighthouse`` on ``--port`` (default 29510) of loopback
(127.0.0.1: nothing off this host reaches it), then one
``torchrun --standalone --nproc-per-node R --max-restarts K -m trainer`` per replica group
(``--fault_tolerance.enabled=true --fault_tolerance.group_id=g`` and the lighthouse address
added to the arguments), each in its own session, logging to ``OUT/g<g>.log`` and its rank
0's events to ``OUT/g<g>.jsonl``; it waits for every group and exits with the worst exit
status. On several machines, run the lighthouse and each group's torchrun by hand instead
(docs/trainer.md).

:class:`LocalReplicaGroups` is the same as a class: start, watch events, SIGKILL a worker,
wait, stop. It only ever signals the processes it started (by process group).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ckpt.errors import OneLineArgumentParser
from trainer.ft.lighthouse import probe

__all__ = ["LocalReplicaGroups", "main", "DEFAULT_PORT", "free_port", "worker_pids"]

DEFAULT_PORT = 29510
_LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


def _env_of(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def worker_pids(agent_pid: int) -> dict[int, int]:
    """``{rank: pid}`` of the live workers of the torchrun agent ``agent_pid``."""
    out = {}
    for pid in _children(agent_pid):
        rank = _env_of(pid).get("RANK")
        if rank is not None:
            out[int(rank)] = pid
    return out


class _Events:
    """The JSONL event log of one group's rank 0, read incrementally (whole lines only)."""

    def __init__(self, path: Path):
        self.path, self._offset, self.items = path, 0, []

    def read(self) -> list[dict[str, Any]]:
        if self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            for line in data[:end].splitlines():
                if line.strip():
                    self.items.append(json.loads(line))
            self._offset += end
        return self.items


class LocalReplicaGroups:
    """A lighthouse plus ``groups`` replica groups of ``nproc`` ranks each, on loopback (the
    lighthouse listens on 127.0.0.1 whatever ``fault_tolerance.lighthouse_bind`` says).

    ``trainer_args``: the trainer's arguments (``--config FILE`` and overrides), the same for
    every group; ``parallel.dp_replicate`` and the ``fault_tolerance`` keys that say who is
    who are added, and ``group_args(g)`` when given (e.g. a metrics port per group).
    ``python``: the interpreter (default this one); ``env``: the processes' environment
    (default this one's).
    """

    def __init__(self, trainer_args: list[str], *, groups: int, out: str | Path,
                 nproc: int = 1, max_restarts: int = 3, port: int | None = None,
                 python: str | None = None, env: dict[str, str] | None = None,
                 group_args: Callable[[int], list[str]] | None = None):
        self.args, self.groups, self.nproc = list(trainer_args), groups, nproc
        self.group_args = group_args or (lambda g: [])
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.max_restarts, self.port = max_restarts, port or DEFAULT_PORT
        self.python = python or sys.executable
        self.env = dict(env if env is not None else os.environ)
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.url = f"http://{_LOOPBACK}:{self.port}"
        self.lighthouse: subprocess.Popen | None = None
        self.agents: dict[int, subprocess.Popen] = {}
        self._events = {g: _Events(self.out / f"g{g}.jsonl") for g in range(groups)}
        self._logs: list[Any] = []

    def _common(self) -> list[str]:
        return [*self.args, f"--parallel.dp_replicate={self.groups}",
                f"--fault_tolerance.lighthouse={self.url}"]

    def _spawn(self, argv: list[str], log_name: str) -> subprocess.Popen:
        log = open(self.out / log_name, "a")
        self._logs.append(log)
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    # -- starting ------------------------------------------------------------------------------
    def start_lighthouse(self, timeout: float = 60.0) -> None:
        """Start the lighthouse, listening on loopback only (every group is on this host),
        and wait until it answers."""
        self.lighthouse = self._spawn([self.python, "-m", "trainer", "lighthouse",
                                       *self._common(),
                                       f"--fault_tolerance.lighthouse_bind={_LOOPBACK}"],
                                      "lighthouse.log")
        deadline = time.monotonic() + timeout
        while not probe(self.url, timeout=1.0)[0]:
            if self.lighthouse.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the lighthouse on port {self.port} did not start (exit "
                                   f"{self.lighthouse.poll()}); see "
                                   f"{self.out / 'lighthouse.log'}")
            time.sleep(0.2)

    def start_group(self, g: int) -> subprocess.Popen:
        argv = [self.python, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={self.nproc}", f"--max-restarts={self.max_restarts}",
                "--monitor-interval=0.5", "-m", "trainer", *self._common(),
                "--fault_tolerance.enabled=true", f"--fault_tolerance.group_id={g}",
                f"--metrics.jsonl_path={self.out / f'g{g}.jsonl'}", *self.group_args(g)]
        self.agents[g] = self._spawn(argv, f"g{g}.log")
        return self.agents[g]

    def start(self) -> "LocalReplicaGroups":
        self.start_lighthouse()
        for g in range(self.groups):
            self.start_group(g)
        return self

    # -- watching ------------------------------------------------------------------------------
    def events(self, g: int) -> list[dict[str, Any]]:
        """Every event group ``g``'s rank 0 logged so far (all attempts)."""
        return self._events[g].read()

    def steps(self, g: int) -> list[dict[str, Any]]:
        """Group ``g``'s ``ft_step`` events that committed."""
        return [e for e in self.events(g) if e["kind"] == "ft_step" and e["committed"]]

    def last_step(self, g: int) -> int:
        s = self.steps(g)
        return s[-1]["step"] if s else -1

    def writer(self) -> int | None:
        """The group whose rank 0 holds the lease now, by the groups' own events (None
        while none does)."""
        latest: tuple[float, int] | None = None
        for g in range(self.groups):
            for e in self.events(g):
                if e["kind"] == "ft_writer" and e["role"] == "writer" and \
                        (latest is None or e["time"] > latest[0]):
                    latest = (e["time"], g)
        if latest is None:
            return None
        g = latest[1]
        lost = [e for e in self.events(g) if e["kind"] == "ft_writer" and e["time"] > latest[0]]
        return None if lost else g

    def workers(self, g: int) -> dict[int, int]:
        """``{rank: pid}`` of group ``g``'s live workers."""
        agent = self.agents.get(g)
        if agent is None or agent.poll() is not None:
            return {}
        return worker_pids(agent.pid)

    def kill_worker(self, g: int, rank: int = 0) -> int:
        """SIGKILL rank ``rank`` of group ``g``; returns its pid."""
        pid = self.workers(g)[rank]
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait_for(self, pred, timeout: float, what: str, poll: float = 0.05) -> Any:
        """Poll ``pred()`` until it returns something truthy; raise with the logs' tails."""
        deadline = time.monotonic() + timeout
        while True:
            got = pred()
            if got:
                return got
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout:.0f}s\n{self.tails()}")
            time.sleep(poll)

    def tails(self, n: int = 3000) -> str:
        out = []
        for name in ["lighthouse", *(f"g{g}" for g in range(self.groups))]:
            path = self.out / f"{name}.log"
            text = path.read_text(errors="replace") if path.exists() else ""
            out.append(f"--- {name}.log (tail)\n{text[-n:]}")
        return "\n".join(out)

    # -- ending --------------------------------------------------------------------------------
    def wait(self, timeout: float) -> dict[int, int | None]:
        """Wait for every group's torchrun to exit; ``{group: exit status}`` (None: still
        running at the deadline, then stopped)."""
        deadline = time.monotonic() + timeout
        codes: dict[int, int | None] = {}
        for g, agent in self.agents.items():
            try:
                codes[g] = agent.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[g] = None
        return codes

    def stop(self) -> None:
        """SIGTERM every process group started here (a torchrun agent stops its workers),
        then SIGKILL what is left, the workers too (they run in sessions of their own)."""
        procs = [p for p in [self.lighthouse, *self.agents.values()] if p is not None]
        workers = [pid for g in self.agents for pid in self.workers(g).values()]
        for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, sig)
                    except ProcessLookupError:
                        pass
            if sig == signal.SIGKILL:
                for pid in workers:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + grace
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.1)
        for log in self._logs:
            log.close()

    def __enter__(self) -> "LocalReplicaGroups":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str]) -> int:
    """``python -m trainer ft-local``: see the module docstring."""
    parser = OneLineArgumentParser(prog="python -m trainer ft-local", add_help=False,
                                   allow_abbrev=False)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=7 * 24 * 3600)
    opts, rest = parser.parse_known_args(argv)
    with LocalReplicaGroups(rest, groups=opts.groups, out=opts.out, nproc=opts.nproc,
                            max_restarts=opts.max_restarts, port=opts.port) as job:
        job.start()
        print(f"lighthouse {job.url}; {opts.groups} replica groups; logs in {opts.out}",
              flush=True)
        codes = job.wait(opts.timeout)
    print(f"exit status by replica group: {codes}", flush=True)
    return max((1 if c is None else c) for c in codes.values())
