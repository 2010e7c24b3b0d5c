"""The job's goodput ledger in a trainer process: built from the root's history, fed by the
process's events, written back with that history.

Every rank keeps a :class:`ckpt.cadence.goodput.GoodputLedger` (its figures are exported by
each rank's metrics); the coordinator's is the one written to the root. Contract, per rank:

1. ``GoodputRecorder(events, coordinator=..., manager=..., storage=...)`` at the process's
   start, after the checkpoint manager: the ledger continues the ``goodput`` record of the
   job's failure history as the manager read it (the same on every rank); without a
   manager (a replica group that does not write), of the history under ``storage``, read
   only; with neither, a new tally. An unreadable record is logged and a new tally starts.
2. With a manager, or on :meth:`attach` (a replica group that becomes the checkpoint
   writer), the manager's history is the one written: every change of the ledger goes into
   that history, which the manager writes at each commit (at most once a minute) and at its
   close, and which the recorder's thread writes every :data:`RECORD_SECONDS` from
   :meth:`start` (the training loop's start) on (coordinator, holding the lease).
3. :meth:`stop` when the run is over, before the manager closes: the time up to now is
   accounted, and whether the run trained to its end (else the next process counts its
   restart from here).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from ckpt import Checkpointer, EventBus, Storage
from ckpt.cadence import GoodputLedger, load_history

__all__ = ["GoodputRecorder", "RECORD_SECONDS", "process_start_unix"]

log = logging.getLogger(__name__)

RECORD_SECONDS = 5.0
"""How often the coordinator writes the ledger (with the history) while training: a
process killed outright loses at most this much of its account (counted as ``restart``
instead of what it was: training that is done again, mostly)."""


def process_start_unix() -> float:
    """When this process was launched: under torchrun its agent's start (the launch; a
    worker starts seconds later), else this process's (Linux: from ``/proc``); else now."""
    pid = str(os.getppid()) if os.environ.get("TORCHELASTIC_RUN_ID") else "self"
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # since boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        # Against the uptime, not /proc/stat's btime (whole seconds).
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


class GoodputRecorder:
    """One rank's goodput ledger and its writes (see the module docstring)."""

    def __init__(self, events: EventBus, *, coordinator: bool, manager: Checkpointer | None = None,
                 storage: Storage | None = None):
        self.coordinator = coordinator
        self._manager: Checkpointer | None = None
        self._history = getattr(manager, "durable", manager).history if manager is not None \
            else None
        carried = self._history.goodput if self._history is not None else None
        if manager is None and storage is not None:
            try:
                stored = load_history(storage)
                carried = stored.goodput if stored is not None else None
            except (OSError, ValueError) as exc:
                log.warning("goodput: %s", exc) if coordinator else None
        try:
            self.ledger = GoodputLedger.start(carried, process_start_unix=process_start_unix(),
                                              on_record=self._record)
        except ValueError as exc:
            if coordinator:
                log.warning("goodput: the history's record does not read (%s); a new tally "
                            "starts now", exc)
            self.ledger = GoodputLedger.start(None, process_start_unix=process_start_unix(),
                                              on_record=self._record)
        events.subscribe(self.ledger.on_event)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._running = False
        if manager is not None:
            self.attach(manager)

    def attach(self, manager: Checkpointer) -> None:
        """Write the ledger with ``manager``'s history (a two-tier job's: the durable
        tier's), from now on."""
        self._manager = manager
        self._history = manager.history
        self._record(self.ledger.to_dict())
        self._start_thread()

    def start(self) -> None:
        """The training loop starts: the coordinator writes the ledger every
        :data:`RECORD_SECONDS` from now until :meth:`stop`."""
        self._running = True
        self._start_thread()

    def _start_thread(self) -> None:
        if self._running and self.coordinator and self._manager is not None \
                and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="goodput-record",
                                            daemon=True)
            self._thread.start()

    def productive_seconds(self) -> float:
        """The productive seconds so far (each save's metadata carries them)."""
        return self.ledger.productive_seconds

    def stop(self, *, ended: bool) -> None:
        """End the writes and account the time up to now; ``ended``: the run trained to its
        last step (else it crashed or stopped early: the next start counts a restart).
        Before the manager's close, which writes the history a last time."""
        self._running = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.ledger.close(ended=ended)
        if self.coordinator and self._manager is not None:
            try:  # now: a close that waits on a dead peer may never write it
                self._manager.save_history()
            except Exception as exc:  # noqa: BLE001 - advisory data, never fatal
                log.warning("goodput: could not write the history: %s", exc)

    def _record(self, record: dict[str, Any]) -> None:
        if self._history is not None:
            self._history.goodput = record

    def _run(self) -> None:
        while not self._stop.wait(RECORD_SECONDS):
            try:
                self._manager.save_history()
            except Exception as exc:  # noqa: BLE001 - advisory data, never fatal
                log.warning("goodput: could not write the history: %s", exc)
