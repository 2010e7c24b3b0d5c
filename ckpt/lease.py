"""One writer per checkpoint root: a lease with a heartbeat, on any backend.

The lease is a small JSON object ``_lease.json`` at the root. A job acquires it by creating
it exclusively (``create_exclusive``: link on local disk, ``If-None-Match`` on S3). The
holder rewrites it every ``heartbeat_seconds`` with a compare-and-swap
(``replace_if_unchanged``: ``If-Match`` on S3). A lease whose heartbeat is older than
``ttl_seconds`` belongs to a dead job and may be taken over, again by compare-and-swap, so
of two jobs racing for a stale lease only one wins. Clocks of the hosts involved must agree
to well within ``ttl_seconds``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable

from ckpt.errors import LeaseHeldError
from ckpt.storage import Storage

__all__ = ["Lease", "LEASE_NAME"]

log = logging.getLogger(__name__)
LEASE_NAME = "_lease.json"


class Lease:
    """The write lease on one checkpoint root. Only one rank of a job (rank 0) holds it."""

    def __init__(self, storage: Storage, *, ttl_seconds: float = 60.0,
                 heartbeat_seconds: float | None = None, job_name: str | None = None,
                 on_lost: Callable[[str], None] | None = None):
        if ttl_seconds <= 0:
            raise ValueError(f"lease ttl_seconds must be > 0, got {ttl_seconds}")
        self.storage = storage
        self.ttl_seconds = ttl_seconds
        self.heartbeat_seconds = heartbeat_seconds or ttl_seconds / 4
        self.holder_id = uuid.uuid4().hex[:16]
        self.job_name = job_name or os.environ.get("TORCHELASTIC_RUN_ID") or "job"
        self.on_lost = on_lost
        self.took_over: dict[str, Any] | None = None  # the dead holder's record, if any
        self._current: bytes | None = None
        self._stop = threading.Event()
        # The heartbeat thread and a commit (which renews the lease right before writing the
        # manifest) may renew at once; unserialised, the loser's compare-and-swap would see
        # the winner's record and wrongly conclude the lease was taken.
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.lost = False

    def _record(self, acquired: float) -> bytes:
        return json.dumps({
            "holder": self.holder_id, "job": self.job_name, "host": socket.gethostname(),
            "pid": os.getpid(), "acquired_unix": acquired, "heartbeat_unix": time.time(),
            "ttl_seconds": self.ttl_seconds,
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
            "boot_id": _boot_id(),
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        }).encode()

    def read(self) -> tuple[dict[str, Any] | None, bytes | None]:
        try:
            raw = self.storage.read_bytes(LEASE_NAME)
        except FileNotFoundError:
            return None, None
        try:
            return json.loads(raw), raw
        except ValueError:
            return {"holder": "?", "heartbeat_unix": 0, "ttl_seconds": 0}, raw

    @property
    def held(self) -> bool:
        return self._current is not None and not self.lost

    def acquire(self) -> None:
        """Take the lease or raise ``LeaseHeldError`` naming the live holder."""
        now = time.time()
        mine = self._record(now)
        for _ in range(5):
            try:
                self.storage.create_exclusive(LEASE_NAME, mine)
                self._current = mine
                break
            except FileExistsError:
                pass
            info, raw = self.read()
            if info is None:
                continue  # released between our attempts: try to create again
            age = time.time() - float(info.get("heartbeat_unix", 0))
            ttl = float(info.get("ttl_seconds", self.ttl_seconds) or self.ttl_seconds)
            dead = self._known_dead(info)
            if age <= ttl and not dead:
                raise LeaseHeldError(
                    f"checkpoint root {self.storage.url} is in use by job "
                    f"{info.get('job')!r} (host {info.get('host')}, pid {info.get('pid')}, "
                    f"holder {info.get('holder')}); its last heartbeat was {age:.0f}s ago "
                    f"(lease expires after {ttl:.0f}s without one). Stop that job, wait for "
                    f"its lease to expire, or use another checkpoint root.")
            if self.storage.replace_if_unchanged(LEASE_NAME, mine, raw):
                log.warning("took over the lease on %s from a dead job (%s, last heartbeat %.0fs "
                            "ago%s)", self.storage.url, info.get("holder"), age,
                            f"; {dead}" if dead else "")
                self.took_over = info
                self._current = mine
                break
        else:
            raise LeaseHeldError(f"could not acquire the lease on {self.storage.url}: it kept "
                                 f"changing under us; another job is starting on this root")
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="ckpt-lease", daemon=True)
        self._thread.start()

    def _known_dead(self, info: dict[str, Any]) -> str:
        """Why the holder is certainly dead before its TTL ran out ('' if not known).

        * an earlier attempt of this same torchrun job (same run id, lower restart count):
          the elastic agent restarts every worker, so that attempt is gone;
        * a process on this very host whose pid no longer exists.
        """
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if run_id and info.get("run_id") == run_id and int(info.get("attempt", 0)) < attempt:
            return f"an earlier attempt ({info.get('attempt')}) of this job"
        # Same host name and same kernel boot: the pid namespace is ours to check (host
        # names alone repeat across containers).
        if (info.get("host") == socket.gethostname() and info.get("boot_id")
                and info.get("boot_id") == _boot_id() and isinstance(info.get("pid"), int)):
            try:
                os.kill(info["pid"], 0)
            except ProcessLookupError:
                return f"process {info['pid']} on this host is gone"
            except OSError:
                pass
        return ""

    def heartbeat(self) -> bool:
        """Renew the lease now. Returns False (and marks it lost) if someone else took it.

        Thread-safe. A storage error is not a loss (returns True): the lease only changes
        hands after ``ttl_seconds`` without a heartbeat.
        """
        with self._lock:
            return self._heartbeat_locked()

    def _heartbeat_locked(self) -> bool:
        if self._current is None or self.lost:
            return False
        info = json.loads(self._current)
        new = self._record(info["acquired_unix"])
        try:
            ok = self.storage.replace_if_unchanged(LEASE_NAME, new, self._current)
        except Exception as exc:  # noqa: BLE001 - a storage hiccup is not a lost lease
            log.warning("lease heartbeat on %s failed: %s", self.storage.url, exc)
            return True
        if ok:
            self._current = new
            return True
        self.lost = True
        log.error("lost the lease on %s: another job took it over", self.storage.url)
        if self.on_lost:
            self.on_lost("taken over by another job")
        return False

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            if not self.heartbeat():
                return

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            if self._current is not None and not self.lost:
                try:
                    info, raw = self.read()
                    if raw == self._current:
                        self.storage.delete(LEASE_NAME)
                except Exception as exc:  # noqa: BLE001
                    log.warning("could not release the lease on %s: %s", self.storage.url, exc)
            self._current = None


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None
