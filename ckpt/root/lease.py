"""One writer per checkpoint root: a lease with a heartbeat and a generation, on any backend.

The lease is a small JSON object ``_lease.json`` at the root. A job acquires it by creating
it exclusively (``create_exclusive``: link on local disk, ``If-None-Match`` on S3) or, when
the record there is released, stale or its holder is known dead, by a compare-and-swap
(``replace_if_unchanged``: ``If-Match`` on S3). The holder rewrites it every
``heartbeat_seconds`` by compare-and-swap. Every acquisition takes the next *generation*
(a counter kept in the record, which is never deleted: release marks it released), so the
writers of a root form a sequence that fencing (:mod:`ckpt.root.fence`) relies on.

Becoming a root's writer is :func:`acquire_lease` (the lease, then every earlier open
generation closed by the fence, so their late manifests never count); a job of several
ranks takes it on its coordinator with :func:`acquire_for_ranks`; :func:`release_lease`
closes the writer's generation and lets the lease go. Every writing path (a manager,
``ckpt.save``, the CLI) goes through these three.

The swap is atomic against the record it compares on every backend, also for a holder that
stalls (a GC or VM pause, SIGSTOP) inside it: on S3 the ``If-Match`` is checked when the
``PUT`` arrives; on local disk the new record lands by a rename out of the swapper's lock,
which fails once that lock was broken as stale
(:meth:`ckpt.storage._local.LocalBackend.replace_if_unchanged`). So for a holder A and a job
B that finds A's record stale and takes it over, whatever the interleaving:

* A's renewal lands before B's compare: B's swap fails, B reads again (A's renewal carries
  the heartbeat time A took before it stalled, so B may find it stale again and take it
  over; or fresh and leave it): either A keeps the lease, or A's next swap fails;
* B's swap lands first: A's swap, however late, fails; A marks the lease lost.

A swap that failed means lost, once and for good (``lost``; ``on_lost`` is called once). A
holder also reads back what it renewed: the heartbeat right after its swap, and the commit
before its manifest (``check``, which reads the record the previous renewal wrote), so a
record that is not its own any more is noticed at the next of them whatever wrote it.

Taking over before the TTL ran out needs proof that the holder is dead (``_known_dead``):
the same process id gone on this very host and boot, or an earlier attempt of this same
job, which requires a run id (torchrun's explicit ``--rdzv-id`` or a ``--standalone``
random one, never the default ``none``; or the Slurm job's: :mod:`ckpt.ranks.launcher`), a
lower attempt and the same job fingerprint. Clocks of the hosts
involved must agree to well within ``ttl_seconds``.

Size: one concept, the lease: its record, its heartbeat, and taking and releasing it for
one rank or a group of ranks (with the fence that closes earlier generations); split, the
take-over rules would be read in two places.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any, Callable

from ckpt.errors import CorruptCheckpointError, LeaseHeldError, RankFailuresError
from ckpt.format import jsonio
from ckpt.ranks.launcher import launcher_run
from ckpt.root.lifecycle import Lifecycle
from ckpt.storage import Storage

__all__ = ["Lease", "LEASE_NAME", "MAX_LEASE_BYTES", "read_lease", "acquire_lease",
           "acquire_for_ranks", "release_lease", "DEFAULT_LEASE_TTL_SECONDS"]

log = logging.getLogger(__name__)
LEASE_NAME = "_lease.json"
MAX_LEASE_BYTES = 1 << 20
"""The most a lease record may hold (it holds a dozen fields): a larger ``_lease.json`` is
never read, nor compared beyond this many bytes."""
DEFAULT_LEASE_TTL_SECONDS = 60.0
"""How long a lease outlives its last heartbeat unless its holder says otherwise."""


def _program() -> str:
    """This process's program, the name of a job that gave none: its script (``train.py``),
    ``python -m pkg`` for a module run with ``-m``, else ``python``."""
    argv0 = sys.argv[0] if sys.argv and isinstance(sys.argv[0], str) else ""
    name = os.path.basename(argv0)
    if name == "__main__.py":
        return f"python -m {os.path.basename(os.path.dirname(argv0))}"
    return name if name not in ("", "-c", "-") else "python"


def _int(v: Any, default: int = 0) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and abs(v) < 1 << 62 else default


def _num(v: Any, default: float = 0.0) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return default
    v = float(v)
    return v if v == v and abs(v) < 1e15 else default


class Lease:
    """The write lease on one checkpoint root. Only one process of a job (rank 0) holds it.

    ``generation`` is this holding's number (1, 2, ...); ``committed_ids`` collects the save ids this
    holder committed (written into the generation's close record at release).
    """

    def __init__(self, storage: Storage, *, ttl_seconds: float = DEFAULT_LEASE_TTL_SECONDS,
                 heartbeat_seconds: float | None = None, job_name: str | None = None,
                 on_lost: Callable[[str], None] | None = None, fingerprint: str | None = None):
        if not ttl_seconds > 0:
            raise ValueError(f"lease ttl_seconds must be > 0, got {ttl_seconds}")
        self.storage = storage
        self.ttl_seconds = ttl_seconds
        self.heartbeat_seconds = heartbeat_seconds or ttl_seconds / 4
        self.holder_id = uuid.uuid4().hex[:16]
        self.run = launcher_run()  # torchrun's or Slurm's: which attempt of which run
        self.job_name = job_name or (self.run.name if self.run else _program())
        self.fingerprint = fingerprint
        self.on_lost = on_lost
        self.took_over: dict[str, Any] | None = None  # the dead holder's record, if any
        self.generation = 0
        self.committed_ids: set[str] = set()
        self._acquired = 0.0
        self._current: bytes | None = None
        self._renewed = float("-inf")  # time.monotonic() of the last swap that succeeded
        self._stop = threading.Event()
        # The heartbeat thread and a commit (which renews the lease around the manifest)
        # may renew at once; unserialised, the loser's compare-and-swap would see the
        # winner's record and wrongly conclude the lease was taken.
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.lost = False

    def _record(self, *, released: bool = False) -> bytes:
        return jsonio.dumps({
            "holder": self.holder_id, "job": self.job_name, "host": socket.gethostname(),
            "pid": os.getpid(), "acquired_unix": self._acquired, "heartbeat_unix": time.time(),
            "ttl_seconds": self.ttl_seconds, "run_id": self.run and self.run.run_id,
            "boot_id": _boot_id(), "attempt": self.run.attempt if self.run else 0,
            "fingerprint": self.fingerprint,
            "generation": self.generation,
            "released": released,
        })

    def read(self) -> tuple[dict[str, Any] | None, bytes | None]:
        """The record at the root and its bytes, or (None, None). A damaged one reads as
        stale. One that cannot be read as a record at all (larger than
        ``MAX_LEASE_BYTES``: refused unread; a link) reads as damaged with no bytes
        (``problem`` says why): no swap can take it over (``acquire`` refuses it)."""
        try:
            raw = self.storage.read_bytes(LEASE_NAME, max_bytes=MAX_LEASE_BYTES)
        except FileNotFoundError:
            return None, None
        except CorruptCheckpointError as exc:  # said once, by whoever acts on it
            return {"holder": "?", "heartbeat_unix": 0, "ttl_seconds": 0, "damaged": True,
                    "problem": str(exc)}, None
        try:
            info = jsonio.loads(raw, self.storage.describe(LEASE_NAME),
                                max_bytes=MAX_LEASE_BYTES)
        except CorruptCheckpointError:
            info = None
        if not isinstance(info, dict):
            log.warning("the lease file %s is damaged; treating it as expired",
                        self.storage.describe(LEASE_NAME))
            info = {"holder": "?", "heartbeat_unix": 0, "ttl_seconds": 0, "damaged": True}
        return info, raw

    @property
    def held(self) -> bool:
        return self._current is not None and not self.lost

    def acquire(self, *, force: bool = False, min_generation: int = 1,
                heartbeat: bool = True) -> None:
        """Take the lease or raise ``LeaseHeldError`` naming the live holder.

        ``force`` takes a live holder's lease too (it is fenced off: its commits stop
        counting). ``min_generation``: the generation is at least this (the caller knows
        of closed generations that a fresh lease file must not reuse).
        """
        self._acquired = time.time()
        for _ in range(8):
            info, raw = self.read()
            if info is None:
                self.generation = max(1, min_generation)
                mine = self._record()
                try:
                    self.storage.create_exclusive(LEASE_NAME, mine)
                except FileExistsError:
                    continue
                self._current = mine
                self._renewed = time.monotonic()
                break
            if raw is None:  # not a record: nothing a compare-and-swap could take over
                raise CorruptCheckpointError(info["problem"],
                                             path=self.storage.describe(LEASE_NAME))
            why = self.expired_because(info, force=force)
            if why is None:
                raise LeaseHeldError(
                    f"checkpoint root {self.storage.url} is in use by job "
                    f"{info.get('job')!r} (host {info.get('host')}, pid {info.get('pid')}, "
                    f"holder {info.get('holder')}); its last heartbeat was "
                    f"{time.time() - _num(info.get('heartbeat_unix')):.0f}s ago (the lease "
                    f"expires after {_num(info.get('ttl_seconds')):.0f}s without one). Stop that "
                    f"job, wait for its lease to expire, or use another checkpoint root.")
            self.generation = max(_int(info.get("generation")) + 1, min_generation, 1)
            mine = self._record()
            if self.storage.replace_if_unchanged(LEASE_NAME, mine, raw):
                self._current = mine
                self._renewed = time.monotonic()
                if why != "released":
                    self.took_over = info
                    log.warning("took over the lease on %s from %s (%s)", self.storage.url,
                                info.get("holder"), why)
                break
        else:
            raise LeaseHeldError(f"could not acquire the lease on {self.storage.url}: it kept "
                                 f"changing under us; another job is starting on this root")
        self.lost = False
        self._stop.clear()
        if heartbeat:
            self._thread = threading.Thread(target=self._beat, name="ckpt-lease", daemon=True)
            self._thread.start()

    def expired_because(self, info: dict[str, Any], *, force: bool = False) -> str | None:
        """Why the lease ``info`` may be taken now, or None while its holder is alive."""
        if info.get("released") is True:
            return "released"
        if info.get("damaged"):
            return "the lease file is damaged"
        age = time.time() - _num(info.get("heartbeat_unix"))
        ttl = _num(info.get("ttl_seconds"), self.ttl_seconds) or self.ttl_seconds
        if age > ttl:
            return f"last heartbeat {age:.0f}s ago, past its {ttl:.0f}s TTL"
        dead = self._known_dead(info)
        if dead:
            return dead
        if force:
            return "forced"
        return None

    def _known_dead(self, info: dict[str, Any]) -> str:
        """Why the holder is certainly dead before its TTL ran out ('' if not known).

        * an earlier attempt of this same run (:mod:`ckpt.ranks.launcher`): the same run
          id (torchrun's explicitly set one, or the Slurm job's; torchrun's default ``none``
          proves nothing: unrelated jobs share it), a lower attempt (restart count) and the
          same job fingerprint; the elastic agent restarts every worker, and Slurm starts
          a requeued job once its previous run ended, so that attempt is gone;
        * a process on this very host (same boot) whose pid no longer exists.
        """
        run = self.run
        if (run is not None and info.get("run_id") == run.run_id
                and _int(info.get("attempt"), 1 << 30) < run.attempt
                and info.get("fingerprint") == self.fingerprint):
            return (f"an earlier attempt ({info.get('attempt')}) of this job (run id "
                    f"{run.run_id})")
        # Same host name and same kernel boot: the pid namespace is ours to check (host
        # names alone repeat across containers).
        pid = info.get("pid")
        if (info.get("host") == socket.gethostname() and info.get("boot_id")
                and info.get("boot_id") == _boot_id() and _int(pid) > 0):
            if pid == os.getpid():
                return ""
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return f"process {pid} on this host is gone"
            except OSError:
                pass
        return ""

    def heartbeat(self) -> bool:
        """Renew the lease now, then read the record back. Returns False (and marks it
        lost) if someone else took it.

        Thread-safe. A storage error is not a loss (returns True): the lease only changes
        hands after ``ttl_seconds`` without a heartbeat. The read-back costs one read per
        heartbeat, off the training thread; a commit's renewal is read back by the next
        commit's ``check`` instead.
        """
        with self._lock:
            try:
                return self._renew_locked() and self._still_ours_locked()
            except Exception as exc:  # noqa: BLE001 - a storage hiccup is not a lost lease
                log.warning("lease heartbeat on %s failed: %s", self.storage.url, exc)
                return True

    def confirm(self, *, within: float = 0.0) -> bool:
        """Renew the lease now and say whether it is still ours, for certain.

        Unlike ``heartbeat`` a storage error propagates: the commit protocol needs a
        renewal that happened, not one that may have. ``within``: a renewal that succeeded
        less than ``within`` seconds ago (a heartbeat, the previous commit's) is taken
        instead, without a request: it proves the lease was ours that recently, which is
        all a step that no later step can fence needs (never the proof after a commit,
        which must come after the manifest).
        """
        with self._lock:
            if within > 0 and self.held and time.monotonic() - self._renewed < within:
                return True
            return self._renew_locked()

    def check(self) -> bool:
        """Say whether the lease is still ours, for certain, by reading the record (is it
        still the one this holder wrote last?) without renewing it: one read, cheaper than
        a swap on every backend (no write, no sync). A record that changed marks the lease
        lost. Storage errors propagate, as for ``confirm``."""
        with self._lock:
            if self._current is None or self.lost:
                return False
            return self._still_ours_locked()

    def _still_ours_locked(self) -> bool:
        """Whether the record is still the one this holder wrote last (one read); marks
        the lease lost when it is not."""
        try:
            stored = self.storage.read_bytes(LEASE_NAME, max_bytes=MAX_LEASE_BYTES)
        except (FileNotFoundError, CorruptCheckpointError):  # gone, or no record of ours
            stored = None
        if stored == self._current:
            return True
        self._mark_lost("taken over by another job")
        return False

    def _renew_locked(self) -> bool:
        if self._current is None or self.lost:
            return False
        new = self._record()
        if self.storage.replace_if_unchanged(LEASE_NAME, new, self._current):
            self._current = new
            self._renewed = time.monotonic()
            return True
        self._mark_lost("taken over by another job")
        return False

    def _mark_lost(self, why: str) -> None:
        self.lost = True
        log.error("lost the lease on %s: %s", self.storage.url, why)
        if self.on_lost:
            self.on_lost(why)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            if not self.heartbeat():
                return

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def release(self) -> None:
        """Stop the heartbeat and mark the lease released if it is still ours.

        The record stays (released) so that the next holder continues the generation
        count.
        """
        self.stop_heartbeat()
        with self._lock:
            if self._current is not None and not self.lost:
                try:
                    self.storage.replace_if_unchanged(LEASE_NAME, self._record(released=True),
                                                      self._current)
                except Exception as exc:  # noqa: BLE001
                    log.warning("could not release the lease on %s: %s", self.storage.url, exc)
            self._current = None


def read_lease(storage: Storage) -> dict[str, Any] | None:
    """The lease record at ``storage``'s root (None if absent) for display and checks."""
    return Lease(storage).read()[0]


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def acquire_lease(storage: Storage, *, ttl_seconds: float = DEFAULT_LEASE_TTL_SECONDS,
                  job_name: str | None = None,
                  fingerprint: str | None = None, force: bool = False,
                  on_lost: Callable[[str], None] | None = None,
                  heartbeat: bool = True, lifecycle: Lifecycle | None = None) -> Lifecycle:
    """Take the write lease on ``storage`` and fence off every earlier writer.

    The one way any writing path (the manager, ``ckpt.save``, the CLI) becomes the writer
    of a root. Returns the ``Lifecycle`` to write through (``lifecycle`` if given, now
    holding the lease); release with ``release_lease``. Raises ``LeaseHeldError`` when a live
    job holds the lease (unless ``force``, which fences that job off).
    """
    life = lifecycle or Lifecycle(storage)
    life.forget_known()  # a new holding: list again (cleanup does, or the first use)
    opened, closed = life.fence.generations()
    lease = Lease(storage, ttl_seconds=ttl_seconds, job_name=job_name, on_lost=on_lost,
                  fingerprint=fingerprint)
    lease.acquire(force=force, min_generation=max(opened | closed, default=0) + 1,
                  heartbeat=heartbeat)
    life.lease = lease
    try:
        # Mark the generation used before any manifest carries it, so that it is never
        # handed out again (not even after a damaged or deleted lease file).
        life.fence.mark(lease.generation, "open", lease.holder_id)
        for g in sorted(opened - closed):
            if g < lease.generation:
                life.fence.close(g, life.manifests(), closed_by=lease.holder_id)
    except BaseException:
        lease.release()
        raise
    return life


def acquire_for_ranks(storage: Storage, agreement, coordinator: bool, *,
                      lifecycle: Lifecycle | None = None, **lease_options: Any) -> Lifecycle:
    """``acquire_lease`` on the coordinator, for a job of several ranks: every rank of
    ``agreement``'s group returns (the coordinator's ``Lifecycle`` holds the lease) or raises
    the same ``LeaseHeldError`` (a live holder), or ``CorruptCheckpointError`` (a lease file
    that is no record); when the coordinator fails otherwise (a storage error), it raises that
    error and every other rank a ``RankFailuresError`` carrying its text, at once rather than
    after the group's timeout. Collective."""
    life = lifecycle or Lifecycle(storage)
    error = ["", ""]
    failure: BaseException | None = None
    if coordinator:
        try:
            acquire_lease(storage, lifecycle=life, **lease_options)
        except LeaseHeldError as exc:
            error = ["held", str(exc)]
        except CorruptCheckpointError as exc:  # told to every rank, not left to a timeout
            error = ["corrupt", str(exc)]
        except Exception as exc:  # noqa: BLE001 - a storage error: told to every rank too
            failure, error = exc, ["failed", f"{type(exc).__name__}: {exc}"]
    kind, error = agreement.broadcast(error)
    if kind:
        if coordinator and life.lease is not None and life.lease.held:
            release_lease(life)
        if kind == "corrupt":
            raise CorruptCheckpointError(error, path=storage.describe(LEASE_NAME))
        if kind == "failed":
            if failure is not None:
                raise failure
            raise RankFailuresError(f"taking the write lease on {storage.url}", {0: error})
        raise LeaseHeldError(error)
    return life


def release_lease(life: Lifecycle) -> None:
    """Close this writer's generation (listing what it committed), then release the lease."""
    lease = life.lease
    if lease is None:
        return
    if lease.held:
        try:
            lease.stop_heartbeat()
            life.fence.write_close(lease.generation, lease.committed_ids, lease.holder_id,
                                   closed_by=lease.holder_id)
        except Exception as exc:  # noqa: BLE001 - the next holder closes it by listing
            log.warning("could not close lease generation %d on %s: %s", lease.generation,
                        life.storage.url, exc)
    lease.release()
