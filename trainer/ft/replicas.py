"""One replica group's side of torchft: the quorum, the cross-group average, the commit.

Every rank of a replica group builds one :class:`ReplicaGroup` (after the model, its
optimizers and a resume from the store, so the group joins a quorum only when it can
train) and calls, once per step, in this order::

    info = group.start_step()    quorum (may heal this group from a peer: state replaced)
    ... forward/backward on batch info.batch_index ...
    ok = group.average(tensors)  average gradients (and the loss) over the quorum's groups
    if group.commit(): step the optimizer      (False: drop this step entirely)

Rank k of every group averages with rank k of the others (torchft's cross-group process
group), so every group must have the same layout. ``commit`` is True on every rank of the
group or on none; different groups can disagree on one step, and the one that did not
commit is behind at the next quorum and heals.

What a failure looks like from here: a peer dies inside ``average`` (the collective errors
out, ``average`` returns False, ``commit`` False, nothing of the step is kept); the next
``start_step`` waits until the lighthouse stops counting the dead group (its heartbeat
timeout) and the step runs again with the smaller quorum; when the dead group's torchrun
restarts it, it joins a quorum, is behind, and receives this group's state
(:mod:`trainer.ft.transport`).

Pitfalls this module avoids (torchft 0.2.0): torchft's DDP wrapper crashes the healthy group
when a peer dies mid-all-reduce (not used: one flat all-reduce per dtype after backward);
torchrun's agent store keeps a dead attempt's keys (``manager_addr``, and the cross-group
rendezvous keys a restarted lighthouse reuses), so rank 0 hosts a fresh store per attempt.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

# torchft's Rust side logs every quorum and commit at INFO; it reads RUST_LOG when loaded.
os.environ.setdefault("RUST_LOG", "warn")
from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL  # noqa: E402

from ckpt import EventBus
from ckpt.ranks import Agreement
from trainer.config import Config
from trainer.ft.lighthouse import LighthouseWatch
from trainer.ft.state import ReplicaState
from trainer.ft.transport import StateTransport

__all__ = ["ReplicaGroup", "StepInfo", "process_age_seconds"]

log = logging.getLogger(__name__)

# torchft logs every quorum and commit at INFO (and two structured loggers once per step).
for _name in ("torchft", "torchft_quorums", "torchft_commits"):
    logging.getLogger(_name).setLevel(logging.WARNING)


class _Quieter(logging.Filter):
    """torchft logs a peer's death inside a collective with a traceback (the message line
    says it), and on CPU warns at every new quorum that it has no NCCL flight recorder."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "flight recorder" in str(record.msg):
            return False
        record.exc_info = record.exc_text = None
        return True


logging.getLogger("torchft.manager").addFilter(_Quieter())


def process_age_seconds() -> float | None:
    """Seconds since this process started (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class StepInfo:
    """What the quorum of a step decided, for this group."""

    step: int  # committed steps so far (the step about to run is step + 1)
    batch_index: int  # the group batch this group reads: batches committed + replica rank
    quorum_size: int  # replica groups training this step
    replica_rank: int  # this group's rank among them
    quorum_seconds: float  # the quorum, including a heal's transfer
    healed: bool  # this group received a peer's state in this quorum


class ReplicaGroup:
    """This rank's membership in the job's replica groups (see the module docstring).

    Construction is collective over the group (``agreement``'s group, the trainer's control
    group; None in a single process): rank 0 starts the group's store and torchft's manager
    server, which connects to the lighthouse.
    """

    def __init__(self, cfg: Config, state: ReplicaState, *, rank: int, world_size: int,
                 device: torch.device, agreement: Agreement, events: EventBus):
        ft = cfg.fault_tolerance
        self.ft, self.state, self.events = ft, state, events
        self.rank, self.num_groups = rank, cfg.parallel.dp_replicate
        self.num_heals = 0
        self._healed_in_quorum = False
        self._degraded_since: float | None = None
        self._last_full: float | None = None
        self._reduced_steps = self._failed_steps = 0
        self._info: StepInfo | None = None
        hostname = ft.hostname or socket.gethostname()
        timeout = timedelta(seconds=ft.timeout_seconds)
        # A store of this attempt only, hosted by rank 0 (see the module docstring).
        self._store = None
        address = None
        if rank == 0:
            self._store = dist.TCPStore(hostname, 0, is_master=True, wait_for_workers=False,
                                        timeout=timeout)
            address = [hostname, self._store.port]
        host, port = agreement.broadcast(address)
        self.transport = StateTransport(timeout, hostname)
        pg_type = ProcessGroupNCCL if device.type == "cuda" else ProcessGroupGloo
        self.manager = Manager(
            pg=pg_type(timeout=timeout), min_replica_size=ft.min_replicas,
            load_state_dict=self._load, state_dict=state.state_dict,
            use_async_quorum=False,  # heal inside start_step, before the forward
            timeout=timeout, quorum_timeout=timedelta(seconds=cfg.quorum_timeout_seconds()),
            connect_timeout=timedelta(seconds=ft.connect_timeout_seconds),
            rank=rank, world_size=world_size, store_addr=host, store_port=port,
            lighthouse_addr=ft.lighthouse, replica_id=f"group{ft.group_id}",
            hostname=hostname, checkpoint_transport=self.transport,
            # Every group builds the same initial model from the seed: nothing to sync.
            init_sync=False, max_retries=ft.max_failed_steps, quorum_retries=ft.quorum_retries)
        self.watch = None
        if rank == 0:
            self.watch = LighthouseWatch(ft.lighthouse, self._lighthouse_changed).start()

    # -- counters that travel with the state ------------------------------------------------
    def restore_counters(self, step: int, batches_committed: int) -> None:
        """After a resume from the store: torchft's step and data position (group batches
        committed), so the quorum knows how far this group is."""
        self.manager.load_state_dict({"step": step, "batches_committed": batches_committed})

    @property
    def step(self) -> int:
        return self.manager.current_step()

    @property
    def batches_committed(self) -> int:
        return self.manager.batches_committed()

    # -- the step ---------------------------------------------------------------------------
    def _load(self, sd) -> None:
        self.state.load_state_dict(sd)
        self.num_heals += 1
        self._healed_in_quorum = True

    def start_step(self) -> StepInfo:
        """The quorum of the next step (collective over the group; may heal this group)."""
        t0 = time.monotonic()
        before = self.step
        self._healed_in_quorum = False
        self.manager.start_quorum()
        seconds = time.monotonic() - t0
        n = self.manager.num_participants()
        r = self.manager.participating_rank() or 0
        self._info = StepInfo(step=self.step, batch_index=self.batches_committed + r,
                              quorum_size=n, replica_rank=r, quorum_seconds=seconds,
                              healed=self._healed_in_quorum)
        if self._healed_in_quorum:
            log.warning("replica group %d rejoined at step %d (was at %d): received a peer's "
                        "state in %.2fs", self.ft.group_id, self.step, before, seconds)
            self.events.emit("ft_healed", self.step, seconds=seconds, from_step=before,
                             process_seconds=process_age_seconds())
        return self._info

    def average(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Average each tensor in place over the quorum's groups (rank k with rank k).
        Returns False when a collective failed (a peer died): the tensors are then garbage
        and the step must not commit (``commit`` will say so)."""
        works = [self.manager.allreduce(t) for t in tensors]
        for w in works:
            w.wait()
        return self.manager.errored() is None

    def commit(self) -> bool:
        """Whether this step counts (collective over the group): the optimizer steps only on
        True. On True the step and the batches committed move on."""
        info = self._info
        assert info is not None, "start_step() first"
        error = self.manager.errored()
        ok = self.manager.should_commit()
        now = time.monotonic()
        full = ok and info.quorum_size >= self.num_groups
        if full:
            if self._degraded_since is not None:
                seconds = now - self._degraded_since
                log.info("replica groups: full quorum of %d again after %.1fs (%d steps "
                         "with fewer, %d not committed)", self.num_groups, seconds,
                         self._reduced_steps, self._failed_steps)
                self.events.emit("ft_recovered", self.step, seconds=seconds,
                                 reduced_steps=self._reduced_steps,
                                 failed_steps=self._failed_steps)
            self._degraded_since, self._last_full = None, now
            self._reduced_steps = self._failed_steps = 0
        elif self._last_full is not None:
            if self._degraded_since is None:
                self._degraded_since = self._last_full
            self._reduced_steps += ok
            self._failed_steps += not ok
        self.events.emit("ft_step", self.step, committed=ok, quorum_size=info.quorum_size,
                         replica_groups=self.num_groups, replica_rank=info.replica_rank,
                         quorum_id=self.manager._quorum_id, batch_index=info.batch_index,
                         batches_committed=self.batches_committed,
                         quorum_seconds=info.quorum_seconds,
                         error=None if error is None else str(error.original_exception)[:300])
        if not ok:
            log.warning("step %d not committed (quorum %d of %d groups%s); it runs again",
                        info.step + 1, info.quorum_size, self.num_groups,
                        f": {error.original_exception}" if error is not None else "")
        return ok

    # -- leaving ----------------------------------------------------------------------------
    def _lighthouse_changed(self, up: bool, groups_alive: int | None) -> None:
        (log.info if up else log.warning)("lighthouse %s %s%s", self.ft.lighthouse,
                                          "reachable" if up else "unreachable",
                                          f", {groups_alive} group(s) heartbeating"
                                          if groups_alive is not None else "")
        self.events.emit("ft_lighthouse", None, up=up, groups_alive=groups_alive,
                         url=self.ft.lighthouse)

    def leave(self) -> None:
        """Stop heartbeating and serving (the other groups stop waiting for this one)."""
        if self.watch is not None:
            self.watch.stop()
        try:
            self.manager.shutdown(wait=False)
        except Exception as exc:  # noqa: BLE001 - leaving anyway
            log.warning("torchft manager shutdown: %s", exc)
