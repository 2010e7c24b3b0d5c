"""A manager's saves persisted by a writer process beside the training process.

With ``ManagerOptions(writer="process")`` the training process only stages (the
stall, into shared host memory: ``StagingBuffers(shared=True)``) and hands the save off; a
long-lived writer process per rank writes the files, checksums them, runs the save's
collectives (DCP's planning and the commit's gather) on a gloo group of its own, retries,
and commits the manifest. The training process keeps the lease (its heartbeat), the gate,
retention's decisions and the bookkeeping after a commit, which are small.

States of one rank's writer, as its :class:`WriterProcess` (the training side) sees it::

    (none) --run--> STARTED --hand off--> SAVING --done--> STARTED --close--> (none)
                       ^                     |
                       |                  died (EOF on its socket, its pidfd readable)
                       |                     v
                       +----start------ DEAD: the save is reported failed and a new writer
                                        is started at once (else by the next save)

After a commit the coordinator's writer may go STARTED --retain--> RETAINING --retained-->
STARTED (retention's deletions); one that dies there is a ``retention_failed`` and a new
writer is started at once, as above.

Protocol: one socket pair per writer; every message is one JSON object (``send_bytes`` of a
``multiprocessing.connection.Connection``: a length, then the bytes). Nothing is pickled.

=====================  ===========================================================
training -> writer     ``init`` (once: storage, rank, group rendezvous, retry settings),
                       ``save`` (a staged copy as :meth:`ckpt.dcp.StagingBuffers.handoff`
                       describes it, step, metadata, lineage, lease identity),
                       ``retain`` (retention's plan, after a commit), ``abandon``
                       (``close(flush=False)`` during a save), ``reply`` (to a lease call),
                       ``exit``
writer -> training     ``event`` (re-emitted on the manager's bus by ``EventBus.forward``,
                       which refuses a kind or field not in ``ckpt.events.KINDS``),
                       ``lease`` (a call on the lease, answered by ``reply``),
                       ``committed_id`` (a commit the lease renewal proved), ``attempt``
                       (an attempt's save id, written before its marker), ``done`` (the
                       save's outcome), ``retained`` (the steps retention deleted or found
                       gone)
=====================  ===========================================================

Same guarantees as the persist thread: the writer runs the same ``Persister`` (attempts,
retries, events, abandon checks) through a ``Lifecycle`` whose lease calls go to the
training process's one ``Lease`` (one lock, one heartbeat: a second holder object would see
the other's renewals as a takeover). A writer that dies is noticed by the training side at
once (its socket ends, its pidfd becomes readable: never a hang) and the save is reported as
a failed one (a final ``save_failed`` event, ``wait()`` raises) unless the coordinator reads
its manifest back committed (:meth:`ckpt.root.Lifecycle.committed_by`, as a failed attempt
after its commit is); the other ranks, whose writers then failed the save, read that
manifest back too and end the save as the coordinator does. A training process that dies takes its writer along: the writer exits
when its socket ends, whatever it was doing.

The writers' group: the job's rendezvous store (``MASTER_ADDR``/``MASTER_PORT``, the one
``torchrun`` and ``env://`` provide), under a prefix of this manager's own. At each save
(numbered alike on every rank) every writer counts itself under the id of the group it is in
(``gid``; a new writer is in none): when all ``world_size`` writers count under one id, the
group is kept; otherwise (a writer was restarted) every writer joins a new group named after
this save. Every writer sees the same counts, so all keep or all change together, whichever
rank was restarted and whatever the others concluded about the previous save. The wait at
the rendezvous (the count, forming a group) is bounded by the lease TTL: a writer not there
by then fails the save on the ranks that wait, which leave their group, and the next save
forms a new one (the save's collectives wait as long as a thread-mode save's do).

Retention: its policies are the caller's objects (they do not cross a process boundary
without pickling), so they decide on the training process's persist thread after the commit,
from the committed steps its life-cycle knows (no request); the plan they make
(:class:`ckpt.job.retention.RetentionPlan`) goes to the writer (``retain``), which verifies
the newest checkpoint and deletes, under the same lease, and answers which steps are gone
(``retained``). The bookkeeping after a commit (events, cadence, history) stays on the
training process's persist thread as in thread mode: no bytes and, but for the history once
a minute, no requests.

No GPU in the writer: it reads the shared host block and nothing else, and is started with
``CUDA_VISIBLE_DEVICES`` empty, so it holds no CUDA context on any GPU. The CUDA calls a
save makes outside the training thread (page-locking the shared block, waiting for the
copies' events before the hand-off) are the training process's, under the staged tensors'
device (:mod:`ckpt.dcp.staging`).

Size: both ends of one protocol (the training side's :class:`WriterProcess`, the writer's
``_Writer``) and the lease and life-cycle stand-ins the writer uses, kept together so that
the messages read in one place.

Limits (refused when the manager is made, naming the option): the state must fit the
staging memory whole (no ``staging_budget_bytes``), the storage must be reachable from
another process (not ``memory://``), no ``span`` (the tiered manager's local tier).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from ckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    FormatVersionError,
    LeaseLostError,
    SaveAbandoned,
    StorageUnavailableError,
)
from ckpt.dcp import (
    SaveCost,
    SavePlanCache,
    SaveRequest,
    SharedBlocks,
    rebuild_staged,
    remove_stale_shared_blocks,
)
from ckpt.events import EventBus
from ckpt.format import Manifest, parse_lineage
from ckpt.job.persist import PersistOutcome, Persister
from ckpt.job.retention import RetentionPlan, carry_out_retention
from ckpt.root import CheckpointStore, Lifecycle
from ckpt.storage import Storage

__all__ = ["WriterProcess", "WRITER_MODES", "check_writer_mode", "main"]

log = logging.getLogger(__name__)

WRITER_MODES = ("thread", "process")
"""Where a manager's saves are persisted: on a thread of the training process (default) or
in a writer process beside it."""



def check_writer_mode(writer: str) -> str:
    """``writer`` when it is one of :data:`WRITER_MODES`; else ``ValueError`` naming it."""
    if writer not in WRITER_MODES:
        raise ValueError(f"writer={writer!r}: expected 'thread' (persist on a thread of the "
                         f"training process) or 'process' (in a writer process beside it)")
    return writer


_EXIT_SECONDS = 30.0  # a writer asked to exit (no save in flight) is killed after this
_COLLECTIVE_SECONDS = 600.0  # a save's collectives wait for the slowest rank's writes
_POLL_SECONDS = 0.2  # how often a waiting training side looks at the abandon flag
_ERRORS = {cls.__name__: cls for cls in (
    CheckpointError, CorruptCheckpointError, FormatVersionError, LeaseLostError,
    SaveAbandoned, StorageUnavailableError, FileExistsError, FileNotFoundError, OSError,
    ValueError, TypeError, RuntimeError)}


def _send(conn: Connection, lock: threading.Lock, message: dict[str, Any]) -> None:
    data = json.dumps(message, default=str).encode()
    with lock:
        conn.send_bytes(data)


def _error_json(exc: BaseException) -> dict[str, str]:
    return {"type": type(exc).__name__, "message": str(exc)}


def _error_from(raw: dict[str, Any] | None) -> BaseException | None:
    """The exception a writer reported (its class when it is one of ours, else a
    ``CheckpointError`` naming it): types decide what an error is, never messages."""
    if raw is None:
        return None
    name, message = str(raw.get("type")), str(raw.get("message"))
    cls = _ERRORS.get(name)
    if cls is not None:
        try:
            return cls(message)
        except TypeError:
            pass
    return CheckpointError(f"{name}: {message}")


class WriterProcess:
    """Persists a manager's saves in a writer process (module docstring); the drop-in for
    :class:`ckpt.job.persist.Persister` in process mode: ``run`` has its signature and
    returns its ``PersistOutcome``, on the manager's persist thread.

    Collective at construction (every rank of ``agreement``'s group makes one at once): the
    coordinator names the writers' rendezvous prefix. ``persister``: the manager's thread
    persister it stands in for (its life-cycle with the storage, lease and lineage, its
    events and retry settings); ``staging``: the manager's staging buffers, made shared here
    (nothing may be allocated in them yet); ``rendezvous_seconds``: how long a writer waits
    for the others at a save's rendezvous (the manager's lease TTL: a writer not there by
    then is taken for gone, as a lease holder silent that long is) before it fails the save.
    """

    def __init__(self, persister: Persister, *, world_size: int, agreement, staging,
                 rendezvous_seconds: float):
        life, events, rank = persister.life, persister.events, persister.rank
        storage = life.storage
        if not storage.shared_across_processes:
            raise ValueError(f"writer='process' cannot save to {storage.url}: another process "
                             f"does not see this root (it lives in this process); use a path "
                             f"or s3:// root, or writer='thread'")
        if staging.budget_bytes is not None:
            raise ValueError("writer='process' with staging_budget_bytes: a state over the "
                             "budget is saved from the live tensors, which a writer process "
                             "cannot read; drop staging_budget_bytes or use writer='thread'")
        if persister.request.span is not None:
            raise ValueError("writer='process' for a node's share of a job-wide checkpoint "
                             "(the local tier of a job of several nodes) is not supported; "
                             "use writer='thread'")
        if staging.shared_path is not None or staging.arena_bytes:
            raise AssertionError("the staging buffers were allocated before the writer")
        # Blocks of this host's training processes that were killed (SIGKILL skips their
        # removal) would fill /dev/shm restart after restart: removed (and logged) here.
        remove_stale_shared_blocks()
        staging.shared = True  # the writer process maps them (ckpt.dcp.SharedBlocks)
        self.life, self.events, self.staging = life, events, staging
        self.rank, self.world_size = rank, world_size
        self.abandon = persister.abandon
        self.group = None  # the manager clears it with its groups; the writers have their own
        rendezvous = None
        if world_size > 1:
            prefix = agreement.broadcast(f"ckpt-writer-{uuid.uuid4().hex}" if rank == 0 else None)
            host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            if not host or not port:
                raise ValueError("writer='process' needs the job's rendezvous store: set "
                                 "MASTER_ADDR and MASTER_PORT (torchrun and env:// do), or "
                                 "use writer='thread'")
            rendezvous = {"host": host, "port": int(port), "prefix": prefix}
        self._init = {"op": "init", "url": storage.url,
                      "storage_options": storage.storage_options or None,
                      "rank": rank, "world_size": world_size, "rendezvous": rendezvous,
                      "rendezvous_seconds": float(rendezvous_seconds),
                      "max_attempts": persister.max_attempts,
                      "retry_backoff_seconds": persister.retry_backoff_seconds,
                      "num_threads": persister.request.num_threads,
                      "layout": persister.request.layout,
                      "event_rank": events.rank}
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._pidfd: int | None = None
        self._lock = threading.Lock()
        self._cost = SaveCost()  # of the save in flight (made again by each run)
        self._num_saves = 0  # saves handed off, alike on every rank (they start together)
        self._held_failure: dict[str, Any] | None = None  # the save in flight's final failure
        self.num_starts = 0  # writer processes started (1 + restarts)
        self._start()

    # -- the process --------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The writer process's id (None when there is none)."""
        return self._proc.pid if self._proc is not None else None

    def _start(self) -> None:
        """Start a writer process and send it ``init`` (it imports in the background)."""
        parent, child = socket.socketpair()
        package_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
            __file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_dir,
                                                          env.get("PYTHONPATH")]))
        env.setdefault("OMP_NUM_THREADS", "1")
        # The writer reads host memory only and makes no CUDA call; with no GPU visible it
        # cannot make one by accident either (which would create a context on GPU 0).
        env["CUDA_VISIBLE_DEVICES"] = ""
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", "from ckpt.job._writer_process import main; "
                 f"main({child.fileno()})"],
                pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL)
        finally:
            child.close()
        self._conn = Connection(parent.detach())
        try:
            self._pidfd = os.pidfd_open(self._proc.pid)
        except (AttributeError, OSError):  # no pidfd: the socket's end says it alone
            self._pidfd = None
        self.num_starts += 1
        _send(self._conn, self._lock, self._init)

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _drop(self) -> str:
        """Forget a writer that died (or is being stopped); say how it ended."""
        proc, conn, pidfd = self._proc, self._conn, self._pidfd
        self._proc = self._conn = self._pidfd = None
        if conn is not None:
            conn.close()
        if pidfd is not None:
            os.close(pidfd)
        if proc is None:
            return "no writer process"
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        return (f"killed by signal {-code}" if code < 0 else f"exited with code {code}")

    def close(self) -> None:
        """Stop the writer process (no save is in flight: the manager waited for it)."""
        if self._proc is None:
            return
        try:
            if self._alive():
                _send(self._conn, self._lock, {"op": "exit"})
                self._proc.wait(timeout=_EXIT_SECONDS)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("writer process %s did not exit (%s): killed", self.pid, exc)
        self._drop()

    # -- one save -----------------------------------------------------------------------------
    def run(self, step: int, staged: dict[str, Any], *, nbytes: int, stall: float,
            user_metadata: dict[str, Any], attachments: dict[str, Any] | None = None,
            host_window_bytes: int | None = None) -> PersistOutcome:
        """Hand the save of ``staged`` (its copies done) to the writer process and wait for
        its outcome, serving its lease calls and re-emitting its events meanwhile. A writer
        that is dead is restarted first; one that dies during the save fails it."""
        assert host_window_bytes is None, "refused at construction"
        t0 = time.monotonic()
        # Made now, on this thread: its totals are what the save takes from this process
        # (the hand-off, the waiting, the bookkeeping after); the writer's phases join it.
        self._cost = SaveCost()
        self._num_saves += 1
        try:
            message = self._save_message(step, staged, nbytes, stall, user_metadata,
                                         attachments)
        except (ValueError, TypeError) as exc:  # the state cannot be described: no writer
            return self._failed(step, exc, nbytes, stall, t0, attempts=0)
        if not self._alive():
            if self._proc is not None:
                log.warning("writer process %s of rank %d had ended (%s): starting another",
                            self.pid, self.rank, self._drop())
            self._start()
        try:
            _send(self._conn, self._lock, message)
        except OSError:
            how = self._drop()
            return self._failed(step, CheckpointError(
                f"the writer process of rank {self.rank} {how} before the save of step {step} "
                f"was handed off"), nbytes, stall, t0, attempts=0)
        self._held_failure = None
        outcome = self._wait(step, nbytes, stall, t0)
        if self.rank != 0 and not outcome.committed and not outcome.already_committed \
                and not self.abandon.is_set():
            outcome = self._as_the_coordinator_ended(step, outcome)
        held, self._held_failure = self._held_failure, None
        if held is not None and not outcome.committed:
            self._forward(held)  # the save failed: its final failure is reported after all
        return outcome

    def _as_the_coordinator_ended(self, step: int, failed: PersistOutcome) -> PersistOutcome:
        """Not the coordinator, the save of ``step`` failed: it may have failed because the
        coordinator's writer died after creating the manifest, which the coordinator then
        counts (read back, :meth:`_died`). Read back the same way: committed here too when
        the manifest that counts at ``step`` (as readers read it) is this run's (its
        lineage's run is this life-cycle's: this run commits a step once, through this
        save's gate). Its writer had failed it first: that final ``save_failed`` was held
        back (:meth:`_serve`) and is dropped, so the save is reported committed only."""
        run = self.life.lineage.run if self.life.lineage is not None else None
        if run is None:
            return failed
        try:
            manifest = self.life.read_committed(step)
        except (CheckpointError, OSError):
            return failed  # nothing counts at the step: failed on every rank
        if manifest.lineage is None or manifest.lineage.run != run:
            return failed
        log.warning("checkpoint step %d: the save failed on rank %d (%s) but the "
                    "coordinator's commit counts (read back): counted committed", step,
                    self.rank, failed.error)
        self.life.adopt_commit(manifest, proven=False)
        return PersistOutcome(True, None, attempts=failed.attempts, retries=failed.retries,
                              persist_seconds=failed.persist_seconds, cost=failed.cost)

    def _save_message(self, step: int, staged: dict[str, Any], nbytes: int, stall: float,
                      user_metadata: dict[str, Any],
                      attachments: dict[str, Any] | None) -> dict[str, Any]:
        lease = self.life.lease
        lineage = self.life.lineage
        return {
            "op": "save", "seq": self._num_saves, "step": step, "state": self.staging.handoff(staged),
            "nbytes": nbytes, "stall": stall, "user_metadata": user_metadata,
            "attachments": {name: ({"bytes": base64.b64encode(v).decode()}
                                   if isinstance(v, bytes) else {"path": v})
                            for name, v in (attachments or {}).items()},
            "lineage": lineage.to_json() if lineage is not None else None,
            "lease": None if lease is None else {
                "holder_id": lease.holder_id, "generation": lease.generation,
                "job_name": lease.job_name, "ttl_seconds": lease.ttl_seconds},
            "abandon": self.abandon.is_set()}

    def _wait(self, step: int, nbytes: int, stall: float, t0: float) -> PersistOutcome:
        """Serve the writer until its ``done`` (or its death)."""
        attempts: list[str] = []
        done = self._serve("done", attempts)
        if done is None:
            return self._died(step, attempts, nbytes, stall, t0)
        return self._outcome(step, done)

    def _serve(self, until: str, attempts: list[str] | None = None) -> dict[str, Any] | None:
        """Serve the writer (its events, lease calls, commit proofs and attempts, these
        appended to ``attempts``) until it sends the message ``until``, returned; None when
        it died first."""
        conn, told_abandon = self._conn, False
        watched: list[Any] = [conn] + ([self._pidfd] if self._pidfd is not None else [])
        while True:
            if self.abandon.is_set() and not told_abandon:
                told_abandon = True
                try:
                    _send(conn, self._lock, {"op": "abandon"})
                except OSError:
                    pass  # dead: found out below
            ready = wait(watched, timeout=_POLL_SECONDS)
            if not ready:
                continue
            try:
                if conn not in ready and not conn.poll():
                    raise EOFError  # the pidfd: the process ended, nothing more to read
                message = json.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return None
            op = message.get("op")
            if op == until:
                return message
            if op == "event":
                if attempts is not None and message["kind"] == "save_failed" \
                        and message["fields"].get("final"):
                    # Held until the save's outcome is settled: a rank whose writer failed
                    # may still count the coordinator's commit (run's read back).
                    self._held_failure = message
                else:
                    self._forward(message)
            elif op == "lease":
                self._answer(conn, message)
            elif op == "committed_id":
                if self.life.lease is not None:
                    self.life.lease.committed_ids.add(message["save_id"])
            elif op == "attempt" and attempts is not None:
                attempts.append(message["save_id"])
            else:
                log.warning("writer process %s sent an unexpected message %r", self.pid, op)

    def _forward(self, message: dict[str, Any]) -> None:
        """Re-emit a writer's event on the manager's bus."""
        try:
            self.events.forward(message["kind"], message.get("step"), message["fields"])
        except ValueError as exc:
            log.warning("writer process %s: %s (dropped)", self.pid, exc)

    # -- retention after a commit -------------------------------------------------------------
    def carry_out(self, plan: RetentionPlan, newest_manifest: Manifest | None) -> bool:
        """Persist thread of the coordinator, after the commit of the save in flight: have
        the writer process carry out retention's ``plan`` (the policies decided it here:
        ``ckpt.job._commits``). The writer verifies the newest checkpoint and deletes
        through its life-cycle under this process's lease (its lease calls answered here,
        as during a save), reporting ``retention_deleted``/``retention_failed`` as events;
        this life-cycle then knows the steps gone. False without a live writer (it died
        after its commit): the caller carries the plan out itself. A writer that dies
        meanwhile is reported as a ``retention_failed`` and restarted, and this life-cycle
        lists the root again at the next retention (some steps may be gone)."""
        if not self._alive():
            return False
        try:
            _send(self._conn, self._lock, {"op": "retain", "newest_step": plan.newest_step,
                                           "steps": list(plan.steps)})
            reply = self._serve("retained")
        except OSError:
            reply = None
        if reply is None:
            pid, how = self.pid, self._drop()
            self.life.forget_known()
            self.events.emit("retention_failed", None, error=(
                f"CheckpointError: the writer process of rank {self.rank} (pid {pid}) {how} "
                f"while deleting {list(plan.steps)}; a new writer is started"))
            self._restart()
            return True
        for step in [*reply.get("deleted", []), *reply.get("gone", [])]:
            self.life.adopt_deletion(int(step))
        cpu = float(reply.get("cpu_seconds", 0.0))
        self._cost.add("retention", 0.0, cpu)
        self._cost.writer_process_cpu = (self._cost.writer_process_cpu or 0.0) + cpu
        if reply.get("error") is not None:
            raise _error_from(reply["error"])
        return True

    def _answer(self, conn: Connection, message: dict[str, Any]) -> None:
        """A lease call of the writer, made on the one ``Lease`` (the coordinator's)."""
        lease = self.life.lease
        reply: dict[str, Any] = {"op": "reply", "id": message["id"]}
        try:
            if lease is None:
                raise CheckpointError("no lease is held by the training process")
            call = message["call"]
            if call == "held":
                reply["value"] = lease.held
            elif call == "confirm":
                reply["value"] = lease.confirm(within=float(message.get("within", 0.0)))
            elif call == "check":
                reply["value"] = lease.check()
            else:
                raise ValueError(f"unknown lease call {call!r}")
        except Exception as exc:  # noqa: BLE001 - raised in the writer, where it was called
            reply["error"] = _error_json(exc)
        try:
            _send(conn, self._lock, reply)
        except OSError:
            pass  # dead: found out by the caller's next wait

    def _outcome(self, step: int, done: dict[str, Any]) -> PersistOutcome:
        manifest = None
        if done.get("manifest") is not None:
            manifest = Manifest.from_json_bytes(done["manifest"].encode(),
                                                f"the writer process's manifest of step {step}",
                                                expected_step=step)
        if done["committed"] and manifest is not None:
            # The training side's life-cycle learns the commit (its gate and retention read
            # it), proven when the writer reported the renewal after it.
            lease = self.life.lease
            self.life.adopt_commit(manifest, proven=lease is not None
                                   and manifest.save_id in lease.committed_ids)
        cost = self._add_writer_cost(done.get("cost"))
        return PersistOutcome(bool(done["committed"]), manifest,
                              already_committed=bool(done.get("already_committed")),
                              error=_error_from(done.get("error")),
                              attempts=int(done.get("attempts", 0)),
                              retries=int(done.get("retries", 0)),
                              persist_seconds=float(done.get("persist_seconds", 0.0)),
                              cost=cost)

    def _add_writer_cost(self, fields: dict[str, Any] | None) -> SaveCost:
        """This save's cost: the writer's phases (``fields``: its ``SaveCost.fields()``)
        added to the one made on this thread when the save was handed off."""
        cost = self._cost
        if fields:
            for phase, wall in fields.get("wall_seconds", {}).items():
                if phase in cost.wall:
                    cost.add(phase, float(wall), float(fields["cpu_seconds"].get(phase, 0.0)))
            cost.writer_process_cpu = float(fields.get("process_cpu_seconds", 0.0))
        return cost

    def _died(self, step: int, attempts: list[str], nbytes: int, stall: float,
              t0: float) -> PersistOutcome:
        """The writer died during the save of ``step``: a failed save, unless (coordinator)
        one of its attempts is committed after all, as readers read it."""
        pid, how = self.pid, self._drop()
        if self.rank == 0 and attempts:
            landed = self.life.committed_by(step, attempts)
            if landed is not None:
                log.warning("writer process %s %s after committing step %d (read back)",
                            pid, how, step)
                lease = self.life.lease
                try:  # a renewal after the manifest: it counts (its close record lists it)
                    if lease is not None and lease.confirm():
                        lease.committed_ids.add(landed.save_id)
                except Exception as exc:  # noqa: BLE001 - then the readers' fence decides
                    log.warning("could not renew the lease after step %d: %s", step, exc)
                return PersistOutcome(True, landed, attempts=len(attempts),
                                      persist_seconds=time.monotonic() - t0,
                                      cost=self._cost)
        outcome = self._failed(step, CheckpointError(
            f"the writer process of rank {self.rank} (pid {pid}) {how} while saving step "
            f"{step}; the save is not committed and a new writer is started"),
            nbytes, stall, t0, attempts=len(attempts))
        self._restart()
        return outcome

    def _restart(self) -> None:
        """Start a writer in place of one that died (unless the manager is closing)."""
        if not self.abandon.is_set():
            # Started now, its start-up overlaps training: at the next save the other
            # ranks' writers do not wait for it at the rendezvous (bounded by the lease TTL).
            try:
                self._start()
            except OSError as exc:  # the next save tries again
                log.warning("could not start a writer process for rank %d: %s", self.rank, exc)
                self._drop()

    def _failed(self, step: int, exc: BaseException, nbytes: int, stall: float, t0: float, *,
                attempts: int) -> PersistOutcome:
        """Report the save of ``step`` failed, as the persister's final failure is (in place
        of one its writer sent before it died)."""
        self._held_failure = None
        seconds = time.monotonic() - t0
        self.events.emit("save_failed", step, error=f"{type(exc).__name__}: {exc}",
                         attempt=max(1, attempts), final=True, outcome="failed",
                         stall_seconds=stall, bytes=nbytes, persist_seconds=seconds, retries=0)
        log.error("checkpoint save of step %d failed: %s", step, exc)
        return PersistOutcome(False, error=exc, attempts=attempts, persist_seconds=seconds,
                              cost=self._cost)


# -- the writer process ------------------------------------------------------------------------
class _Forwarded(EventBus):
    """The writer's events, sent to the training process, which emits them on its bus."""

    def __init__(self, send: Callable[[dict[str, Any]], None], rank: int):
        super().__init__(rank=rank)
        self._send = send

    def emit(self, kind: str, step: int | None = None, **fields: Any):
        self._send({"op": "event", "kind": kind, "step": step, "fields": fields})


class _ReportedIds(set):
    """The lease's ``committed_ids`` in the writer: each one added is also sent to the
    training process's lease (its close record lists them)."""

    def __init__(self, send: Callable[[dict[str, Any]], None]):
        super().__init__()
        self._send = send

    def add(self, save_id: str) -> None:
        super().add(save_id)
        self._send({"op": "committed_id", "save_id": save_id})


class _LeaseCalls:
    """The training process's lease as the writer's life-cycle uses it: identity fields
    given with each save, ``held``/``confirm``/``check`` answered by the training side."""

    def __init__(self, info: dict[str, Any], call: Callable[..., Any],
                 send: Callable[[dict[str, Any]], None]):
        self.holder_id = info["holder_id"]
        self.generation = info["generation"]
        self.job_name = info["job_name"]
        self.ttl_seconds = float(info["ttl_seconds"])
        self.committed_ids = _ReportedIds(send)
        self._call = call

    @property
    def held(self) -> bool:
        return bool(self._call("held"))

    def confirm(self, *, within: float = 0.0) -> bool:
        return bool(self._call("confirm", within=within))

    def check(self) -> bool:
        return bool(self._call("check"))


class _Attempts(Lifecycle):
    """The writer's life-cycle: says each attempt's save id to the training side before its
    marker is written (so a writer that dies after its commit is read back)."""

    def __init__(self, storage, send: Callable[[dict[str, Any]], None]):
        super().__init__(storage)
        self._send_message = send

    def begin(self, step: int, save_id: str, **kwargs: Any) -> None:
        self._send_message({"op": "attempt", "save_id": save_id})
        super().begin(step, save_id, **kwargs)


class _Writer:
    """The writer process's side: one connection, a reader thread, saves on the main
    thread."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.lock = threading.Lock()
        self.jobs: "queue.Queue[dict[str, Any] | None]" = queue.Queue()
        self.abandon = threading.Event()
        self.replies: dict[int, "queue.Queue[dict[str, Any]]"] = {}
        self.next_call = 0
        self.gid = f"new-{uuid.uuid4().hex}"  # the group it is in: none yet
        # The saves and gids it counted under whose keys are not deleted yet (the last one,
        # and any whose rendezvous timed out since).
        self.counted: list[tuple[int, str]] = []
        self.store = None

    def send(self, message: dict[str, Any]) -> None:
        _send(self.conn, self.lock, message)

    def read(self) -> None:
        """Reader thread: dispatch the training side's messages; its end ends this process
        (a dead training process's save must not go on)."""
        while True:
            try:
                message = json.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                os._exit(0)
            op = message.get("op")
            if op in ("init", "save", "retain"):
                self.jobs.put(message)
            elif op == "abandon":
                self.abandon.set()
            elif op == "reply":
                box = self.replies.get(message["id"])
                if box is not None:
                    box.put(message)
            elif op == "exit":
                self.jobs.put(None)
                return

    def call(self, name: str, **kwargs: Any) -> Any:
        """A lease call answered by the training process (the main thread's, one at a time)."""
        self.next_call += 1
        key, box = self.next_call, queue.Queue()
        self.replies[key] = box
        try:
            self.send({"op": "lease", "id": key, "call": name, **kwargs})
            reply = box.get()
        finally:
            self.replies.pop(key, None)
        if "error" in reply:
            raise _error_from(reply["error"])
        return reply["value"]

    def serve(self) -> None:
        init = self.jobs.get()
        if init is None:
            return
        self.config = init
        self.storage = Storage(init["url"], init["storage_options"])
        self.life = _Attempts(self.storage, self.send)
        self.save_plan_cache = SavePlanCache()
        self.blocks = SharedBlocks()
        self.last_manifest: Manifest | None = None  # the newest this writer committed
        while True:
            job = self.jobs.get()
            if job is None:
                break
            if job["op"] == "retain":
                self.send({"op": "retained", **self.retain(job)})
            else:
                self.send({"op": "done", **self.save(job)})

    def _group(self, seq: int) -> Any:
        """The writers' group for save ``seq`` (module docstring: kept while every writer is
        in it, else a new one named after this save); None for one rank."""
        rendezvous, world = self.config["rendezvous"], self.config["world_size"]
        if rendezvous is None:
            return None
        bound = timedelta(seconds=self.config["rendezvous_seconds"])
        if self.store is None:
            self.store = dist.TCPStore(rendezvous["host"], rendezvous["port"], is_master=False,
                                       timeout=bound)
        key = f"{rendezvous['prefix']}/{seq}"
        store = self.store
        store.add(f"{key}/gid/{self.gid}", 1)
        if store.add(f"{key}/n", 1) == world:
            store.set(f"{key}/all", "1")
        try:
            store.wait([f"{key}/all"], bound)
        except RuntimeError as exc:  # DistStoreError: the others are not all there
            arrived = store.add(f"{key}/n", 0)
            self.counted.append((seq, self.gid))  # its keys go at the next rendezvous
            # Out of the group: a writer arriving late and going on in it alone finds its
            # connections closed at its first collective, never a wait of its own.
            if dist.is_initialized():
                dist.destroy_process_group()
            self.gid = f"new-{uuid.uuid4().hex}"
            raise CheckpointError(
                f"the writers' rendezvous of save {seq}: {arrived} of {world} writers arrived "
                f"within {bound.total_seconds():g} s (the lease TTL); a writer died or its "
                f"rank is behind: this save fails on every rank and the next one forms a new "
                f"group") from exc
        # Every writer is past the previous saves' checks: their keys go, those of a
        # rendezvous that timed out too (a dead writer's count key stays, one per restart).
        for prev, gid in self.counted:
            store.delete_key(f"{rendezvous['prefix']}/{prev}/gid/{gid}")
            if self.config["rank"] == 0:
                for name in ("n", "all"):
                    store.delete_key(f"{rendezvous['prefix']}/{prev}/{name}")
        self.counted = [(seq, self.gid)]
        if store.add(f"{key}/gid/{self.gid}", 0) == world and dist.is_initialized():
            return dist.group.WORLD
        if dist.is_initialized():
            dist.destroy_process_group()
        self.gid = f"new-{uuid.uuid4().hex}"  # in no group until this one is formed
        # Forming the group waits for every writer's address: bounded like the count (a
        # writer that died after counting); its collectives then wait for the slowest
        # rank's writes, as long as a thread-mode save's group does.
        dist.init_process_group("gloo", store=dist.PrefixStore(f"{key}/group", store),
                                rank=self.config["rank"], world_size=world, timeout=bound)
        _set_pg_timeout(timedelta(seconds=_COLLECTIVE_SECONDS), dist.group.WORLD)
        self.gid = f"save-{seq}"
        return dist.group.WORLD

    def save(self, job: dict[str, Any]) -> dict[str, Any]:
        config, step = self.config, job["step"]
        if job.get("abandon"):
            self.abandon.set()
        try:
            group = self._group(job["seq"])
            state = rebuild_staged(job["state"], self.blocks)
            self.life.lineage = parse_lineage(job["lineage"], "the hand-off's lineage") \
                if job["lineage"] is not None else None
            self.life.lease = None if job["lease"] is None else \
                _LeaseCalls(job["lease"], self.call, self.send)
            attachments = {name: (base64.b64decode(v["bytes"]) if "bytes" in v else v["path"])
                           for name, v in job["attachments"].items()}
        except Exception as exc:  # noqa: BLE001 - reported as the save's failure
            events = _Forwarded(self.send, config["event_rank"])
            events.emit("save_failed", step, error=f"{type(exc).__name__}: {exc}", attempt=1,
                        final=True, outcome="failed", stall_seconds=job["stall"],
                        bytes=job["nbytes"], persist_seconds=0.0, retries=0)
            return {"committed": False, "error": _error_json(exc), "attempts": 1}
        persister = Persister(
            SaveRequest(self.life, layout=config["layout"], num_threads=config["num_threads"],
                        save_plan_cache=self.save_plan_cache),
            _Forwarded(self.send, config["event_rank"]), group,
            rank=config["rank"], max_attempts=config["max_attempts"],
            retry_backoff_seconds=config["retry_backoff_seconds"], abandon=self.abandon)
        out = persister.run(step, state, nbytes=job["nbytes"], stall=job["stall"],
                            user_metadata=job["user_metadata"], attachments=attachments)
        del state  # the views of the shared block
        if out.committed and out.manifest is not None:
            self.last_manifest = out.manifest
        return {"committed": out.committed,
                "manifest": out.manifest.to_json_bytes().decode() if out.manifest else None,
                "already_committed": out.already_committed,
                "error": _error_json(out.error) if out.error is not None else None,
                "attempts": out.attempts, "retries": out.retries,
                "persist_seconds": out.persist_seconds,
                "cost": out.cost.fields() if out.cost is not None else None}

    def retain(self, job: dict[str, Any]) -> dict[str, Any]:
        """Carry out the retention plan the training side decided after the last commit
        (:meth:`WriterProcess.carry_out`), under the lease of that save; report the steps
        deleted or found gone and the CPU seconds it took."""
        c0 = time.process_time()
        events = _Forwarded(self.send, self.config["event_rank"])
        gone: list[int] = []
        try:
            steps = job["steps"]
            if not isinstance(steps, list) or not all(
                    isinstance(s, int) and not isinstance(s, bool) for s in steps):
                raise ValueError(f"retain: steps {steps!r:.80} is not a list of steps")
            plan = RetentionPlan(int(job["newest_step"]), tuple(steps))
            deleted = carry_out_retention(
                CheckpointStore(self.storage, lifecycle=self.life), plan,
                newest_manifest=self.last_manifest,
                on_deleted=lambda s: events.emit("retention_deleted", s),
                on_failed=lambda s, e: events.emit("retention_failed", s, error=str(e)),
                on_gone=gone.append)
            error = None
        except Exception as exc:  # noqa: BLE001 - reported; retention never fails a save
            deleted, error = [], _error_json(exc)
        return {"deleted": deleted, "gone": gone, "error": error,
                "cpu_seconds": time.process_time() - c0}


def main(fd: int) -> None:
    """The writer process's program (``python -c``): serve the training process on the
    socket ``fd`` until it says ``exit`` or goes away."""
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s ckpt-writer %(levelname)s %(name)s: %(message)s")
    writer = _Writer(Connection(fd))
    threading.Thread(target=writer.read, name="ckpt-writer-read", daemon=True).start()
    writer.serve()
    # No interpreter finalisation after gloo (PLATFORM.md): a worker thread releasing a
    # tensor then can abort the process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

