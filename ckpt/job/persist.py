"""The background half of a save: write the staged state, commit it, retry on failure.

``Persister.run`` is called on the manager's persist thread of every rank, in lockstep:
each decision is the outcome of a DCP collective, which every rank sees alike (a storage
failure on one rank fails the attempt on all, so all retry or give up together; so does an
abandon at shutdown, checked by each rank before it writes, inside DCP's first collective:
no collective of its own). Each attempt has its own save
id; after a final failure the coordinator removes exactly those attempts' files through the
life-cycle (:mod:`ckpt.root.lifecycle`). What happens after a commit (cadence, history, retention)
is the manager's business.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from ckpt.dcp import SaveCost, SaveRequest, api
from ckpt.errors import CheckpointError, FormatVersionError, LeaseLostError, SaveAbandoned
from ckpt.events import EventBus
from ckpt.format import Manifest
from ckpt.storage import backoff_seconds

__all__ = ["Persister", "PersistOutcome", "MAX_BACKOFF_SECONDS"]

log = logging.getLogger(__name__)

MAX_BACKOFF_SECONDS = 5.0
"""The longest pause between two attempts of a save (``retry_backoff_seconds`` doubles per
attempt up to this); no jitter: every rank pauses alike, see ``backoff_seconds``."""


@dataclass
class PersistOutcome:
    """How one save ended, the same on every rank (``manifest`` on the coordinator only)."""

    committed: bool
    manifest: Manifest | None = None
    already_committed: bool = False
    error: BaseException | None = None
    attempts: int = 0
    retries: int = 0
    persist_seconds: float = 0.0
    cost: SaveCost | None = None  # every attempt's phases (ckpt.dcp.savecost)


class Persister:
    """Writes staged saves for one job (see the module docstring for the contract)."""

    def __init__(self, request: SaveRequest, events: EventBus, group, *,
                 rank: int, max_attempts: int, retry_backoff_seconds: float,
                 abandon: threading.Event):
        assert request.lifecycle is not None  # a manager's saves write through its own
        self.life, self.storage = request.lifecycle, request.lifecycle.storage
        # What every attempt writes with (the manager's lifecycle, layout, span, threads and
        # save plans); each attempt adds its save id, cost and host window.
        self.request = replace(request, before_write=self._before_write,
                               before_commit=self._before_commit)
        self.events, self.group = events, group
        self.rank = rank
        self.max_attempts = max_attempts
        self.retry_backoff_seconds = retry_backoff_seconds
        self.abandon = abandon

    def _before_write(self) -> None:
        """Every rank, before it writes anything of an attempt: refuse when abandoned. DCP
        gathers this step's outcome from every rank, so one rank's ``SaveAbandoned`` fails
        the attempt on all of them alike (nothing written, no retry)."""
        if self.abandon.is_set():
            raise SaveAbandoned("save abandoned at shutdown before it was written")

    def _before_commit(self) -> None:
        """Coordinator, right before the commit: refuse when abandoned. Raising sends the
        same ``SaveAbandoned`` to every rank through DCP's result broadcast, so no rank
        retries alone. (The lease is checked by the commit itself.)"""
        if self.abandon.is_set():
            raise SaveAbandoned("save abandoned at shutdown before its commit; it stays "
                                "uncommitted and a later job removes its files")

    def run(self, step: int, staged: dict[str, Any], *, nbytes: int, stall: float,
            user_metadata: dict[str, Any], attachments: dict[str, Any] | None = None,
            host_window_bytes: int | None = None) -> PersistOutcome:
        """Save ``staged`` as ``step``, up to ``max_attempts`` times; report every attempt.

        ``attachments`` and ``host_window_bytes``: as for :func:`ckpt.dcp.api.save_with`.
        """
        retries_before = self.storage.retry.num_retries
        t0 = time.monotonic()
        cost = SaveCost()
        attempt_ids: list[str] = []

        def retries() -> int:
            return self.storage.retry.num_retries - retries_before + len(attempt_ids) - 1

        for attempt in range(1, self.max_attempts + 1):
            attempt_ids.append(uuid.uuid4().hex[:12])
            try:
                manifest = api.save_with(
                    staged, self.storage, step,
                    replace(self.request, save_id=attempt_ids[-1], cost=cost,
                            host_window_bytes=host_window_bytes),
                    user_metadata=user_metadata, attachments=attachments,
                    process_group=self.group)
                return PersistOutcome(True, manifest, attempts=attempt, retries=retries(),
                                      persist_seconds=time.monotonic() - t0, cost=cost)
            except BaseException as exc:  # noqa: BLE001 - reported, never silent
                if isinstance(exc, FileExistsError):
                    # Read back (every rank alike): did an earlier attempt of this save
                    # commit (its failure came after the manifest existed), or does another
                    # version count at this step? Anything else that says "exists" (a file
                    # where a folder belongs) is a failure like any other.
                    landed = self.life.committed_by(step, attempt_ids[:-1])
                    if landed is not None:
                        log.warning("checkpoint step %d: attempt %s had committed after all "
                                    "(read back)", step, landed.save_id)
                        return PersistOutcome(True, landed if self.rank == 0 else None,
                                              attempts=attempt - 1, retries=retries(),
                                              persist_seconds=time.monotonic() - t0,
                                              cost=cost)
                    if self._counts(step):
                        self.events.emit("save_skipped", step, reason="already committed",
                                         outcome="skipped")
                        return PersistOutcome(False, already_committed=True, attempts=attempt)
                abandoned = isinstance(exc, (SaveAbandoned, LeaseLostError))
                final = attempt == self.max_attempts or abandoned
                outcome = "abandoned" if abandoned else ("failed" if final else "retrying")
                self.events.emit("save_failed", step, error=f"{type(exc).__name__}: {exc}",
                                 attempt=attempt, final=final, outcome=outcome,
                                 stall_seconds=stall, bytes=nbytes,
                                 persist_seconds=time.monotonic() - t0, retries=retries())
                log.error("checkpoint save of step %d failed (attempt %d/%d%s): %s", step,
                          attempt, self.max_attempts, "" if final else ", retrying", exc)
                if final:
                    if not abandoned:
                        self._remove_attempts(step, attempt_ids)
                    return PersistOutcome(False, error=exc, attempts=attempt,
                                          retries=retries(), cost=cost,
                                          persist_seconds=time.monotonic() - t0)
                time.sleep(backoff_seconds(attempt, self.retry_backoff_seconds,
                                           MAX_BACKOFF_SECONDS))
        raise AssertionError("unreachable: the last attempt returns")

    def close(self) -> None:
        """Nothing to stop: the persist thread is the manager's (a writer process's
        counterpart, :class:`ckpt.job._writer_process.WriterProcess`, stops its process)."""

    def _counts(self, step: int) -> bool:
        """Does a committed version count at ``step`` (or one of a newer format, never
        touched), as readers read it? A save refused by such a step is "already committed";
        refused by anything else, it failed."""
        try:
            self.life.read_committed(step)
        except FormatVersionError:
            return True
        except (CheckpointError, OSError):
            return False
        return True

    def _remove_attempts(self, step: int, attempt_ids: list[str]) -> None:
        """Coordinator, after a final failure: remove the files of this save's attempts.

        Every rank has returned from the failed DCP call (its result is gathered from all),
        so nobody writes there any more. Only these attempts' files are touched: another
        writer's never are. Best effort: a later job removes what is left.
        """
        lease = self.life.lease
        if self.rank != 0 or (lease is not None and not lease.held):
            return
        try:
            for save_id in attempt_ids:
                self.life.abandon(step, save_id)
        except Exception as exc:  # noqa: BLE001
            log.warning("could not remove the files of failed save %d: %s", step, exc)

