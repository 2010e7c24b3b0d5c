"""A manager's start under its root: take the write lease, clean up dead attempts' files,
read the job's failure history.

Rank 0 of the manager's group takes the lease (fencing off earlier writers) and removes the
leftovers of every earlier generation's unfinished saves; every rank learns whether it could
(``ckpt.root.lifecycle.acquire_for_ranks`` agrees it). Cleanup is best effort. Then rank 0 reads the
failure history (a takeover or leftovers count as a failure: ``ckpt.cadence.history``) and every
rank gets its copy. Collective over the manager's control group.
"""

from __future__ import annotations

import logging

from ckpt.cadence import FailureHistory, load_job_history
from ckpt.events import EventBus
from ckpt.ranks import Agreement
from ckpt.root import Lease, Lifecycle, acquire_for_ranks
from ckpt.storage import Storage

__all__ = ["claim_root", "take_lease", "cleanup_aborted"]

log = logging.getLogger(__name__)


def claim_root(storage: Storage, ctl: Agreement, life: Lifecycle, events: EventBus, *,
               coordinator: bool, use_lease: bool, ttl_seconds: float, job_name: str | None,
               fingerprint: str | None) -> tuple[Lease | None, FailureHistory]:
    """Collective over ``ctl``'s group. Returns (the lease on the coordinator when
    ``use_lease``, else None; the job's failure history, the same on every rank)."""
    lease, found_aborted = None, False
    if use_lease:
        lease, found_aborted = take_lease(storage, ctl, life, events, coordinator=coordinator,
                                          ttl_seconds=ttl_seconds, job_name=job_name,
                                          fingerprint=fingerprint)
    took_over = lease is not None and lease.took_over is not None
    history = load_job_history(storage, events, ctl, coordinator=coordinator,
                               took_over=took_over, found_aborted=found_aborted)
    return lease, history


def take_lease(storage: Storage, ctl: Agreement, life: Lifecycle, events: EventBus, *,
               coordinator: bool, ttl_seconds: float, job_name: str | None,
               fingerprint: str | None) -> tuple[Lease | None, bool]:
    """Collective over ``ctl``'s group. Returns (the lease on the coordinator, else None;
    whether leftovers of aborted saves were found)."""
    acquire_for_ranks(storage, ctl, coordinator, lifecycle=life,
                      ttl_seconds=ttl_seconds, job_name=job_name, fingerprint=fingerprint,
                      on_lost=lambda why: events.emit("lease_lost", reason=why))
    if not coordinator:
        return None, False
    lease = life.lease
    events.emit("lease_acquired", holder=lease.holder_id,
                took_over=lease.took_over is not None, generation=lease.generation)
    return lease, cleanup_aborted(storage, life, events)


def cleanup_aborted(storage: Storage, life: Lifecycle, events: EventBus) -> bool:
    """Remove the files of attempts whose writer is gone (every earlier generation).
    Returns whether any were found."""
    found = False

    def removed(step: int, names: list[str]) -> None:
        nonlocal found
        found = True
        events.emit("cleanup_aborted", step, files=len(names))
        log.info("removed %d leftover file(s) of aborted saves at step %d", len(names), step)

    try:
        life.cleanup(on_removed=removed)
    except Exception as exc:  # noqa: BLE001 - cleanup is best effort
        log.warning("could not clean up aborted saves under %s: %s", storage.url, exc)
    return found
