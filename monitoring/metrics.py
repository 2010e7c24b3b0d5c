"""Prometheus metrics from ckpt and trainer events.

``Metrics(bus)`` subscribes to an :class:`ckpt.events.EventBus` and keeps a private
``CollectorRegistry``; ``serve(port)`` exposes it over HTTP for Prometheus to scrape. Only
this package imports prometheus_client, so the store stays embeddable without it.

Checkpoint age is ``time() - ckpt_last_commit_timestamp_seconds`` in PromQL; a stalled job
shows as ``time() - train_last_step_timestamp_seconds`` growing.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ckpt.events import Event, EventBus

__all__ = ["Metrics"]

log = logging.getLogger(__name__)
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """Prometheus metrics fed by events. One per process; label ``rank`` tells them apart."""

    def __init__(self, bus: EventBus | None = None, *, rank: int = 0,
                 registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.rank = str(rank)
        r, L = self.registry, ["rank"]
        self.saves = Counter("ckpt_saves_total", "Checkpoint saves by outcome", L + ["outcome"],
                             registry=r)
        self.stall = Histogram("ckpt_save_stall_seconds", "Training stall per save (staging copy)",
                               L, buckets=_SECONDS, registry=r)
        self.persist = Histogram("ckpt_save_persist_seconds", "Background persist + commit time",
                                 L, buckets=_SECONDS, registry=r)
        self.save_bytes = Gauge("ckpt_save_bytes", "Bytes staged by this rank in the last save",
                                L, registry=r)
        self.throughput = Gauge("ckpt_save_bytes_per_second", "Persist throughput of last save",
                                L, registry=r)
        self.retries = Counter("ckpt_storage_retries_total", "Storage retries during saves", L,
                               registry=r)
        self.last_step = Gauge("ckpt_last_committed_step", "Step of the newest committed checkpoint",
                               L, registry=r)
        self.last_time = Gauge("ckpt_last_commit_timestamp_seconds",
                               "Unix time of the newest commit", L, registry=r)
        self.loads = Counter("ckpt_loads_total", "Checkpoint loads", L, registry=r)
        self.fallbacks = Counter("ckpt_load_fallbacks_total",
                                 "Checkpoints skipped on load because they failed verification",
                                 L, registry=r)
        self.retention_deleted = Counter("ckpt_retention_deleted_total",
                                         "Checkpoints deleted by retention", L, registry=r)
        self.retention_failed = Counter("ckpt_retention_failures_total",
                                        "Retention deletes that failed", L, registry=r)
        self.lease_lost = Counter("ckpt_lease_lost_total", "Times the write lease was lost", L,
                                  registry=r)
        self.interval_steps = Gauge("ckpt_interval_steps", "Current checkpoint interval (steps)",
                                    L, registry=r)
        self.interval_seconds = Gauge("ckpt_interval_seconds",
                                      "Current checkpoint interval (seconds)", L, registry=r)
        self.train_step = Gauge("train_step", "Last completed training step", L, registry=r)
        self.train_loss = Gauge("train_loss", "Loss of the last step", L, registry=r)
        self.train_grad_norm = Gauge("train_grad_norm", "Gradient norm of the last step", L,
                                     registry=r)
        self.train_tps = Gauge("train_tokens_per_second", "Training throughput", L, registry=r)
        self.train_step_seconds = Histogram("train_step_seconds", "Step time", L,
                                            buckets=_SECONDS, registry=r)
        self.train_last = Gauge("train_last_step_timestamp_seconds", "Unix time of the last step",
                                L, registry=r)
        self.failures = Counter("train_failures_total", "Detected failures by kind",
                                L + ["kind"], registry=r)
        self.resumes = Counter("train_resumes_total", "Resumes from a checkpoint", L, registry=r)
        if bus is not None:
            bus.subscribe(self.on_event)

    def on_event(self, ev: Event) -> None:
        f: dict[str, Any] = ev.fields
        rk = self.rank
        k = ev.kind
        if k == "save_staged":
            self.stall.labels(rk).observe(f.get("stall_seconds", 0.0))
            self.save_bytes.labels(rk).set(f.get("bytes", 0))
        elif k == "save_committed":
            self.saves.labels(rk, "committed").inc()
            self.persist.labels(rk).observe(f.get("persist_seconds", 0.0))
            self.throughput.labels(rk).set(f.get("bytes_per_second", 0.0))
            self.retries.labels(rk).inc(f.get("retries", 0) or 0)
            self.last_step.labels(rk).set(ev.step or 0)
            self.last_time.labels(rk).set(ev.time)
        elif k == "save_failed":
            if f.get("final"):
                self.saves.labels(rk, "failed").inc()
        elif k == "save_skipped":
            self.saves.labels(rk, "skipped").inc()
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
        elif k == "cadence":
            if f.get("interval_steps") is not None:
                self.interval_steps.labels(rk).set(f["interval_steps"])
            if f.get("interval_seconds") is not None:
                self.interval_seconds.labels(rk).set(f["interval_seconds"])
        elif k == "train_step":
            self.train_step.labels(rk).set(ev.step or 0)
            for key, gauge in (("loss", self.train_loss), ("grad_norm", self.train_grad_norm),
                               ("tokens_per_second", self.train_tps)):
                if f.get(key) is not None:
                    gauge.labels(rk).set(f[key])
            if f.get("step_seconds") is not None:
                self.train_step_seconds.labels(rk).observe(f["step_seconds"])
            self.train_last.labels(rk).set(ev.time)
        elif k == "failure":
            self.failures.labels(rk, str(f.get("failure", "unknown"))).inc()
        elif k == "resumed":
            self.resumes.labels(rk).inc()

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr:port`` (0 picks a free port); returns the port."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return server.server_port

    def shutdown(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.shutdown()
            server.server_close()
