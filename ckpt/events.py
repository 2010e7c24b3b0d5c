"""Structured events from the store and the training loop.

Core code emits events; ``monitoring/`` turns them into metrics, so the store can be
embedded without the Prometheus client library. A subscriber is any callable taking an ``Event``;
subscribers are called synchronously on the emitting thread and must not raise (errors are
logged and swallowed so that monitoring can never break a save).

Every kind the store and the trainer emit is listed with its fields in :data:`KINDS`; the
local tier of a two-tier job emits the same kinds prefixed (:data:`LOCAL_PREFIX`).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Event", "EventBus", "JsonlEventLog", "KINDS", "LOCAL_PREFIX", "COMM_KINDS",
           "SAVE_COST_PHASES", "tier_of"]

log = logging.getLogger(__name__)

LOCAL_PREFIX = "local_"
"""The two-tier manager (``ckpt.job.tiers``) re-emits every event of its local tier on the
job's bus as ``local_<kind>`` (``local_save_committed`` ...) with the same fields plus
``tier="local"``: a consumer that reads ``save_committed`` sees the durable tier's saves
only, and the event log tells the tiers apart at a glance. Kinds without the prefix are the
durable tier's (or not a tier's at all)."""

COMM_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "send_recv", "all_to_all")
"""The kinds of collectives ``train_step`` events count (``comm_bytes``, ``comm_seconds``):
what each is and where the trainer measures it is ``trainer.comms``."""

SAVE_COST_PHASES = ("plan", "collective", "crc", "write", "fsync", "commit", "bookkeep",
                    "retention")
"""The phases of a ``save_cost`` event's ``wall_seconds`` and ``cpu_seconds``: what each
covers is ``ckpt.dcp.savecost``."""

# Every kind ckpt and the trainer emit, with the names of its fields (``step`` and ``time``,
# ``rank`` are on every event). A field listed may be absent from some events of its kind
# (noted below). tests/ckpt/test_events.py checks this table against every ``emit`` call
# and every kind ``monitoring/`` reads.
KINDS: dict[str, tuple[str, ...]] = {
    # -- saves (ckpt.job). ``outcome``: "committed", "retrying", "failed", "abandoned" or
    #    "skipped". Durations in seconds, sizes in bytes, of this rank.
    # The staging copy is done and training goes on; ``reused``: the two-tier manager's local
    # save persists the copy its durable save staged (stall 0).
    "save_staged": ("stall_seconds", "bytes", "first", "reused"),
    # ``copy_seconds``: device time of CUDA staging copies (None on CPU); ``retries`` and
    # ``attempts`` of this save; ``total_bytes``: the manifest's (coordinator; else None).
    "save_committed": ("outcome", "stall_seconds", "copy_seconds", "persist_seconds",
                       "total_seconds", "bytes", "bytes_per_second", "retries", "attempts",
                       "total_bytes"),
    # What a committed save cost in the background, per phase (``SAVE_COST_PHASES``):
    # ``wall_seconds`` and ``cpu_seconds`` are {phase: seconds}; emitted after its retention.
    "save_cost": ("wall_seconds", "cpu_seconds", "total_wall_seconds",
                  "persist_thread_cpu_seconds", "helper_cpu_seconds", "background_cpu_seconds",
                  "process_cpu_seconds"),
    # One attempt failed (``final``: no attempt follows); ``retries``: this save's so far.
    "save_failed": ("outcome", "error", "attempt", "final", "stall_seconds", "persist_seconds",
                    "bytes", "retries"),
    # A due save not made: ``reason`` "already committed", "lease lost" or "previous save in
    # flight" (then with ``in_flight_step`` and ``num_skipped``, the skips in a row).
    "save_skipped": ("outcome", "reason", "in_flight_step", "num_skipped"),
    # A blocking save waited this long for the save in flight.
    "save_waited": ("wait_seconds", "in_flight_step"),
    # -- loads (ckpt.job)
    "load_done": ("outcome", "seconds", "bytes", "bytes_per_second", "verify", "num_fallbacks"),
    # The checkpoint at ``step`` was skipped; ``tier`` ("local"/"durable") from the two-tier
    # manager's walk over both tiers only.
    "load_fallback": ("reason", "tier"),
    # -- retention and the root's lease (coordinator). ``reason``: only on the local tier's
    #    steps deleted because they are newer than the step resumed.
    "retention_deleted": ("reason",),
    "retention_failed": ("error",),
    "lease_acquired": ("holder", "took_over", "generation"),
    "lease_lost": ("reason",),
    "cleanup_aborted": ("files",),  # files of aborted saves removed at ``step``
    # -- cadence (ckpt.cadence): ``CadencePolicy.describe()``. Emitted after every commit;
    #    the trainer also emits one at start-up (step None), so the interval is known early.
    "cadence": ("policy", "interval_steps", "interval_seconds", "active_bound", "inputs"),
    # A start counted as a failure in the root's history (restart, take-over, aborted saves).
    "failure_recorded": ("restarted", "took_over", "num_failures"),
    # The two-tier manager took that failure back from the durable tier's history: the
    # local tier survived it, so no node was lost.
    "failure_reclassified": ("tier", "reason"),
    # A resume un-committed a checkpoint newer than the step it loaded (``step``: that one;
    # ``CheckpointManager.uncommit_newer``), so the run saves that step again.
    "checkpoint_uncommitted": ("resumed_step",),
    # -- copies of a node's local checkpoints on the next node (``ckpt.job.tiers`` with
    #    ``local_copies=2``; each node's first rank). ``node``: whose checkpoint;
    #    ``peer_node``: the other node of the copy (holding it, or sending it back).
    # The copy of this node's local ``step`` committed and verified on ``peer_node``: the
    # step is held on two nodes. ``seconds``: the copy's own time; ``lag_seconds``: from the
    # local commit to now; ``bytes``: the files copied.
    "copy_committed": ("peer_node", "bytes", "seconds", "lag_seconds"),
    # A copy that does not count (refused by its receiver, or not sent back at a resume).
    "copy_failed": ("node", "peer_node", "error"),
    # A local step not copied: copies run behind the saves and only the newest is copied.
    "copy_skipped": ("reason",),
    # At a resume, this node's local ``step`` fetched back from ``peer_node``'s copy.
    "copy_restored": ("peer_node", "bytes", "seconds"),
    # -- the trainer (trainer/)
    # ``comm_bytes`` and ``comm_seconds``: {kind: value} of this rank's collectives measured
    # since the previous step (``trainer.comms``; kinds with nothing measured left out).
    # ``router``: {layer: {"imbalance", "aux_loss"}} of the mixture-of-experts blocks this
    # rank holds, over the step (``trainer.model.RouterStats``); None for a dense model.
    "train_step": ("loss", "grad_norm", "step_seconds", "tokens_per_second", "lr",
                   "comm_bytes", "comm_seconds", "router"),
    # ``failure``: "nan", "spike", "hang", "straggler" or "preempted"; ``loss`` with nan and
    # spike, ``slow_rank`` with straggler.
    "failure": ("failure", "loss", "slow_rank"),
    # ``productive_seconds``: the job's productive training seconds the checkpoint holds (its
    # user metadata; None for a checkpoint written without it): ``ckpt.cadence.goodput``.
    "resumed": ("same_layout", "productive_seconds"),
    # The run is over and the process is about to exit with ``exit_code`` (every rank; 0:
    # trained to the end with the last step committed). Not emitted when it crashed.
    "run_ended": ("exit_code",),
    # -- replica groups on torchft (trainer/ft; ``[fault_tolerance]``). This group joined
    #    (``alert_min_quorum``: the quorum size below which the alert fires).
    "ft_started": ("group_id", "replica_groups", "min_replicas", "alert_min_quorum",
                   "lighthouse"),
    # Every step's outcome: ``committed`` (False: nothing of it was kept), the quorum
    # (``quorum_size`` of ``replica_groups``; this group's ``replica_rank``), the group batch
    # read (``batch_index``), ``batches_committed`` after it, the quorum's wall time and the
    # error that failed it (None if none).
    "ft_step": ("committed", "quorum_size", "replica_groups", "replica_rank", "quorum_id",
                "batch_index", "batches_committed", "quorum_seconds", "error"),
    # This group received a peer's state (``step``: the step it rejoined at, from
    # ``from_step``) in ``seconds``; ``process_seconds``: since this process started.
    "ft_healed": ("seconds", "from_step", "process_seconds"),
    # A healthy group's quorum is full again after ``seconds`` with a smaller one
    # (``reduced_steps`` committed, ``failed_steps`` not).
    "ft_recovered": ("seconds", "reduced_steps", "failed_steps"),
    # The lighthouse became (un)reachable, or the groups heartbeating to it changed.
    "ft_lighthouse": ("up", "groups_alive", "url"),
    # This group became the checkpoint writer (it took the lease) or went back to standby.
    "ft_writer": ("role", "reason"),
    # SHA-256 prefixes of this rank's replica state at the end (equal across groups).
    "ft_replica_digest": ("model", "optim", "rng", "trainer"),
}


def tier_of(kind: str) -> tuple[str, str]:
    """``("local", base kind)`` for a local-tier kind (:data:`LOCAL_PREFIX`), else
    ``("durable", kind)``."""
    if kind.startswith(LOCAL_PREFIX):
        return "local", kind[len(LOCAL_PREFIX):]
    return "durable", kind


@dataclass
class Event:
    kind: str
    step: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)
    rank: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "step": self.step, "time": self.time, "rank": self.rank,
                **self.fields}


class EventBus:
    """Fan-out of events to subscribers; keeps the last few for inspection."""

    def __init__(self, rank: int = 0, keep: int = 256):
        self.rank = rank
        self._subs: list[Callable[[Event], None]] = []
        self._lock = threading.Lock()
        self.recent: list[Event] = []
        self._keep = keep

    def subscribe(self, fn: Callable[[Event], None]) -> None:
        with self._lock:
            self._subs.append(fn)

    def emit(self, kind: str, step: int | None = None, **fields: Any) -> Event:
        return self._publish(Event(kind, step, fields, rank=self.rank))

    def forward(self, kind: str, step: int | None, fields: dict[str, Any]) -> Event:
        """Emit an event another process emitted (a manager's writer process: its kinds
        come from the ``emit`` calls tests/ckpt/test_events.py reads, this is the one place
        they cross over). ``ValueError`` naming the kind or field when it is not in
        :data:`KINDS` (a writer of another version), so nothing unlisted reaches a
        subscriber."""
        if not isinstance(kind, str) or tier_of(kind)[1] not in KINDS:
            raise ValueError(f"forwarded event kind {kind!r} is not in ckpt.events.KINDS "
                             f"(a writer process of another version?)")
        unknown = sorted(set(fields) - set(KINDS[tier_of(kind)[1]]) - {"tier"})
        if unknown:
            raise ValueError(f"forwarded event {kind!r}: fields {unknown} are not in "
                             f"ckpt.events.KINDS[{tier_of(kind)[1]!r}]")
        return self._publish(Event(kind, step, dict(fields), rank=self.rank))

    def _publish(self, ev: Event) -> Event:
        kind = ev.kind
        with self._lock:
            self.recent.append(ev)
            del self.recent[:-self._keep]
            subs = list(self._subs)
        for fn in subs:
            try:
                fn(ev)
            except Exception:  # noqa: BLE001 - monitoring must never break training
                log.exception("event subscriber %r failed on %s", fn, kind)
        return ev

    def of_kind(self, kind: str) -> list[Event]:
        with self._lock:
            return [e for e in self.recent if e.kind == kind]


# Strict JSON has no NaN or Infinity. A non-finite float is written as the string "NaN",
# "Infinity" or "-Infinity" (the spelling of Python's float() and JavaScript), so every line
# parses with any JSON parser and ``float(value)`` reads it back.
_NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else _NON_FINITE[value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _strict_dumps(doc: Any) -> str:
    return json.dumps(_finite(doc), default=str, allow_nan=False)


class JsonlEventLog:
    """Subscriber that appends each event as one strict JSON line to a local file.

    Non-finite numbers (a NaN loss) are written as the strings ``"NaN"``, ``"Infinity"``,
    ``"-Infinity"``; ``float()`` reads them back.
    """

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()

    def __call__(self, ev: Event) -> None:
        line = _strict_dumps(ev.to_json())
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")
