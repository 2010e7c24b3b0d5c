"""Run the trainer as real processes (alone or under torchrun), watch its events, kill it.

Helpers of the end-to-end tests. A :class:`Job` is one launch of ``python -m trainer`` (one
process) or of ``torchrun ... -m trainer`` (an elastic agent plus one worker per rank); its
stdout/stderr go to files, and its rank-0 event log (``--metrics.jsonl_path``) can be
watched while it runs, so a test can act at a chosen step: SIGKILL the whole job, SIGKILL
or SIGSTOP one worker. :func:`straight_run` caches uninterrupted reference runs for the
whole pytest session (test files share them, and so do pytest-xdist's workers).
:func:`assert_same_checkpoint` compares two final checkpoints, consolidated, bit for bit.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from tests.dist import free_port as _free_port
from trainer.ft.local import worker_pids

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"
ABORT_MARK = "terminate called"  # gloo's abort at interpreter exit (PLATFORM.md)

# The job most e2e tests run: the tiny config for 30 steps, a checkpoint every 7 (7, 14, 21,
# 28 and the final 30), all kept. The LR schedule depends on training.steps: every launch
# compared with another uses the same value.
STEPS = 30
INTERVAL = 7
COMMON = (f"--training.steps={STEPS}", f"--checkpoint.interval={INTERVAL}",
          "--checkpoint.keep_last=0")

__all__ = ["ROOT", "TINY", "STEPS", "INTERVAL", "COMMON", "ABORT_MARK", "Job", "base_env",
           "trainer_argv", "straight_run", "loss_history", "all_losses",
           "assert_same_checkpoint", "flat_checkpoint", "free_port", "node_argv",
           "multinode_env"]


def base_env(**extra: str) -> dict[str, str]:
    """The test process's environment plus PYTHONPATH, without torchrun's or Slurm's job
    variables (a suite run inside a Slurm allocation must not make its jobs look like srun
    steps; ``SLURM_CONF``, which names a cluster, stays)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "MASTER_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                "GROUP_RANK", "ROLE_", "SLURM_")) or k == "SLURM_CONF"}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"]
                                     if env.get("PYTHONPATH") else "")
    # The trainer must recover from torchrun restarts by itself (a PrefixStore per attempt),
    # so the tests never rely on this workaround from the environment.
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def trainer_argv(*overrides: str, nproc: int | None = None, max_restarts: int = 0,
                 config: Path = TINY, script: Path | None = None) -> list[str]:
    """The command line of one job: ``python -m trainer`` alone (``nproc`` None) or under
    ``torchrun --standalone --nproc-per-node nproc --max-restarts max_restarts``. ``script``
    runs a wrapper file instead of ``-m trainer`` (same arguments)."""
    target = [str(script)] if script is not None else ["-m", "trainer"]
    args = ["--config", str(config), *overrides]
    if nproc is None:
        return [sys.executable, *target, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
            "--monitor-interval", "0.5", *target, *args]


class Job:
    """One launch of the trainer, in its own session; stdout/stderr into ``log_dir``."""

    def __init__(self, argv: list[str], log_dir: Path, name: str = "job",
                 jsonl: Path | None = None, env: dict[str, str] | None = None):
        self.argv, self.name, self.jsonl = argv, name, jsonl
        log_dir.mkdir(parents=True, exist_ok=True)
        self.out_path = log_dir / f"{name}.out"
        self.err_path = log_dir / f"{name}.err"
        self._out = open(self.out_path, "w")
        self._err = open(self.err_path, "w")
        self._events: list[dict[str, Any]] = []
        self._offset = 0
        self.last_index = -1
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env or base_env(), stdout=self._out,
                                     stderr=self._err, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    # -- output ------------------------------------------------------------------------------
    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def tails(self, n: int = 4000) -> str:
        return (f"--- {self.name}: {' '.join(self.argv[-12:])}\n--- stdout (tail)\n"
                f"{self.stdout[-n:]}\n--- stderr (tail)\n{self.stderr[-n:]}")

    def events(self) -> list[dict[str, Any]]:
        """Events appended to the JSONL log so far (by this job and earlier ones)."""
        if self.jsonl is None or not self.jsonl.exists():
            return self._events
        with open(self.jsonl, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        for line in data[:end].splitlines():
            if line.strip():
                self._events.append(json.loads(line))
        self._offset += end
        return self._events

    # -- waiting -----------------------------------------------------------------------------
    def wait(self, timeout: float = 180.0) -> int:
        """Wait for the job to exit; on timeout kill it and fail with its output."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(f"{self.name} did not finish within {timeout:.0f}s\n"
                                 + self.tails()) from None
        finally:
            self._out.flush()
            self._err.flush()
        return rc

    def wait_ok(self, timeout: float = 180.0, code: int = 0) -> "Job":
        rc = self.wait(timeout)
        assert rc == code, f"{self.name} exited with {rc}, expected {code}\n{self.tails()}"
        return self

    def wait_event(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 120.0,
                   what: str = "event", poll: float = 0.005, since: int = 0) -> dict[str, Any]:
        """Block until an event matching ``pred`` appears in the JSONL log at index ``since``
        or later; returns it (its index is then ``self.last_index``)."""
        deadline = time.monotonic() + timeout
        seen = since
        while True:
            events = self.events()
            for i in range(seen, len(events)):
                if pred(events[i]):
                    self.last_index = i
                    return events[i]
            seen = max(seen, len(events))
            if self.proc.poll() is not None:
                # Read what the job wrote just before it left.
                events = self.events()
                for i in range(seen, len(events)):
                    if pred(events[i]):
                        self.last_index = i
                        return events[i]
                raise AssertionError(f"{self.name} exited ({self.proc.returncode}) before "
                                     f"{what}\n{self.tails()}")
            if time.monotonic() > deadline:
                self.kill_all()
                raise AssertionError(f"no {what} within {timeout:.0f}s\n{self.tails()}")
            time.sleep(poll)

    def wait_step(self, step: int, timeout: float = 120.0, since: int = 0) -> dict[str, Any]:
        return self.wait_event(lambda e: e["kind"] == "train_step" and e["step"] >= step,
                               timeout, f"train_step {step}", since=since)

    # -- processes ---------------------------------------------------------------------------
    def workers(self) -> dict[int, int]:
        """``{rank: pid}`` of the live trainer processes (the agent's children under torchrun)."""
        if "torch.distributed.run" not in self.argv:
            return {0: self.proc.pid} if self.proc.poll() is None else {}
        return worker_pids(self.proc.pid)

    def wait_workers(self, n: int, timeout: float = 60.0,
                     exclude: Iterable[int] = ()) -> dict[int, int]:
        """Wait until ``n`` workers run, none of whose pids is in ``exclude``."""
        deadline = time.monotonic() + timeout
        exclude = set(exclude)
        while time.monotonic() < deadline:
            w = self.workers()
            if len(w) == n and not exclude & set(w.values()):
                return w
            time.sleep(0.05)
        raise AssertionError(f"{self.name}: {n} new workers did not appear\n{self.tails()}")

    def signal_rank(self, rank: int, sig: int = signal.SIGKILL) -> int:
        pid = self.workers()[rank]
        os.kill(pid, sig)
        return pid

    def kill_all(self) -> None:
        """SIGKILL every trainer process and the agent at once (a machine failure)."""
        pids = list(self.workers().values())
        if self.proc.poll() is None:
            pids.append(self.proc.pid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        # Workers live in their own sessions; reap any left (they are not our children).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_is_alive(p) for p in pids):
            time.sleep(0.05)


def _is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


# -- results --------------------------------------------------------------------------------
def loss_history(events: list[dict[str, Any]]) -> dict[int, float]:
    """``{step: loss}`` from ``train_step`` events; the last occurrence of a step wins."""
    return {e["step"]: e["loss"] for e in events if e["kind"] == "train_step"}


def all_losses(events: list[dict[str, Any]]) -> dict[int, list[float]]:
    """Every logged loss per step (a step replayed after a resume appears more than once)."""
    out: dict[int, list[float]] = {}
    for e in events:
        if e["kind"] == "train_step":
            out.setdefault(e["step"], []).append(e["loss"])
    return out


def flat_checkpoint(root: Path | str, step: int) -> dict[str, Any]:
    """Checkpoint ``step`` under ``root`` consolidated to full values, keyed by dotted path."""
    from ckpt.export._consolidate import consolidate

    sd, manifest = consolidate(str(root), step)
    assert manifest.step == step
    out: dict[str, Any] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(value, (list, tuple)) and any(isinstance(v, (dict, torch.Tensor))
                                                      for v in value):
            for i, v in enumerate(value):
                walk(v, f"{prefix}[{i}]")
        else:
            out[prefix] = value

    walk(sd, "")
    return out


def assert_same_checkpoint(root_a: Path | str, root_b: Path | str, step: int, *,
                           skip: tuple[str, ...] = ()) -> int:
    """Every value of checkpoint ``step`` equal in both roots: tensors with ``torch.equal``
    (bit for bit), everything else with ``==``. Keys starting with ``skip`` are ignored.
    Returns the number of tensors compared."""
    a, b = flat_checkpoint(root_a, step), flat_checkpoint(root_b, step)
    keys_a = {k for k in a if not k.startswith(skip)}
    keys_b = {k for k in b if not k.startswith(skip)}
    assert keys_a == keys_b, (sorted(keys_a ^ keys_b))[:20]
    differ, num_tensors = [], 0
    for k in sorted(keys_a):
        va, vb = a[k], b[k]
        if isinstance(va, torch.Tensor):
            num_tensors += 1
            if not (isinstance(vb, torch.Tensor) and va.dtype == vb.dtype
                    and va.shape == vb.shape and torch.equal(va, vb)):
                differ.append(k)
        elif va != vb:
            differ.append(f"{k}: {va!r} != {vb!r}")
    assert not differ, f"{len(differ)} values differ at step {step}: {differ[:10]}"
    assert num_tensors > 0
    return num_tensors


# -- uninterrupted reference runs, shared by the whole session ---------------------------------
_STRAIGHT: dict[tuple, tuple[Path, list[dict[str, Any]]]] = {}
_TMP: list[str] = []
# A folder every pytest-xdist worker of this run sees (tests/conftest.py sets it to the run's
# temp folder, which pytest cleans up with its other temp folders); unset in a plain run.
SHARED_TMP_ENV = "E2E_SHARED_TMP"


@atexit.register
def _cleanup() -> None:
    for d in _TMP:
        shutil.rmtree(d, ignore_errors=True)


def straight_run(overrides: tuple[str, ...], nproc: int | None = 2,
                 timeout: float = 180.0) -> tuple[Path, list[dict[str, Any]]]:
    """``(checkpoint root, events)`` of an uninterrupted run (run once per session: under
    pytest-xdist, once for all workers, in the folder ``$E2E_SHARED_TMP`` names). The root
    is read-only to its users."""
    key = (tuple(overrides), nproc)
    if key not in _STRAIGHT:
        shared = os.environ.get(SHARED_TMP_ENV)
        if not shared:
            d = Path(tempfile.mkdtemp(prefix="e2e-straight-"))
            _TMP.append(str(d))
            _STRAIGHT[key] = _run_straight(d, overrides, nproc, timeout)
        else:
            name = hashlib.sha256(json.dumps([list(overrides), nproc]).encode()).hexdigest()
            d = Path(shared) / f"e2e-straight-{name[:16]}"
            # One worker runs it; the others wait for it on the lock, then read its result.
            with open(f"{d}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                done = d / "done"
                if not done.exists():
                    shutil.rmtree(d, ignore_errors=True)  # a run that failed part-way
                    d.mkdir()
                    _run_straight(d, overrides, nproc, timeout)
                    done.write_text("")
            events = [json.loads(line) for line in
                      (d / "events.jsonl").read_text().splitlines() if line.strip()]
            _STRAIGHT[key] = (d / "ckpt", events)
    return _STRAIGHT[key]


def _run_straight(d: Path, overrides: tuple[str, ...], nproc: int | None,
                  timeout: float) -> tuple[Path, list[dict[str, Any]]]:
    root, jsonl = d / "ckpt", d / "events.jsonl"
    job = Job(trainer_argv(*overrides, f"--checkpoint.root={root}",
                           f"--metrics.jsonl_path={jsonl}", nproc=nproc),
              d, "straight", jsonl)
    job.wait_ok(timeout)
    assert ABORT_MARK not in job.stderr, job.tails()
    return root, job.events()


# -- several nodes on loopback ------------------------------------------------------------------
def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a rendezvous endpoint):
    :func:`tests.dist.free_port`."""
    return _free_port()


def node_argv(*overrides: str, nnodes: int, port: int, run_id: str, local_addr: str,
              max_restarts: int = 3, is_host: bool | None = None,
              config: Path = TINY) -> list[str]:
    """The command line of one node of an ``nnodes``-node job (one worker per node) that
    meets at the c10d rendezvous ``127.0.0.1:port``. ``local_addr`` names the node (nodes
    are ranked by it: the lowest gets group rank 0); ``is_host`` says whether this launcher
    serves the rendezvous store (None: the first one to bind)."""
    conf = [] if is_host is None else ["--rdzv-conf", f"is_host={str(is_host).lower()}"]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, *conf,
            "--local-addr", local_addr, "--max-restarts", str(max_restarts),
            "--monitor-interval", "0.5", "-m", "trainer", "--config", str(config), *overrides]


def multinode_env(**extra: str) -> dict[str, str]:
    """``base_env`` for a node of a multi-node job: the agents' shared store off (each
    rendezvous round gets a new store; see docs/trainer.md, "Multi-node")."""
    return base_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **extra)
