"""Structured events from the store and the training loop.

Core code emits events; ``monitoring/`` turns them into metrics, so the store can be
embedded without the Prometheus client library. A subscriber is any callable taking an ``Event``;
subscribers are called synchronously on the emitting thread and must not raise (errors are
logged and swallowed so that monitoring can never break a save).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Event", "EventBus", "JsonlEventLog"]

log = logging.getLogger(__name__)

# Kinds emitted by ckpt (fields in parentheses). Save events carry ``outcome``:
# "committed", "retrying", "failed", "abandoned" or "skipped".
#   save_staged     (step, stall_seconds, bytes, first)
#   save_committed  (step, outcome, stall_seconds, copy_seconds, persist_seconds,
#                    total_seconds, bytes, bytes_per_second, retries, attempts, total_bytes);
#                    copy_seconds: the device time of CUDA staging copies, None on CPU
#   save_cost       (step, wall_seconds, cpu_seconds, total_wall_seconds,
#                    persist_thread_cpu_seconds, helper_cpu_seconds, background_cpu_seconds,
#                    process_cpu_seconds): what a committed save cost in the background,
#                    per phase (ckpt.dcp.savecost.PHASES), emitted after its retention
#   save_failed     (step, outcome, error, attempt, final, stall_seconds, persist_seconds,
#                    bytes, retries)
#   save_skipped    (step, outcome, reason[, in_flight_step, num_skipped])
#   save_waited     (step, wait_seconds, in_flight_step)
#   load_done       (step, outcome, seconds, bytes, bytes_per_second, verify, num_fallbacks)
#   load_fallback   (step, reason)
#   retention_deleted (step)     retention_failed (step, error)
#   lease_acquired  (holder, took_over)     lease_lost (reason)
#   cleanup_aborted (step)
#   cadence         (interval_steps, interval_seconds, active_bound, ...); the trainer also
#                   emits one at start-up (step None) so the interval is known before a save
# Kinds emitted by the trainer: train_step (loss, grad_norm, step_seconds, tokens_per_second,
# lr), failure (failure: nan|spike|hang|straggler|preempted), resumed, checkpoint_uncommitted.


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
        ev = Event(kind, step, fields, rank=self.rank)
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
