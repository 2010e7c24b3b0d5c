"""Prometheus metrics from ckpt and trainer events.

``Metrics(bus)`` subscribes to an :class:`ckpt.events.EventBus` and keeps a private
``CollectorRegistry``; ``serve(port)`` exposes it over HTTP for Prometheus to scrape. Only
this package imports prometheus_client, so the store stays embeddable without it.

Every rank runs its own ``Metrics`` and serves it on its own port (``base + LOCAL_RANK``,
see :func:`local_port`); every series carries a ``rank`` label.

Two checkpoint tiers (``ckpt.job.tiers``): the series both tiers feed (saves by outcome, the
save stall, the newest commit's step and time) carry a ``tier`` label, ``"durable"`` or
``"local"``. The local tier's events (``local_<kind>``, ``ckpt.events.LOCAL_PREFIX``) feed
only the ``tier="local"`` series, and the alert rules read ``tier="durable"``: local saves
never hide a durable tier that stopped committing. Every other ``ckpt_`` series is the
durable tier's.

Copies of the local tier on the next node (``local_copies=2``): each node's first rank
copies its node's local checkpoints and counts them (``copy_<what>`` events): the copies by
outcome, their bytes, the lag of the newest (local commit to verified copy) and the newest
local step held on two nodes. The other ranks keep these at their start values.

Every series an alert or a dashboard panel reads exists from construction: counters at 0 for
each label value (so ``increase()`` sees the first event), histograms empty, gauges at a
documented start value. Prometheus cannot tell a series born at 1 from one that was always
1, so an event counted before the first scrape is only visible as the counter's value; the
alert rules read it that way for events that happen at start-up (load fallbacks).

Alert thresholds that depend on the job are computed here and exported as gauges, so the
rules in ``monitoring/prometheus/alerts.yml`` need no per-job constants:

- ``train_stall_threshold_seconds``: time without a step after which the job is stalled,
  ``stall_factor`` x the typical step time (an EWMA of this rank's step times), at least
  ``stall_min_seconds`` and at most ``stall_max_seconds`` (the trainer sets it below the hang
  watchdog, so the alert pages before the watchdog ends the process). Before the first step:
  ``startup_seconds``. Plus the hang watchdog's grace for the current step (warm-up, a
  blocking save), see :meth:`allow_grace`.
- ``ckpt_interval_seconds``: the interval the cadence aims for, from the cadence's own
  description, else its interval in steps x the typical step time.
- ``ckpt_age_limit_seconds``: ``3 x ckpt_interval_seconds + age_slack_seconds``; +Inf while
  the interval is unknown.
- ``train_ft_quorum_alert_min``: with replica groups (``[fault_tolerance]``), the quorum size
  below which ``ReplicaQuorumBelowMinimum`` fires (0 without replica groups: never).

Replica groups (``train_ft_*``): each group's ranks export what their group sees: the size of
the last step's quorum, how many groups heartbeat to the lighthouse and whether it answers
(polled by the group's rank 0), rejoins of this group and how long after its process
started, how long the quorum stayed below full (on the groups that stayed), steps committed
with fewer groups and steps not committed, and whether this group writes the checkpoints.

The rank's hardware (memory, its GPU from NVML: ``monitoring.hardware``) and the job's
goodput (``ckpt.cadence.goodput``: this exporter's own ledger from its events, or the
trainer's, which continues the job's record, once handed over by :meth:`Metrics.observe_goodput`)
are read at each scrape; the collectives' bytes and seconds by kind come with the
``train_step`` events (``trainer.comms``).

Size: the exporter: one definition per series, next to the event that updates it, so that
the series list stays checkable against events.KINDS and the dashboard.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from ckpt import Event, EventBus
from ckpt.cadence import GOODPUT_CATEGORIES, GoodputLedger
from ckpt.events import COMM_KINDS, SAVE_COST_PHASES, tier_of
from monitoring.hardware import GpuSource, HardwareCollector

__all__ = ["Metrics", "local_port", "DEFAULT_HOST", "SAVE_OUTCOMES", "FAILURE_KINDS", "TIERS",
           "COPY_OUTCOMES"]

log = logging.getLogger(__name__)
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

DEFAULT_HOST = "0.0.0.0"  # the same default as trainer.config.MetricsConfig.host
SAVE_OUTCOMES = ("committed", "failed", "skipped")
COPY_OUTCOMES = ("committed", "failed", "skipped", "restored")  # copy_<outcome> events
FAILURE_KINDS = ("nan", "spike", "hang", "straggler", "preempted")
TIERS = ("durable", "local")  # values of the ``tier`` label
AGE_INTERVALS = 3  # checkpoint age limit: this many intervals (+ slack)
_EWMA = 0.2


def local_port(base: int) -> int:
    """The metrics port of this process: ``base + LOCAL_RANK`` (0 when not under torchrun).

    One port per local rank lets every rank of a node serve at once; Prometheus scrapes
    ``host:base`` .. ``host:base + nproc_per_node - 1`` on each node. ``base`` 0 stays 0
    (pick a free port).
    """
    return base + int(os.environ.get("LOCAL_RANK", "0")) if base else 0


class Metrics:
    """Prometheus metrics fed by events. One per process; label ``rank`` tells them apart."""

    def __init__(self, bus: EventBus | None = None, *, rank: int = 0,
                 registry: CollectorRegistry | None = None, stall_factor: float = 20.0,
                 stall_min_seconds: float = 60.0, stall_max_seconds: float = math.inf,
                 startup_seconds: float = 900.0, age_slack_seconds: float = 300.0,
                 device: Any = None, gpu: GpuSource | None = None):
        self.registry = registry or CollectorRegistry()
        self.rank = rk = str(rank)
        self.stall_factor, self.stall_min_seconds = stall_factor, stall_min_seconds
        self.stall_max_seconds, self.startup_seconds = stall_max_seconds, startup_seconds
        self.age_slack_seconds = age_slack_seconds
        r = self.registry

        def labels(tiered: bool) -> tuple[list[str], list[tuple[str, ...]]]:
            """The label names up to ``tier``, and their values: one series per tier."""
            if tiered:
                return ["rank", "tier"], [(rk, t) for t in TIERS]
            return ["rank"], [(rk,)]

        def counter(name, doc, extra=(), values=((),), tiered=False):
            names, heads = labels(tiered)
            c = Counter(name, doc, names + list(extra), registry=r)
            for head in heads:
                for v in values:
                    c.labels(*head, *v)  # the series exists at 0 before the first event
            return c

        def gauge(name, doc, value=0.0, tiered=False):
            names, heads = labels(tiered)
            g = Gauge(name, doc, names, registry=r)
            for head in heads:
                g.labels(*head).set(value)
            return g

        def histogram(name, doc, tiered=False):
            names, heads = labels(tiered)
            h = Histogram(name, doc, names, buckets=_SECONDS, registry=r)
            for head in heads:
                h.labels(*head)
            return h

        self.saves = counter("ckpt_saves_total", "Checkpoint saves by tier and outcome",
                             ["outcome"], [(o,) for o in SAVE_OUTCOMES], tiered=True)
        self.stall = histogram("ckpt_save_stall_seconds",
                               "Training stall per save (staging copy; a local save that "
                               "persists the durable save's copy: 0), by tier", tiered=True)
        self.persist = histogram("ckpt_save_persist_seconds", "Background persist + commit time")
        self.save_bytes = gauge("ckpt_save_bytes", "Bytes staged by this rank in the last save")
        self.save_cpu = histogram("ckpt_save_background_cpu_seconds",
                                  "CPU seconds a save's background work took (persist thread and "
                                  "its writer threads), per committed save")
        self.save_phase_cpu = counter("ckpt_save_cpu_seconds_total",
                                      "Background CPU seconds of saves, by phase", ["phase"],
                                      [(p,) for p in SAVE_COST_PHASES])
        self.throughput = gauge("ckpt_save_bytes_per_second", "Persist throughput of last save")
        self.retries = counter("ckpt_storage_retries_total",
                               "Storage retries and save re-attempts, failed saves included")
        self.last_step = gauge("ckpt_last_committed_step",
                               "Step of the newest committed checkpoint, by tier; -1 = none",
                               -1, tiered=True)
        self.start_time = time.time()
        self.last_time = gauge("ckpt_last_commit_timestamp_seconds",
                               "Unix time of the newest commit, by tier (process start when "
                               "none)", self.start_time, tiered=True)
        self.peer_copies = counter("ckpt_peer_copies_total",
                                "Copies of this node's local checkpoints on the next node, by "
                                "outcome (restored: fetched back at a resume); node's first "
                                "rank", ["outcome"], [(o,) for o in COPY_OUTCOMES])
        self.peer_copied_bytes = counter("ckpt_peer_copied_bytes_total",
                                        "Bytes of local checkpoints copied to the next node")
        self.peer_copy_lag = gauge("ckpt_peer_copy_lag_seconds",
                                     "Newest copy on the next node: seconds from the local "
                                     "commit to the verified copy (0: none yet)")
        self.peer_copied_step = gauge("ckpt_peer_copied_step",
                                     "Newest local step held on two nodes (this node's and "
                                     "its copy on the next); -1 = none", -1)
        self.loads = counter("ckpt_loads_total", "Checkpoint loads")
        self.fallbacks = counter("ckpt_load_fallbacks_total",
                                 "Checkpoints skipped on load because they failed verification")
        self.retention_deleted = counter("ckpt_retention_deleted_total",
                                         "Checkpoints deleted by retention")
        self.retention_failed = counter("ckpt_retention_failures_total",
                                        "Retention deletes that failed")
        self.lease_lost = counter("ckpt_lease_lost_total", "Times the write lease was lost")
        self.lease_lost_time = gauge("ckpt_lease_lost_timestamp_seconds",
                                     "Unix time this process lost the write lease (or found it "
                                     "held by another job at start); 0 = never")
        self.interval_steps = gauge("ckpt_interval_steps",
                                    "Current checkpoint interval (steps); 0 = unknown")
        self.interval_seconds = gauge("ckpt_interval_seconds",
                                      "Expected checkpoint interval (seconds); 0 = unknown")
        self.age_limit = gauge("ckpt_age_limit_seconds",
                               "Checkpoint age beyond which CheckpointTooOld fires", math.inf)
        self.train_step = gauge("train_step", "Last completed training step")
        self.train_loss = gauge("train_loss", "Loss of the last step (0 before the first)")
        self.train_grad_norm = gauge("train_grad_norm", "Gradient norm of the last step")
        self.train_tps = gauge("train_tokens_per_second", "Training throughput")
        self.train_step_seconds = histogram("train_step_seconds", "Step time")
        self.typical_step = gauge("train_step_seconds_typical",
                                  "Typical step time (EWMA of this rank's steps); 0 = unknown")
        self.train_last = gauge("train_last_step_timestamp_seconds",
                                "Unix time of the last step (process start before the first)",
                                self.start_time)
        self.stall_threshold = gauge("train_stall_threshold_seconds",
                                     "Time without a step after which TrainingStalled fires",
                                     startup_seconds)
        self.process_start = gauge("train_process_start_timestamp_seconds",
                                   "Unix time this process started exporting", self.start_time)
        self.completed = gauge("train_completed_timestamp_seconds",
                               "Unix time the run ended with its last step committed (exit 0); "
                               "0 until then")
        self.failures = counter("train_failures_total", "Detected failures by kind", ["kind"],
                                [(k,) for k in FAILURE_KINDS])
        self.resumes = counter("train_resumes_total", "Resumes from a checkpoint")
        self.resumed_step = gauge("train_resumed_step",
                                  "Step this process resumed from; -1 = started fresh", -1)
        # Replica groups on torchft; without them the gauges keep their start values.
        self.ft_groups = gauge("train_ft_replica_groups",
                               "Replica groups of the job (parallel.dp_replicate); 0 = no "
                               "fault-tolerant replica groups")
        self.ft_quorum = gauge("train_ft_quorum_size",
                               "Replica groups in the last step's quorum; 0 = none yet")
        self.ft_alert_min = gauge("train_ft_quorum_alert_min",
                                  "Quorum size below which ReplicaQuorumBelowMinimum fires; "
                                  "0 = off")
        self.ft_alive = gauge("train_ft_replica_groups_alive",
                              "Replica groups heartbeating to the lighthouse; -1 = unknown", -1)
        self.ft_lighthouse_up = gauge("train_ft_lighthouse_up",
                                      "1 = the lighthouse answers, 0 = it does not, -1 = not "
                                      "polled (rank > 0 of a group, or no replica groups)", -1)
        self.ft_writer = gauge("train_ft_checkpoint_writer",
                               "1 = this replica group writes the checkpoints (holds the lease)")
        self.ft_recoveries = counter("train_ft_recoveries_total",
                                     "Times this replica group rejoined (received a peer's "
                                     "state)")
        self.ft_rejoin = histogram("train_ft_rejoin_seconds",
                                   "Seconds from this process's start to its group rejoining")
        self.ft_recovery = histogram("train_ft_recovery_seconds",
                                     "On a group that stayed: seconds its quorum was below "
                                     "full, until every group trained again")
        self.ft_reduced = counter("train_ft_reduced_quorum_steps_total",
                                  "Steps committed with fewer than every replica group")
        self.ft_uncommitted = counter("train_ft_uncommitted_steps_total",
                                      "Steps not committed (a group failed in them), run again")
        # Collectives by kind (trainer.comms), from the train_step events.
        self.comm_bytes = counter("train_comm_bytes_total",
                                  "Bytes of this rank's collectives by kind (the whole buffer, "
                                  "as nccl-tests count size)", ["kind"],
                                  [(k,) for k in COMM_KINDS])
        self.comm_seconds = counter("train_comm_seconds_total",
                                    "Seconds of this rank's collectives by kind, call to "
                                    "completion (send_recv: not timed, stays 0)", ["kind"],
                                    [(k,) for k in COMM_KINDS])
        # The mixture-of-experts router (train_step's ``router``): this rank's worst block and
        # mean balancing loss from the start (0 on a dense model), each block once it reports.
        self.router_imbalance = gauge("train_router_imbalance",
                                      "Busiest expert's tokens over the mean, the worst of this "
                                      "rank's MoE blocks in the last step (1 = balanced; 0 = "
                                      "no MoE block)")
        self.router_aux_loss = gauge("train_router_aux_loss",
                                     "Load-balancing loss of the last step, mean over this "
                                     "rank's MoE blocks (1 = balanced; 0 = no MoE block)")
        self.router_layer_imbalance = Gauge(
            "train_router_layer_imbalance", "Busiest expert's tokens over the mean, per MoE "
            "block (layer) of this rank, in the last step", ["rank", "layer"], registry=r)
        self.router_layer_aux_loss = Gauge(
            "train_router_layer_aux_loss", "Load-balancing loss per MoE block (layer) of this "
            "rank in the last step", ["rank", "layer"], registry=r)
        # Memory, the GPU (read at each scrape) and goodput (the ledger, read at each scrape).
        r.register(HardwareCollector(rk, device, gpu))
        self._goodput = GoodputLedger.start(None, process_start_unix=self.start_time)
        self._own_goodput = True  # fed by on_event until observe_goodput() hands another
        r.register(_GoodputCollector(self))
        # State behind the derived gauges and the de-duplication of skipped saves.
        self._typical: float | None = None
        self._grace = 0.0
        self._cadence_seconds: float | None = None
        self._cadence_steps: float | None = None
        self._save_retries: dict[int | None, float] = {}
        self._last_skip: tuple[Any, int] | None = None  # (what was in flight, step counted)
        if bus is not None:
            bus.subscribe(self.on_event)

    # -- start-up state --------------------------------------------------------------------
    def observe_store(self, store: Any) -> None:
        """Set the newest commit from ``store`` (a ``ckpt.root.store.CheckpointStore``), read-only.

        Call at start-up on every rank: checkpoint age and the last committed step then
        survive restarts instead of being unknown until this process saves (the trainer
        calls it again once a resume has settled the store: every rank after the un-commit
        of damaged steps). Errors are logged, never raised (monitoring must not stop a job).
        """
        try:
            manifest = store.latest(check="none")
        except Exception as exc:  # noqa: BLE001
            log.warning("metrics: could not read the newest checkpoint: %s", exc)
            return
        # None: nothing committed (any more: a fresh start un-commits damaged steps).
        self.last_step.labels(self.rank, "durable").set(
            manifest.step if manifest is not None else -1)
        self.last_time.labels(self.rank, "durable").set(
            manifest.created_unix if manifest is not None else self.start_time)

    def observe_goodput(self, ledger: GoodputLedger) -> None:
        """Export ``ledger`` (the trainer's, which continues the job's record across
        restarts: ``trainer.goodput``) instead of this exporter's own, which counts from
        this process's start. The caller feeds it the events."""
        self._goodput, self._own_goodput = ledger, False

    def allow_grace(self, extra_seconds: float) -> None:
        """Raise the stall threshold by ``extra_seconds`` until the next step (the hang
        watchdog's grace for warm-up or a blocking save; see ``HangWatchdog.on_grace``)."""
        self._grace = max(0.0, extra_seconds)
        self._update_derived()

    # -- derived gauges ----------------------------------------------------------------------
    def _update_derived(self) -> None:
        rk = self.rank
        if self._typical is None:
            self.stall_threshold.labels(rk).set(self.startup_seconds + self._grace)
        else:
            self.typical_step.labels(rk).set(self._typical)
            threshold = max(self.stall_factor * self._typical, self.stall_min_seconds)
            threshold = min(threshold, self.stall_max_seconds)
            self.stall_threshold.labels(rk).set(threshold + self._grace)
        interval = self._cadence_seconds
        if not interval and self._cadence_steps and self._typical:
            interval = self._cadence_steps * self._typical
        if interval:
            self.interval_seconds.labels(rk).set(interval)
            self.age_limit.labels(rk).set(AGE_INTERVALS * interval + self.age_slack_seconds)

    def _count_retries(self, step: int | None, cumulative: Any) -> None:
        """Save events carry the save's retries so far; count each retry once."""
        total = float(cumulative or 0)
        seen = self._save_retries.get(step, 0.0)
        if total > seen:
            self.retries.labels(self.rank).inc(total - seen)
            self._save_retries[step] = total

    def _count_skip(self, ev: Event) -> None:
        """One skipped save per skipped save, not one per step while a save is busy.

        The manager reports a skip on every due step while the previous save persists; with
        a time cadence every step after the interval is due until a save starts. A skip
        counts when what blocks it changed, or when a whole interval (in steps) has passed
        since the last skip counted: that is a further save that could not be made.
        """
        f = ev.fields
        cause = (f.get("reason"), f.get("in_flight_step"))
        step = ev.step or 0
        if self._last_skip is not None and self._last_skip[0] == cause:
            every = self._cadence_steps
            if not every or step - self._last_skip[1] < every:
                return
        self._last_skip = (cause, step)
        self.saves.labels(self.rank, "durable", "skipped").inc()

    # -- events ------------------------------------------------------------------------------
    def on_event(self, ev: Event) -> None:
        f: dict[str, Any] = ev.fields
        rk = self.rank
        if self._own_goodput:
            self._goodput.on_event(ev)
        tier, k = tier_of(ev.kind)
        if tier == "local":
            self._on_local_event(k, ev)
        elif k == "save_staged":
            self.stall.labels(rk, "durable").observe(f.get("stall_seconds", 0.0))
            self.save_bytes.labels(rk).set(f.get("bytes", 0))
            self._last_skip = None
        elif k == "save_committed":
            self.saves.labels(rk, "durable", "committed").inc()
            self.persist.labels(rk).observe(f.get("persist_seconds", 0.0))
            self.throughput.labels(rk).set(f.get("bytes_per_second", 0.0))
            self._count_retries(ev.step, f.get("retries"))
            self._save_retries.pop(ev.step, None)
            self.last_step.labels(rk, "durable").set(ev.step or 0)
            self.last_time.labels(rk, "durable").set(ev.time)
        elif k == "save_failed":
            self._count_retries(ev.step, f.get("retries"))
            if f.get("final"):
                self._save_retries.pop(ev.step, None)
                if f.get("outcome", "failed") == "failed":
                    self.saves.labels(rk, "durable", "failed").inc()
        elif k == "save_skipped":
            self._count_skip(ev)
        elif k == "save_cost":
            self.save_cpu.labels(rk).observe(f.get("background_cpu_seconds", 0.0))
            for phase, seconds in (f.get("cpu_seconds") or {}).items():
                if phase in SAVE_COST_PHASES and isinstance(seconds, (int, float)) and seconds > 0:
                    self.save_phase_cpu.labels(rk, phase).inc(seconds)
        elif k.startswith("copy_"):
            self._on_copy(k[len("copy_"):], ev)
        elif k == "load_done":
            self.loads.labels(rk).inc()
        elif k == "load_fallback":
            self.fallbacks.labels(rk).inc()
        elif k == "retention_deleted":
            self.retention_deleted.labels(rk).inc()
        elif k == "retention_failed":
            self.retention_failed.labels(rk).inc()
        elif k == "lease_lost":
            self.lease_lost.labels(rk).inc()
            self.lease_lost_time.labels(rk).set(ev.time)
        elif k == "run_ended":
            if f.get("exit_code") == 0:
                self.completed.labels(rk).set(ev.time)
        elif k == "cadence":
            if f.get("interval_steps"):
                self._cadence_steps = float(f["interval_steps"])
                self.interval_steps.labels(rk).set(f["interval_steps"])
            if f.get("interval_seconds"):
                self._cadence_seconds = float(f["interval_seconds"])
            self._update_derived()
        elif k == "train_step":
            self.train_step.labels(rk).set(ev.step or 0)
            for key, gauge in (("loss", self.train_loss), ("grad_norm", self.train_grad_norm),
                               ("tokens_per_second", self.train_tps)):
                if f.get(key) is not None:
                    gauge.labels(rk).set(f[key])
            self._grace = 0.0  # the watchdog's grace ends with the step
            dt = f.get("step_seconds")
            if dt is not None and math.isfinite(dt):
                self.train_step_seconds.labels(rk).observe(dt)
                self._typical = dt if self._typical is None else (
                    (1 - _EWMA) * self._typical + _EWMA * dt)
            self._update_derived()
            self.train_last.labels(rk).set(ev.time)
            for family, values in ((self.comm_bytes, f.get("comm_bytes")),
                                   (self.comm_seconds, f.get("comm_seconds"))):
                for kind, value in (values or {}).items():
                    if kind in COMM_KINDS and isinstance(value, (int, float)) and value > 0:
                        family.labels(rk, kind).inc(value)
            self._on_router(f.get("router"))
        elif k == "failure":
            self.failures.labels(rk, str(f.get("failure", "unknown"))).inc()
        elif k == "resumed":
            self.resumes.labels(rk).inc()
            self.resumed_step.labels(rk).set(ev.step if ev.step is not None else -1)
        elif k.startswith("ft_"):
            self._on_replica_event(k, f)

    def _on_router(self, router: Any) -> None:
        """A step's router statistics: ``{layer: {"imbalance", "aux_loss"}}`` or None."""
        if not isinstance(router, dict) or not router:
            return
        rk, worst, losses = self.rank, 0.0, []
        for layer, stats in router.items():
            imbalance, aux = stats.get("imbalance"), stats.get("aux_loss")
            if isinstance(imbalance, (int, float)):
                self.router_layer_imbalance.labels(rk, str(layer)).set(imbalance)
                worst = max(worst, imbalance)
            if isinstance(aux, (int, float)):
                self.router_layer_aux_loss.labels(rk, str(layer)).set(aux)
                losses.append(aux)
        self.router_imbalance.labels(rk).set(worst)
        if losses:
            self.router_aux_loss.labels(rk).set(sum(losses) / len(losses))

    def _on_replica_event(self, k: str, f: dict[str, Any]) -> None:
        """An event of the replica groups (``trainer.ft``)."""
        rk = self.rank
        if k == "ft_started":
            self.ft_groups.labels(rk).set(f.get("replica_groups") or 0)
            self.ft_alert_min.labels(rk).set(f.get("alert_min_quorum") or 0)
        elif k == "ft_step":
            self.ft_quorum.labels(rk).set(f.get("quorum_size") or 0)
            if not f.get("committed"):
                self.ft_uncommitted.labels(rk).inc()
            elif (f.get("quorum_size") or 0) < (f.get("replica_groups") or 0):
                self.ft_reduced.labels(rk).inc()
        elif k == "ft_healed":
            self.ft_recoveries.labels(rk).inc()
            if isinstance(f.get("process_seconds"), (int, float)):
                self.ft_rejoin.labels(rk).observe(f["process_seconds"])
        elif k == "ft_recovered":
            self.ft_recovery.labels(rk).observe(f.get("seconds", 0.0))
        elif k == "ft_lighthouse":
            self.ft_lighthouse_up.labels(rk).set(1 if f.get("up") else 0)
            alive = f.get("groups_alive")
            self.ft_alive.labels(rk).set(alive if isinstance(alive, int) else -1)
        elif k == "ft_writer":
            self.ft_writer.labels(rk).set(1 if f.get("role") == "writer" else 0)

    def _on_copy(self, outcome: str, ev: Event) -> None:
        """A copy of a local checkpoint on the next node (``copy_<outcome>``)."""
        if outcome not in COPY_OUTCOMES:
            return
        f, rk = ev.fields, self.rank
        self.peer_copies.labels(rk, outcome).inc()
        if outcome == "committed":
            self.peer_copied_bytes.labels(rk).inc(f.get("bytes") or 0)
            self.peer_copy_lag.labels(rk).set(f.get("lag_seconds") or 0.0)
            self.peer_copied_step.labels(rk).set(ev.step if ev.step is not None else -1)

    def _on_local_event(self, k: str, ev: Event) -> None:
        """An event of the local tier (its kind without the prefix): only its saves count,
        in the ``tier="local"`` series; a skip counts once per skipped step."""
        f, rk = ev.fields, self.rank
        if k == "save_staged":
            self.stall.labels(rk, "local").observe(f.get("stall_seconds", 0.0))
        elif k == "save_committed":
            self.saves.labels(rk, "local", "committed").inc()
            self.last_step.labels(rk, "local").set(ev.step or 0)
            self.last_time.labels(rk, "local").set(ev.time)
        elif k == "save_failed":
            if f.get("final") and f.get("outcome", "failed") == "failed":
                self.saves.labels(rk, "local", "failed").inc()
        elif k == "save_skipped":
            self.saves.labels(rk, "local", "skipped").inc()

    # -- serving -------------------------------------------------------------------------------
    def serve(self, port: int, addr: str = DEFAULT_HOST) -> int:
        """Serve ``/metrics`` on ``addr:port`` (0 picks a free port); returns the port.

        Under torchrun give each rank its own port: ``serve(local_port(base))``.
        """
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return server.server_port

    def shutdown(self, linger_seconds: float = 0.0) -> None:
        """Stop serving, after ``linger_seconds`` more of it: at least one scrape interval
        when the last state must be seen (the run's end, a lost lease), since Prometheus
        drops a target's series at the first scrape that finds it gone."""
        if linger_seconds > 0 and getattr(self, "_server", None) is not None:
            time.sleep(linger_seconds)
        server = getattr(self, "_server", None)
        if server is not None:
            server.shutdown()
            server.server_close()
            self._server = None


class _GoodputCollector:
    """The goodput ledger a :class:`Metrics` exports, read at each scrape (live: the time
    since the last event counts too)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self) -> list:
        return []

    def collect(self):
        m, rk = self.metrics, self.metrics.rank
        b = m._goodput.breakdown(time.time())
        seconds = GaugeMetricFamily(
            "train_goodput_seconds", "The job's wall time since it first started, by category "
            "(productive, startup, restart, recomputed, checkpoint_stall, reduced_quorum, "
            "uncommitted, other); they add up to train_goodput_wall_seconds",
            labels=["rank", "category"])
        for category in GOODPUT_CATEGORIES:
            seconds.add_metric([rk, category], b["seconds"][category])
        yield seconds
        for name, doc, value in (
                ("train_goodput_wall_seconds", "The job's wall time since it first started "
                 "(pauses after a normal end left out)", b["wall_seconds"]),
                ("train_goodput_ratio", "Productive training seconds / wall seconds; NaN "
                 "before any time passed", b["goodput"] if b["goodput"] is not None
                 else math.nan),
                ("train_goodput_job_start_timestamp_seconds", "Unix time the job first "
                 "started (its first process)", b["first_start_unix"])):
            g = GaugeMetricFamily(name, doc, labels=["rank"])
            g.add_metric([rk], value)
            yield g
