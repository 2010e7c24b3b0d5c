"""Goodput: where the wall time of a job went, since it first started, across its restarts.

A :class:`GoodputLedger` splits wall time into :data:`CATEGORIES` from the events of one
process (``ckpt.events``), starting from what the job's earlier processes recorded (the
``goodput`` object of the root's failure history, ``_history.json``: ``ckpt.cadence.history``).
Goodput is ``productive / wall``. The categories always add up to the wall time:

==================  ==========================================================================
``productive``      step time of steps whose work is kept: the step time (``train_step``'s
                    ``step_seconds``) of every step up to the newest one; at a resume the
                    steps after the checkpoint resumed from move to ``recomputed``. With
                    replica groups, a step committed by ``q`` of ``n`` groups counts ``q/n``
                    of its time
``startup``         the job's first process, from its start to its first step (and the same
                    for a process started after a run that ended normally)
``restart``         from the last record of a process that did not end normally (its
                    failure, or the last record before a SIGKILL) to the next process's first
                    step: detection, the restart, the resume, the warm-up
``recomputed``      step time of steps trained after the checkpoint the next process resumed
                    from (all of them when it starts from scratch, step 1): that work is
                    done again
``checkpoint_stall`` training blocked by saves (``save_staged``'s stall, durable and local
                    tier, and ``save_waited``)
``reduced_quorum``  with replica groups: the share ``1 - q/n`` of a step that ``q`` of
                    ``n`` groups committed
``uncommitted``     with replica groups: time of steps no group kept (``ft_step`` not
                    committed)
``other``           the rest between steps (logging, checks, the loop), and the time between
                    a process's last step and its end
==================  ==========================================================================

The time between a run that ended normally (``run_ended`` with exit 0) and the next start
is not the job's: it is left out of the wall time. A job that is stopped in any other way
(a failure, a preemption) counts the time until it trains again as ``restart``.

Records: the ledger is a small JSON object (:meth:`GoodputLedger.to_dict`) that the trainer
keeps in the history it writes (every few seconds, at every commit, at the end: the
last record before a SIGKILL bounds what ``restart`` takes from ``recomputed``); each
checkpoint's user metadata carries ``productive_seconds`` at its step, so a resume knows
exactly how much of the productive time its checkpoint holds (``resumed`` event's
``productive_seconds``).

Thread-safe: events arrive from the training thread and the save threads.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable

from ckpt.events import Event, tier_of

__all__ = ["CATEGORIES", "GoodputLedger"]

CATEGORIES = ("productive", "startup", "restart", "recomputed", "checkpoint_stall",
              "reduced_quorum", "uncommitted", "other")
_VERSION = 1


class GoodputLedger:
    """One process's account of the job's wall time (see the module docstring).

    Build it with :meth:`start` at the process's start (every rank may keep one; the
    coordinator's is the one written to the root), feed it every event (:meth:`on_event`, an
    ``EventBus`` subscriber) and read :meth:`breakdown`. ``on_record(dict)``, if given, is
    called with :meth:`to_dict` after every change (the trainer hands it to the history it
    writes).
    """

    def __init__(self, *, first_start_unix: float, mark_unix: float,
                 seconds: dict[str, float] | None = None, opening: str = "startup",
                 carried: bool = False,
                 on_record: Callable[[dict[str, Any]], None] | None = None):
        self.first_start_unix = float(first_start_unix)
        self._mark = float(mark_unix)  # the end of the time accounted so far
        self._seconds = dict.fromkeys(CATEGORIES, 0.0)
        self._seconds.update(seconds or {})
        self._opening = opening  # where the time before this process's first step goes
        self._carried = carried  # continues a record (a resume's figure means something)
        self._resumed = False  # this process resumed from a checkpoint
        self._first_step_seen = False
        self._credit = 0.0  # productive time a resume found beyond the last record
        self._pending_stall = 0.0
        self._quorum: tuple[int, int] | None = None  # (q, n) of the last committed ft step
        self._ended = False
        self._step: int | None = None
        self._lock = threading.Lock()
        self._on_record = on_record

    # -- building ---------------------------------------------------------------------------
    @classmethod
    def start(cls, carried: dict[str, Any] | None, *, process_start_unix: float,
              on_record: Callable[[dict[str, Any]], None] | None = None) -> "GoodputLedger":
        """The ledger of a process that started at ``process_start_unix``, continuing
        ``carried`` (a record of :meth:`to_dict`; None or empty: the job starts now).

        A record whose process ended normally leaves the time since out of the job's wall
        time; otherwise that time counts as ``restart`` up to this process's first step.
        Raises ``ValueError`` naming the field for a record that does not read."""
        if not carried:
            return cls(first_start_unix=process_start_unix, mark_unix=process_start_unix,
                       on_record=on_record)
        first, mark, seconds, ended = cls._read(carried)
        if ended:  # a run that ended normally: the pause is not the job's time
            return cls(first_start_unix=first, mark_unix=process_start_unix, seconds=seconds,
                       carried=True, on_record=on_record)
        return cls(first_start_unix=first, mark_unix=mark, seconds=seconds, opening="restart",
                   carried=True, on_record=on_record)

    @staticmethod
    def _read(data: dict[str, Any]) -> tuple[float, float, dict[str, float], bool]:
        if not isinstance(data, dict) or data.get("version") != _VERSION:
            raise ValueError(f"goodput record {data!r} is not version {_VERSION}: expected "
                             f"{{'version': {_VERSION}, ...}}")

        def number(name: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"goodput record field {name}={value!r} must be a finite "
                                 f"number >= 0")
            return float(value)

        first = number("first_start_unix", data.get("first_start_unix"))
        mark = number("recorded_unix", data.get("recorded_unix"))
        raw = data.get("seconds")
        if not isinstance(raw, dict):
            raise ValueError(f"goodput record field seconds={raw!r} must be an object of "
                             f"{', '.join(CATEGORIES)}")
        # Categories a later version adds are kept in the wall time as "other".
        seconds = {c: number(f"seconds.{c}", raw.get(c, 0.0)) for c in CATEGORIES}
        seconds["other"] += sum(number(f"seconds.{k}", v) for k, v in raw.items()
                                if k not in CATEGORIES)
        ended = data.get("ended", False)
        if not isinstance(ended, bool):
            raise ValueError(f"goodput record field ended={ended!r} must be true or false")
        return first, mark, seconds, ended

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GoodputLedger":
        """The ledger as recorded (for display: ``ckpt history``); ``ValueError`` naming the
        field if it does not read."""
        first, mark, seconds, ended = cls._read(data)
        ledger = cls(first_start_unix=first, mark_unix=mark, seconds=seconds)
        ledger._ended = ended
        step = data.get("step")
        ledger._step = step if isinstance(step, int) and not isinstance(step, bool) else None
        return ledger

    # -- reading ----------------------------------------------------------------------------
    @property
    def recorded_unix(self) -> float:
        """The end of the time accounted (the newest event accounted)."""
        return self._mark

    @property
    def productive_seconds(self) -> float:
        return self._seconds["productive"]

    def to_dict(self) -> dict[str, Any]:
        """The record kept in ``_history.json`` (``goodput``): JSON-safe."""
        with self._lock:
            return self._record()

    def _record(self) -> dict[str, Any]:
        return {"version": _VERSION, "first_start_unix": self.first_start_unix,
                "recorded_unix": self._mark, "seconds": dict(self._seconds),
                "ended": self._ended, "step": self._step}

    def breakdown(self, now: float | None = None) -> dict[str, Any]:
        """``{"wall_seconds", "goodput", "seconds": {category: s}, "first_start_unix",
        "recorded_unix"}`` up to ``now`` (default: the time accounted; a live process passes
        ``time.time()``: the open time since the last event goes to the category it is
        heading for, ``startup``/``restart`` before the first step, else ``other``).
        ``goodput`` is None while the wall time is 0."""
        with self._lock:
            seconds = dict(self._seconds)
            mark = self._mark
            if now is not None and now > mark and not self._ended:
                if not self._first_step_seen:
                    self._open(seconds, now - mark, self._credit)
                else:
                    seconds["other"] += now - mark
                mark = now
        wall = sum(seconds.values())
        return {"wall_seconds": wall, "goodput": seconds["productive"] / wall if wall > 0
                else None, "seconds": seconds, "first_start_unix": self.first_start_unix,
                "recorded_unix": mark}

    # -- events -----------------------------------------------------------------------------
    def on_event(self, ev: Event) -> None:
        """Account one event (``EventBus`` subscriber); other kinds are ignored."""
        f = ev.fields
        _, kind = tier_of(ev.kind)
        with self._lock:
            if ev.kind == "train_step":
                self._on_step(ev.time, f.get("step_seconds"), ev.step)
            elif kind == "save_staged":
                self._pending_stall += _seconds(f.get("stall_seconds"))
            elif kind == "save_waited":
                self._pending_stall += _seconds(f.get("wait_seconds"))
            elif kind == "resumed":
                self._on_resumed(f.get("productive_seconds"))
            elif kind == "ft_step":
                if f.get("committed"):
                    q, n = f.get("quorum_size"), f.get("replica_groups")
                    self._quorum = (q, n) if isinstance(q, int) and isinstance(n, int) \
                        and 0 < q <= n else None
                else:
                    self._close_gap(ev.time, "uncommitted")
            elif kind == "run_ended":
                self._close_gap(ev.time, "other")
                self._ended = f.get("exit_code") == 0
            else:
                return
            record = self._record()
        if self._on_record is not None:
            self._on_record(record)

    def close(self, now: float | None = None, *, ended: bool = False) -> None:
        """The process is leaving: account the time up to ``now`` (default: the current
        time) as ``other``. ``ended``: it trained to its last step (the time until the next
        process starts is not the job's); otherwise (a crash, a preemption) the next process
        counts it as ``restart``."""
        with self._lock:
            self._close_gap(time.time() if now is None else now, "other")
            self._ended = ended
            record = self._record()
        if self._on_record is not None:
            self._on_record(record)

    def _on_resumed(self, productive: Any) -> None:
        """A resume: the productive time after its checkpoint's is work done again. More
        than recorded (a commit after the last record) is taken from the time up to the
        first step."""
        self._resumed = True
        if not self._carried or isinstance(productive, bool) \
                or not isinstance(productive, (int, float)) \
                or not math.isfinite(productive) or productive < 0:
            return  # a new tally, or a checkpoint without the figure: nothing to move
        lost = self._seconds["productive"] - productive
        if lost >= 0:
            self._seconds["recomputed"] += lost
            self._credit = 0.0
        else:
            self._credit = -lost
        self._seconds["productive"] = float(productive)

    def _on_step(self, t: float, step_seconds: Any, step: int | None) -> None:
        d = _seconds(step_seconds)
        begin = t - d
        if begin < self._mark:  # a step that began before the accounted time
            d = max(0.0, t - self._mark)
            begin = t - d
        gap = begin - self._mark
        if not self._first_step_seen:
            if self._carried and not self._resumed and step is not None and step <= 1:
                self._on_resumed(0.0)  # trains from scratch: all that was trained is lost
            self._first_step_seen = True
            self._open(self._seconds, gap, self._credit)
            self._credit = 0.0
            self._pending_stall = 0.0
        else:
            stall = min(self._pending_stall, gap)
            self._seconds["checkpoint_stall"] += stall
            self._seconds["other"] += gap - stall
            self._pending_stall = 0.0
        share = 1.0
        if self._quorum is not None:
            q, n = self._quorum
            share = q / n
            self._quorum = None
        self._seconds["productive"] += d * share
        self._seconds["reduced_quorum"] += d * (1.0 - share)
        self._mark = t
        self._step = step

    def _open(self, seconds: dict[str, float], gap: float, credit: float) -> None:
        """The time from a process's start (or the last record before it) to its first
        step, ``gap``, into ``seconds``: ``startup`` or ``restart``, less the ``credit`` a
        resume already counted as productive (a commit after the last record); a credit
        larger than the gap is not proven and comes off ``productive`` again."""
        taken = min(credit, gap)
        seconds["productive"] -= credit - taken
        seconds[self._opening] += gap - taken

    def _close_gap(self, t: float, category: str) -> None:
        """Account the time from the mark to ``t`` as ``category`` (the save stall
        reported meanwhile as ``checkpoint_stall``)."""
        gap = max(0.0, t - self._mark)
        if not self._first_step_seen:  # nothing trained yet in this process
            self._first_step_seen = True
            self._open(self._seconds, gap, self._credit)
            self._credit = 0.0
            self._pending_stall = 0.0
            self._mark = max(self._mark, t)
            return
        stall = min(self._pending_stall, gap)
        self._seconds["checkpoint_stall"] += stall
        self._seconds[category] += gap - stall
        self._pending_stall = 0.0
        self._mark = max(self._mark, t)


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        return 0.0
    return float(value)
