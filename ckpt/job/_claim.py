"""A manager's claim on its root: the write lease, the cleanup of dead attempts' files, and
the job's failure history.

Life of a claim (``CheckpointManager`` holds one)::

    RootClaim(...)   collective: the coordinator takes the lease (fencing off earlier
                     writers; every rank learns whether it could: ``acquire_for_ranks``),
                     removes the leftovers of every earlier generation's unfinished saves
                     (best effort), reads the failure history (a takeover or leftovers
                     count as a failure: ``ckpt.cadence.history``); every rank gets a copy
    save_history()   the coordinator writes the history while it holds the lease (after a
                     commit at most once a minute, and at close)
    release()        the coordinator closes its generation and lets the lease go

Without ``use_lease`` there is no lease and no cleanup; the history is still read.
"""

from __future__ import annotations

import logging
import time

from ckpt.cadence import FailureHistory, load_job_history, write_history
from ckpt.events import EventBus
from ckpt.ranks import Agreement
from ckpt.root import Lease, Lifecycle, acquire_for_ranks, release_lease

__all__ = ["RootClaim"]

log = logging.getLogger(__name__)


class RootClaim:
    """One manager's claim on its root (see the module docstring).

    Construction is collective over ``ctl``'s group (the manager's control group): every rank
    constructs it at once. ``lease`` is the coordinator's (None on other ranks and without
    ``use_lease``); ``history`` is the job's failure history, the same on every rank.
    """

    def __init__(self, life: Lifecycle, ctl: Agreement, events: EventBus, *,
                 coordinator: bool, use_lease: bool, ttl_seconds: float,
                 job_name: str | None, fingerprint: str | None):
        self.life, self.storage, self.events = life, life.storage, events
        self.coordinator = coordinator
        self.lease: Lease | None = None
        self._history_written = float("-inf")  # time.monotonic() of the last write
        found_aborted = False
        if use_lease:
            acquire_for_ranks(self.storage, ctl, coordinator, lifecycle=life,
                              ttl_seconds=ttl_seconds, job_name=job_name,
                              fingerprint=fingerprint,
                              on_lost=lambda why: events.emit("lease_lost", reason=why))
            if coordinator:
                self.lease = life.lease
                events.emit("lease_acquired", holder=self.lease.holder_id,
                            took_over=self.lease.took_over is not None,
                            generation=self.lease.generation)
                found_aborted = self._cleanup_aborted()
        took_over = self.lease is not None and self.lease.took_over is not None
        self.history: FailureHistory = load_job_history(
            self.storage, events, ctl, coordinator=coordinator, took_over=took_over,
            found_aborted=found_aborted)

    @property
    def lost(self) -> bool:
        """This rank held the lease and lost it to another job (the coordinator only)."""
        return self.lease is not None and not self.lease.held

    @property
    def owner(self) -> str | None:
        return self.lease.holder_id if self.lease is not None else None

    def save_history(self, *, at_most_every: float = 0.0) -> None:
        """Write the failure history (the coordinator, while it holds the lease), unless it
        was written less than ``at_most_every`` seconds ago (its uptime is advisory: a job
        that dies loses at most that much of it)."""
        now = time.monotonic()
        if self.coordinator and (self.lease is None or self.lease.held) \
                and now - self._history_written >= at_most_every:
            write_history(self.storage, self.history)
            self._history_written = now

    def release(self) -> None:
        """Close this writer's generation and release the lease (the coordinator)."""
        if self.lease is not None:
            release_lease(self.life)

    def _cleanup_aborted(self) -> bool:
        """Remove the files of attempts whose writer is gone (every earlier generation).
        Returns whether any were found."""
        found = False

        def removed(step: int, names: list[str]) -> None:
            nonlocal found
            found = True
            self.events.emit("cleanup_aborted", step, files=len(names))
            log.info("removed %d leftover file(s) of aborted saves at step %d", len(names),
                     step)

        try:
            self.life.cleanup(on_removed=removed)
        except Exception as exc:  # noqa: BLE001 - cleanup is best effort
            log.warning("could not clean up aborted saves under %s: %s", self.storage.url, exc)
        return found
