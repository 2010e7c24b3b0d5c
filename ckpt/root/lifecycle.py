r"""The life of a checkpoint folder, and the fence that makes a commit count.

Every transition of a checkpoint happens here; the manager, ``ckpt.save``, the CLI and the
trainer call these functions and never spell a file name themselves.

One attempt to save step N is identified by its save id (12 hex digits; each retry is a new
attempt with a new id)::

    (absent) --begin--> PENDING --commit--> COMMITTED --uncommit--> ROLLED-BACK
                          |                  |     ^                    |
                       abandon            delete    \------restore------/
                          v                  v                   delete (gc --rolled-back)
                      (removed)          (removed)                      v
                                                                    (removed)
    PENDING of an ended lease generation ----cleanup----> (removed)
    a manifest created by a writer whose lease generation had ended: FENCED, never read;
    moved aside by the next commit of that step, removed by cleanup
    a manifest no reader can read (damaged, or moved aside as damaged): KEPT with whatever
    it may reference, by cleanup, gc and deletes alike; removed only by ``remove_damaged``
    (``ckpt gc --damaged``); one of a newer format: never touched, nor its folder

    A version copied in from another root (a node's local checkpoint on its peer, or
    fetched back from it) lives the same life: ``begin`` under its own save id, its files
    written and verified by the caller, then ``commit_copy`` (the manifest re-issued under
    this root's lease) instead of ``commit``; ``abandon`` when the copy fails.

Names inside ``step_NNNNNNNNN/`` (each built and recognised by :mod:`ckpt.format._schema`
alone; written by this module, but for the data, part and attachment files, which the
writer, ``ckpt.dcp.writer``, writes under the names it asks for there)::

    pending-<id>.json       attempt marker, written before any data: writer, lease generation
    r<rank>_<id>_<k>.bin    data files of attempt <id> (``data_file_name``)
    part-r<rank>_<id>.json  rank <rank>'s part of attempt <id> (format version 2: the chunks
                            of sharded tensors it wrote); listed in its manifest's ``files``
    a_<id>_<name>           attachment <name> of attempt <id> (``attachment_file``), written
                            by the coordinator; a version's manifest lists it in ``files``
                            too, so it is referenced, verified and deleted with its version
    manifest.json           the commit: created exclusively, never overwritten
    rolled-back-<id>.json   an un-committed manifest, kept and restorable
    fenced-<id>.json        a fenced-off writer's late manifest, moved aside
    damaged-manifest-<hex>.json  a damaged manifest moved aside before its step is committed again

The fence files under ``_fence/`` (which manifests count once the lease changed hands)
are :mod:`ckpt.root.fence`'s; the life-cycle asks it (``is_fenced``) and a new writer closes
earlier generations through it (:func:`ckpt.root.lease.acquire_lease`). A writer learns
that its commit counts by renewing the lease *after* the manifest exists: a renewal that
succeeds proves that no takeover (and so no closing of its generation) came before it.

The writer's requests per save are few on purpose (docs/performance.md, "Storage requests
and collectives per save"): it knows which steps hold a manifest (``known_committed``:
listed once, then kept by its own transitions, since only the lease holder makes them), it
does not read back what it committed and proved, and it deletes in bulk.

Size: the state machine, every file name and every transition are kept in this one module
on purpose, so that the life-cycle reads top to bottom in one place.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Protocol

from ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FencedCheckpointError,
    FormatVersionError,
    LeaseLostError,
)
from ckpt.format import (
    LEGACY_MARKER_NAME,
    LEGACY_ROLLED_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Lineage,
    Manifest,
    damaged_manifest_name,
    data_file_id,
    fenced_id,
    fenced_name,
    is_damaged_manifest,
    jsonio,
    marker_id,
    marker_name,
    parse_step_dirname,
    rolled_back_id,
    rolled_back_name,
    step_dirname,
    step_file,
)
from ckpt.root.fence import Fence
from ckpt.root.lineage import record_restore
from ckpt.root.verify import verify_checkpoint
from ckpt.storage import Storage

__all__ = [
    "COMMITTED", "INCOMPLETE", "CORRUPT", "ROLLED_BACK", "FENCED", "MOVED_ASIDE",
    "Entry", "Lifecycle", "WriterLease", "parse_marker",
]

log = logging.getLogger(__name__)

COMMITTED, INCOMPLETE, CORRUPT, ROLLED_BACK, FENCED, MOVED_ASIDE = (
    "committed", "incomplete", "corrupt", "rolled-back", "fenced", "moved-aside")

_TMP_RE = re.compile(r"\.(tmp|swap-lock)-?[0-9a-f]*$")  # a storage write in progress


MAX_MARKER_BYTES = 1 << 20
"""The most an attempt marker may hold (it holds a few fields)."""


class WriterLease(Protocol):
    """The write lease as the life-cycle uses it: :class:`ckpt.root.lease.Lease` (taken by
    :func:`ckpt.root.lease.acquire_lease`), or a stand-in that answers for the process
    holding it (a writer process's)."""

    holder_id: str
    generation: int
    job_name: str | None
    ttl_seconds: float
    committed_ids: set[str]

    @property
    def held(self) -> bool: ...

    def confirm(self, *, within: float = 0.0) -> bool: ...

    def check(self) -> bool: ...


@dataclass
class Entry:
    """One version of one step as an operator sees it (``ckpt list --all`` prints these)."""

    step: int
    id: str | None
    status: str
    name: str
    manifest: Manifest | None = None
    problem: str | None = None
    marker: dict[str, Any] | None = None
    bytes: int = 0
    holds: frozenset[str] | None = frozenset()
    """For a manifest that cannot be read (corrupt or moved aside, no ``manifest``): the
    attempt ids of its folder that its bytes still name, whose files are kept; None when
    its bytes cannot be read at all, or it is of a newer format: nothing in its folder is
    removed (see ``_dead_files``)."""
    newer: bool = False
    """Written by a newer ckpt (``FormatVersionError``): never touched by this one."""


@dataclass
class _Folder:
    step: int
    files: dict[str, int] = field(default_factory=dict)  # name -> size


def _attempt_of(name: str) -> str | None:
    """The attempt a file of ours belongs to: its data, part and attachment files, its
    marker and its fenced manifest; None for any other name."""
    return marker_id(name) or fenced_id(name) or data_file_id(name)


def _unreadable(entries: list[Entry]) -> list[Entry]:
    """The entries of manifests that cannot be read: someone's committed data."""
    return [e for e in entries if e.manifest is None and e.status in (CORRUPT, MOVED_ASIDE)]


def _dead_files(folder: _Folder, entries: list[Entry]) -> list[str]:
    """Names in ``folder`` that belong to dead attempts (docs/store.md, "What gc removes").

    A name is ours (data, part, attachment, marker, fenced manifest, temporary file) and
    referenced by no manifest or rolled-back manifest that counts (a fenced one's files
    are dead too). In a folder that also holds a manifest that cannot be read (damaged,
    moved aside as damaged, or unreadable), it must moreover belong to an attempt whose
    marker is there (written before any data and removed after a commit, so the attempt
    began) and whose id that manifest's bytes do not name (its own files are named in it):
    a file that may be the unreadable manifest's is kept. Nothing is dead in a folder
    holding a manifest of a newer format or one whose bytes cannot be read at all.
    """
    keep: set[str] = set()
    for e in entries:
        if e.manifest is not None and e.status != FENCED:
            keep |= set(e.manifest.files)
    unreadable = _unreadable(entries)
    if any(e.holds is None or e.newer for e in unreadable):
        return []
    named = set().union(*(e.holds for e in unreadable))
    begun = {i for i in map(marker_id, folder.files) if i}

    def dead(name: str) -> bool:
        if name in keep or name == MANIFEST_NAME or rolled_back_id(name) \
                or name == LEGACY_ROLLED_NAME:
            return False
        if _TMP_RE.search(name):
            return True  # an unfinished write: never the only copy of anything
        if not unreadable:
            return bool(_attempt_of(name) or name == LEGACY_MARKER_NAME)
        attempt = _attempt_of(name)
        return attempt is not None and attempt in begun and attempt not in named

    return sorted(name for name in folder.files if dead(name))


def parse_marker(data: bytes, source: str) -> dict[str, Any]:
    """An attempt marker (``pending-<id>.json``) as a dict (``save_id``, ``owner``, ...).

    Raises ``CorruptCheckpointError`` (a ``ValueError``) naming ``source`` when it is not
    a JSON object or ``owner``/``save_id`` have the wrong type.
    """
    doc = jsonio.loads(data, source, max_bytes=MAX_MARKER_BYTES)
    if not isinstance(doc, dict) or not isinstance(doc.get("owner"), (str, type(None))) \
            or not isinstance(doc.get("save_id", ""), str):
        raise CorruptCheckpointError(
            f"{source}: attempt marker is damaged: expected an object with string 'owner' and "
            f"'save_id'; `ckpt gc` removes it once no save is running", path=source)
    return doc


class Lifecycle:
    """Every transition of the checkpoint folders under one root.

    Read-side methods (``read_committed``, ``entries``, ``is_fenced``) are safe from any
    process. Write-side methods need the write lease (``lease``) and are called by one
    process only, the lease holder (rank 0 of a job, or a CLI command).
    """

    def __init__(self, storage: Storage, lease: WriterLease | None = None, *,
                 defer_marker_removal: bool = False):
        self.storage = storage
        self.lease = lease
        self.fence = Fence(storage)
        # With ``defer_marker_removal`` a commit leaves its (inert) marker for the next
        # ``delete`` or ``remove_committed_markers`` to remove along with other files (one
        # bulk request on S3); these are the markers waiting.
        self.defer_marker_removal = defer_marker_removal
        self._committed_markers: list[str] = []
        # The steps whose folder holds a manifest.json, as this writer knows them (None:
        # not listed yet); see ``known_committed``. The lock is held across the one listing
        # so that a transition meanwhile is not lost.
        self._known: set[int] | None = None
        self._known_lock = threading.RLock()
        # step -> save id of the manifest this holder committed there and proved (the
        # renewal after it succeeded): ``delete`` needs not read it back.
        self._proven: dict[int, str] = {}
        # The lineage the versions saved through this life-cycle record (the run saving
        # them: :mod:`ckpt.root.lineage`); None: none recorded (``ckpt.save``).
        self.lineage: Lineage | None = None

    def is_fenced(self, manifest: Manifest) -> bool:
        """True when ``manifest`` was created after its writer lost the lease (see
        :meth:`ckpt.root.fence.Fence.is_fenced`). A manifest whose commit this very holder
        proved (the renewal after it succeeded) counts for good, without a request:
        acceptance never flips back."""
        lease = self.lease
        if (lease is not None and manifest.save_id in lease.committed_ids
                and manifest.writer.get("owner") == lease.holder_id
                and manifest.writer.get("lease_generation") == lease.generation):
            return False
        return self.fence.is_fenced(manifest)

    def read_committed(self, step: int) -> Manifest:
        """The committed manifest of ``step``: parsed, validated and fence-checked."""
        d = step_dirname(step)
        rel = f"{d}/{MANIFEST_NAME}"
        try:
            data = self.storage.read_bytes(rel, max_bytes=MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"no committed checkpoint at {self.storage.describe(d)} ({MANIFEST_NAME} is "
                f"absent). `ckpt list {self.storage.url} --all` shows what exists.") from None
        manifest = Manifest.from_json_bytes(data, self.storage.describe(rel), expected_step=step)
        if self.is_fenced(manifest):
            raise FencedCheckpointError(
                f"{self.storage.describe(rel)} was created by a writer (lease generation "
                f"{manifest.writer.get('lease_generation')}) after another job had taken the "
                f"write lease over; it is not a checkpoint. `ckpt gc {self.storage.url}` "
                f"removes it.")
        return manifest

    # -- listing ---------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Every step that has a folder, ascending."""
        out = []
        for name, kind, _ in self.storage.listdir(""):
            step = parse_step_dirname(name)
            if step is not None and kind == "directory":
                out.append(step)
        return sorted(out)

    def has_manifest(self, step: int) -> bool:
        return self.storage.exists(step_file(step, MANIFEST_NAME))

    def known_committed(self) -> list[int]:
        """Steps whose folder holds a ``manifest.json`` (counted or not), ascending, as the
        root's one writer knows them, without a request once known.

        Listed once (here, or by ``cleanup`` when the lease is taken), then kept up to date
        by this life-cycle's own transitions (commit, uncommit, delete, restore). Only the
        writer may rely on it: while it holds the write lease nobody else changes which
        steps are committed (rollback, restore and gc take the lease, which fences this
        writer off first: its next commit does not count, and its deletions wait for a
        renewal that fails). A stale answer can only cost a refused create, never an
        overwrite (``begin``, ``commit``).
        """
        with self._known_lock:
            if self._known is None:
                self._known = {s for s in self.steps() if self.has_manifest(s)}
            return sorted(self._known)

    def forget_known(self) -> None:
        """Drop what ``known_committed`` knows: list again at its next call (a new holding
        of the lease; the root may have changed while this writer did not hold it)."""
        with self._known_lock:
            self._known = None
            self._proven.clear()

    def _note(self, step: int, committed: bool, proven_id: str | None = None) -> None:
        """A transition of this life-cycle: ``step`` now has (or no longer has) a
        ``manifest.json``; ``proven_id``: the save id of the one this holder just
        committed and proved."""
        with self._known_lock:
            if self._known is not None:
                (self._known.add if committed else self._known.discard)(step)
            if proven_id is not None:
                self._proven[step] = proven_id
            else:
                self._proven.pop(step, None)

    def adopt_commit(self, manifest: Manifest, *, proven: bool) -> None:
        """A commit under this holder's lease made by another life-cycle over the same root
        (the writer process of a manager, ``ckpt.job._writer_process``): know its step as
        committed, without a request, as if this one had committed it (``proven``: the
        lease's renewal after the manifest succeeded)."""
        self._note(manifest.step, True, manifest.save_id if proven else None)

    def adopt_deletion(self, step: int) -> None:
        """A deletion (or a step found gone) under this holder's lease by another
        life-cycle over the same root (the writer process's retention): know ``step`` as
        holding no ``manifest.json`` any more, without a request."""
        self._note(step, False)

    def may_hold_manifest(self, step: int) -> bool:
        """False only when ``known_committed`` is known (no request here) and lacks
        ``step``: a step the writer knows to have no ``manifest.json``."""
        with self._known_lock:
            return self._known is None or step in self._known

    def _folder(self, step: int) -> _Folder:
        d = step_dirname(step)
        return _Folder(step, {n: s for n, k, s in self.storage.listdir(d) if k == "file"})

    def _read_doc(self, rel: str) -> Manifest:
        data = self.storage.read_bytes(rel, max_bytes=MAX_MANIFEST_BYTES)
        return Manifest.from_json_bytes(data, self.storage.describe(rel))

    def entries(self, step: int, folder: _Folder | None = None) -> list[Entry]:
        """Every version of ``step``: committed (or fenced/corrupt), rolled back, incomplete."""
        d = step_dirname(step)
        folder = folder or self._folder(step)
        out: list[Entry] = []
        referenced: set[str] = set()
        committed_id = None
        if MANIFEST_NAME in folder.files:
            rel = f"{d}/{MANIFEST_NAME}"
            try:
                m = self.read_committed(step)
                committed_id = m.save_id
                referenced |= set(m.files)
                out.append(Entry(step, m.save_id, COMMITTED, MANIFEST_NAME, m,
                                 bytes=m.total_bytes))
            except FencedCheckpointError as exc:
                try:
                    m = self._read_doc(rel)
                    out.append(Entry(step, m.save_id, FENCED, MANIFEST_NAME, m,
                                     problem=str(exc)))
                except (FileNotFoundError, CorruptCheckpointError):
                    pass
            except CorruptCheckpointError as exc:
                out.append(self._unreadable_entry(step, MANIFEST_NAME, folder, exc))
            except CheckpointNotFoundError:
                pass  # un-committed meanwhile
        for name in sorted(folder.files):
            rolled = rolled_back_id(name) or (name == LEGACY_ROLLED_NAME)
            if not rolled:
                continue
            try:
                m = self._read_doc(f"{d}/{name}")
            except FileNotFoundError:
                continue  # restored or removed meanwhile
            except CorruptCheckpointError as exc:
                out.append(self._unreadable_entry(step, name, folder, exc))
                continue
            if m.save_id == committed_id:
                continue  # an un-commit that stopped half-way: the manifest still commits it
            referenced |= set(m.files)
            out.append(Entry(step, m.save_id, ROLLED_BACK, name, m, bytes=m.total_bytes,
                             problem="un-committed (rollback); `ckpt restore --id "
                                     f"{m.save_id}` re-commits it"))
        for name in sorted(folder.files):
            if is_damaged_manifest(name):
                out.append(Entry(step, None, MOVED_ASIDE, name, bytes=folder.files[name],
                                 problem="a damaged manifest, moved aside so that this step "
                                         "could be committed again; kept for inspection, "
                                         "never removed by a save, retention or a job's "
                                         "start",
                                 holds=self._named_ids(f"{d}/{name}", folder)))
        known = {e.id for e in out}
        for name in sorted(folder.files):
            m = marker_id(name)
            if not m and name != LEGACY_MARKER_NAME:
                continue
            marker = None
            try:
                marker = parse_marker(self.storage.read_bytes(f"{d}/{name}",
                                                              max_bytes=MAX_MARKER_BYTES),
                                      self.storage.describe(f"{d}/{name}"))
            except (CorruptCheckpointError, FileNotFoundError):
                pass
            sid = m if m else (marker or {}).get("save_id") \
                if isinstance(marker, dict) else None
            if sid in known:
                continue
            size = sum(s for n, s in folder.files.items() if data_file_id(n) == sid)
            out.append(Entry(step, sid if isinstance(sid, str) else None, INCOMPLETE, name,
                             marker=marker if isinstance(marker, dict) else None, bytes=size,
                             problem="no manifest: not committed"))
        return out

    def _unreadable_entry(self, step: int, name: str, folder: _Folder,
                          exc: CorruptCheckpointError) -> Entry:
        """The entry of manifest ``name`` that failed to read with ``exc``: kept, with the
        attempt ids its bytes name (none read for a newer format: left whole)."""
        newer = isinstance(exc, FormatVersionError)
        holds = None if newer else self._named_ids(step_file(step, name), folder)
        return Entry(step, None, CORRUPT, name, problem=str(exc), bytes=folder.files.get(name, 0),
                     holds=holds, newer=newer)

    def _named_ids(self, rel: str, folder: _Folder) -> frozenset[str] | None:
        """The attempt ids of ``folder`` that the bytes of the unreadable manifest ``rel``
        name (its files are named by its attempt id; damage rarely reaches every mention);
        None when its bytes cannot be read (gone, a link, too large)."""
        try:
            data = self.storage.read_bytes(rel, max_bytes=MAX_MANIFEST_BYTES)
        except Exception:  # noqa: BLE001 - unreadable bytes: every file is kept
            return None
        attempts = {a for a in map(_attempt_of, folder.files) if a is not None}
        return frozenset(a for a in attempts if a.encode() in data)

    def find(self, save_id: str) -> Entry:
        """The entry whose id is ``save_id`` (any step)."""
        for step in self.steps():
            for e in self.entries(step):
                if e.id == save_id:
                    return e
        raise CheckpointNotFoundError(
            f"no checkpoint with id {save_id!r} under {self.storage.url}; "
            f"`ckpt list {self.storage.url} --all` shows every id")

    # -- write side: the lease holder only ------------------------------------------------
    def _require_lease(self, *, renew: bool = False, within: float = 0.0) -> None:
        """Refuse to change the root without the lease; ``renew`` proves it held right now
        (a compare-and-swap), for changes that no later step can fence; with ``within``,
        a renewal that succeeded less than ``within`` seconds ago is proof enough."""
        if self.lease is not None and (not self.lease.held
                                       or (renew and not self.lease.confirm(within=within))):
            raise LeaseLostError(
                f"lease lost: another job took over the write lease on {self.storage.url}; "
                f"this writer is fenced off and must not change the root")

    def _recent_seconds(self) -> float:
        """How old a renewal may be and still stand for one now before a retention delete
        (which follows the renewal that proved the commit before it): half the lease's
        TTL. No job takes a lease over by expiry within its TTL of a renewal, and the
        heartbeat renews every quarter of it, so in a healthy job this is always met
        without a request."""
        return self.lease.ttl_seconds / 2 if self.lease is not None else 0.0

    def _writer_record(self) -> dict[str, Any]:
        if self.lease is None:
            return {"owner": None, "lease_generation": None}
        return {"owner": self.lease.holder_id, "lease_generation": self.lease.generation,
                "job": self.lease.job_name}

    def begin(self, step: int, save_id: str, *, durable: bool = True) -> None:
        """Start attempt ``save_id`` at ``step``: refuse a committed step, write the marker.

        Raises ``FileExistsError`` when ``step`` already holds a checkpoint that counts
        (checkpoints are never overwritten); a fenced-off manifest does not count. A step
        that ``known_committed`` knows without a manifest is not asked about (the commit's
        exclusive create still refuses one that appeared unknown to this writer).
        """
        self._require_lease()
        d = step_dirname(step)
        if self.may_hold_manifest(step) and self.has_manifest(step):
            try:
                self.read_committed(step)
            except FormatVersionError as exc:
                raise FileExistsError(
                    f"checkpoint {self.storage.describe(d)} was committed by a newer ckpt "
                    f"({exc}); it is never touched by this one: upgrade ckpt, or save under "
                    f"another step") from None
            except (FencedCheckpointError, CorruptCheckpointError):
                pass  # moved aside at commit
            else:
                raise FileExistsError(
                    f"checkpoint {self.storage.describe(d)} is already committed; checkpoints "
                    f"are never overwritten. Save under another step, or `ckpt rollback` "
                    f"first.")
        self.storage.makedirs(d)
        marker = {"save_id": save_id, "step": step, "started_unix": time.time(),
                  "host": socket.gethostname(), "pid": os.getpid(), **self._writer_record()}
        self.storage.write_bytes(f"{d}/{marker_name(save_id)}", jsonio.dumps(marker),
                                 durable=durable)

    def raise_if_taken_over(self, during: str) -> None:
        """Raise ``LeaseLostError`` when a renewal finds the lease taken over, to explain a
        write refused or gone missing ``during`` something (the new holder cleans up
        after taking over); return when it is still held, or when there is no lease."""
        if self.lease is not None and not self.lease.confirm():
            raise LeaseLostError(f"lease lost: another job took over {self.storage.url} while "
                                 f"{during}; not committed") from None

    def commit(self, manifest: Manifest) -> None:
        """Commit ``manifest`` (the coordinator, after every rank wrote its files).

        Checks that the lease record is still this holder's (a read; refused when the
        lease was taken), creates ``manifest.json`` exclusively, then renews the lease: only
        that renewal, after the manifest exists, proves the commit counts (see the module
        docstring). Raises ``LeaseLostError`` when the commit does not count,
        ``FileExistsError`` when the step is already committed.
        """
        self._require_lease()
        if self.lease is not None and not self.lease.check():
            raise LeaseLostError(f"lease lost: another job took over {self.storage.url} before "
                                 f"the commit of step {manifest.step}; not committing")
        manifest.writer = {**manifest.writer, **self._writer_record()}
        d = step_dirname(manifest.step)
        rel = f"{d}/{MANIFEST_NAME}"
        data = manifest.to_json_bytes()
        for _ in range(5):
            try:
                self.storage.create_exclusive(rel, data)
                break
            except (FileExistsError, FileNotFoundError) as exc:
                # Refused: find out whether because this writer was fenced off meanwhile
                # (its folder cleaned up, or the new holder's manifest in place).
                self.raise_if_taken_over(f"step {manifest.step} was being committed")
                if isinstance(exc, FileNotFoundError):
                    raise
                if self.committed_by(manifest.step, [manifest.save_id]) is not None:
                    break  # this very create landed (a request retried after it had)
                self._make_room(manifest.step, replace=False)
        else:
            raise FileExistsError(f"{self.storage.describe(rel)} kept reappearing; another "
                                  f"writer is committing this step")
        if self.lease is not None:
            self._confirm_after_commit(manifest)
        self._note(manifest.step, True,
                   manifest.save_id if self.lease is not None else None)
        marker = f"{d}/{marker_name(manifest.save_id)}"
        if self.defer_marker_removal:
            self._committed_markers.append(marker)
            return
        try:
            self.storage.delete(marker)
        except Exception:  # noqa: BLE001 - a leftover marker of a committed attempt is inert
            pass

    def commit_copy(self, manifest: Manifest, source: str) -> Manifest:
        """Commit here a copy of a version committed under another root (``source``, its
        URL): a node's local checkpoint replicated to its peer, or fetched back from it.

        The caller began the attempt under the version's own save id (:meth:`begin`) and
        wrote every file the manifest lists, byte for byte, each checked against its size
        and CRC32C. A manifest counts per root (readers judge its writer fields by this
        root's fence), so the original cannot be committed as it is: the copy is
        re-issued with this writer's owner and lease generation, the original writer
        under ``writer.copied_from`` (with ``source``) and ``writer.copied_unix``; files,
        tensors, checksums and parts stay as they were. Then committed as :meth:`commit`
        (``FileExistsError`` when the step is committed here, ``LeaseLostError`` when the
        commit does not count). Returns the manifest committed.
        """
        original = {k: v for k, v in manifest.writer.items() if k != "copied_from"}
        copied = Manifest.from_json_bytes(manifest.to_json_bytes(),
                                          self.storage.describe(self._rel(manifest.step)),
                                          expected_step=manifest.step)
        copied.writer = {"copied_from": {**original, "root": source},
                         "copied_unix": time.time()}
        self.commit(copied)
        return copied

    def remove_committed_markers(self) -> None:
        """Remove the markers of committed attempts left by ``defer_marker_removal`` (one
        request on S3). Best effort: a leftover marker of a committed attempt is inert
        (``entries`` passes over it, ``cleanup`` removes it)."""
        markers, self._committed_markers = self._committed_markers, []
        try:
            self.storage.delete_many(markers)
        except Exception as exc:  # noqa: BLE001
            log.warning("could not remove attempt markers %s: %s", markers, exc)

    def committed_by(self, step: int, save_ids: Iterable[str]) -> Manifest | None:
        """The manifest that counts at ``step`` when one of ``save_ids`` (attempts of one
        save) committed it, read back as readers read it (and then known to this
        life-cycle as committed); None otherwise. For an attempt whose failure came after
        its manifest existed: it counts, it must not be reported as not committed."""
        ids = set(save_ids)
        if not ids:
            return None
        try:
            manifest = self.read_committed(step)
        except (CheckpointNotFoundError, CorruptCheckpointError, OSError):
            return None
        if manifest.save_id not in ids:
            return None
        self._note(step, True)
        return manifest

    def _confirm_after_commit(self, manifest: Manifest) -> None:
        """The manifest exists: learn whether it counts, by reading back (a renewal of the
        lease, else the readers' fence rule), never by failing the attempt: a storage
        error on the way is retried for up to half the lease's TTL, since a second attempt
        would find the step committed and report it as not. Raises ``LeaseLostError`` only
        when it does not count."""
        deadline = time.monotonic() + max(1.0, self._recent_seconds())
        delay = 0.05
        while True:
            try:
                ok = self.lease.confirm()
                break
            except Exception as exc:  # noqa: BLE001 - storage trouble: read back again
                if time.monotonic() > deadline:
                    log.warning("could not renew the lease after committing step %d: %s; "
                                "judging the commit by the fence", manifest.step, exc)
                    ok = False
                    break
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        if ok:
            self.lease.committed_ids.add(manifest.save_id)
            return
        # Not proven by a renewal: the commit counts by the readers' rule (is_fenced), which
        # needs the new holder's close record once it has started closing. Whenever it
        # counts, this holder's own close record must list it too.
        deadline = time.monotonic() + 10.0
        while True:
            # The record is looked for before the check, so that a "fenced" below was judged
            # on it: looked for after, it could have landed in between, listing this commit.
            try:
                closed = self.fence.doc(self.lease.generation, "json") is not None
                fenced = self.is_fenced(manifest)
            except (OSError, CheckpointNotFoundError) as exc:  # storage trouble: again
                log.warning("could not read the fence of step %d's commit: %s", manifest.step,
                            exc)
                closed = fenced = None
                unread = True
            else:
                unread = False
            if fenced is False:
                self.lease.committed_ids.add(manifest.save_id)
                return  # no closer yet (it will list it), or its record lists it
            if closed:
                break  # closed without it
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if unread:
            raise LeaseLostError(
                f"step {manifest.step} at {self.storage.describe(step_dirname(manifest.step))}: "
                f"the commit could not be confirmed (the storage did not answer the lease or "
                f"fence reads for {self._recent_seconds() + 10:.0f} s); whether it counts is "
                f"decided by readers (the fence), and this job writes no more under it")
        raise LeaseLostError(
            f"step {manifest.step} at {self.storage.describe(step_dirname(manifest.step))}: "
            f"lease lost while committing (another job took it over); the manifest does not count "
            f"(readers ignore it) and the new holder's checkpoints stand")

    def _make_room(self, step: int, *, replace: bool) -> None:
        """``manifest.json`` exists: move a fenced one aside, or a damaged one (it fails its
        digest or a rule of the format: ``damaged-manifest-<hex>.json``, kept for the
        operator, never deleted by a save), or, with ``replace``, un-commit a valid one;
        otherwise raise ``FileExistsError``. A manifest of a newer format is never touched
        by this reader: ``FileExistsError`` too."""
        try:
            m = self.read_committed(step)
        except FencedCheckpointError:
            self._move(step, MANIFEST_NAME, fenced_name(self._read_doc(self._rel(step)).save_id))
            return
        except CheckpointNotFoundError:
            return  # gone meanwhile: try again
        except FormatVersionError as exc:
            raise FileExistsError(
                f"checkpoint {self.storage.describe(step_dirname(step))} was committed by a "
                f"newer ckpt ({exc}); it is never touched by this one: upgrade ckpt, or save "
                f"under another step") from None
        except CorruptCheckpointError as exc:
            aside = self.move_damaged_aside(step)
            log.warning("%s; moved aside to %s so that step %d can be committed again",
                        exc, aside, step)
            return
        if replace:
            self.uncommit(step)
            return
        raise FileExistsError(
            f"checkpoint {self.storage.describe(step_dirname(step))} is already committed "
            f"(id {m.save_id}); checkpoints are never overwritten")

    def move_damaged_aside(self, step: int) -> str:
        """Move ``step``'s damaged ``manifest.json`` to ``damaged-manifest-<hex>.json``
        (kept and listed, ``ckpt list --all``; never deleted but by ``ckpt gc --damaged``).
        Returns the new name. The lease holder only."""
        aside = damaged_manifest_name(os.urandom(6).hex())
        self._move(step, MANIFEST_NAME, aside)
        self._note(step, False)
        return aside

    def _rel(self, step: int, name: str = MANIFEST_NAME) -> str:
        return step_file(step, name)

    def _move(self, step: int, src: str, dst: str) -> None:
        """Copy then delete (no rename on S3): a crash in between leaves both, never none."""
        data = self.storage.read_bytes(self._rel(step, src), max_bytes=MAX_MANIFEST_BYTES)
        self.storage.write_bytes(self._rel(step, dst), data)
        self.storage.delete(self._rel(step, src))

    def abandon(self, step: int, save_id: str | None = None) -> list[str]:
        """Remove the files of attempt ``save_id`` at ``step`` (every uncommitted attempt
        there when None), once no writer of those attempts is left. Returns the names."""
        if save_id is None:
            return self._remove(step, dict(self.leftovers(steps=[step])).get(step, []))
        folder = self._folder(step)
        if self.has_manifest(step):
            try:
                if self.read_committed(step).save_id == save_id:
                    return []  # it did commit after all
            except (CheckpointNotFoundError, CorruptCheckpointError):
                pass
        return self._remove(step, [n for n in folder.files
                                   if data_file_id(n) == save_id or n == marker_name(save_id)])

    def _remove(self, step: int, names: Iterable[str]) -> list[str]:
        names = sorted(names, key=lambda n: n.startswith("pending-"))  # markers last
        for name in names:
            self.storage.delete(self._rel(step, name))
        if names:
            self._drop_empty_folder(step)
        return list(names)

    def _drop_empty_folder(self, step: int) -> None:
        """Remove the step's folder once empty (a file that appears meanwhile keeps it)."""
        self.storage.remove_empty_folder(step_dirname(step))

    def uncommit(self, step: int) -> str:
        """Un-commit ``step`` reversibly; returns the id of the kept version."""
        self._require_lease(renew=True)
        m = self.read_committed(step)
        self._move(step, MANIFEST_NAME, rolled_back_name(m.save_id))
        self._note(step, False)
        return m.save_id

    def uncommit_newer(self, step: int) -> list[tuple[int, str | None, CheckpointError | None]]:
        """Un-commit every committed step newer than ``step``, newest first (rollback, and a
        resume that went past newer checkpoints). Returns ``(step, kept id, None)`` for each
        one rolled back and ``(step, None, error)`` for each left as it was because it is
        damaged beyond reading (it does not count anyway)."""
        out: list[tuple[int, str | None, CheckpointError | None]] = []
        for newer in reversed([s for s in self.steps() if s > step and self.has_manifest(s)]):
            try:
                out.append((newer, self.uncommit(newer), None))
            except CheckpointError as exc:
                out.append((newer, None, exc))
        return out

    def delete_newer(self, step: int) -> list[tuple[int | None, Exception | None]]:
        """Delete every committed step newer than ``step`` (-1: all), oldest first, step by
        step (a resume's node-local tier and its copies, which are not kept rolled back):
        ``(step, None)`` for each deleted and ``(step, error)`` for each that could not be (a
        damaged manifest, a storage error), the others deleted all the same; ``(None,
        error)`` alone when the steps could not be listed. Never raises: what is left is of
        a run a resume went back past, which the run log keeps from being resumed from
        (:mod:`ckpt.root.lineage`)."""
        try:
            newer_steps = [s for s in self.steps() if s > step and self.has_manifest(s)]
        except Exception as exc:  # noqa: BLE001 - nothing listed: nothing deleted
            return [(None, exc)]
        out: list[tuple[int | None, Exception | None]] = []
        for newer in newer_steps:
            try:
                self.delete(newer)
            except Exception as exc:  # noqa: BLE001 - the others still go
                out.append((newer, exc))
            else:
                out.append((newer, None))
        return out

    def restore(self, save_id: str, *, replace: bool = False) -> Manifest:
        """Re-commit the rolled-back version ``save_id`` under the current lease.

        Refused while a committed checkpoint of that step exists unless ``replace``, which
        rolls that one back in turn. The data is verified before the commit.
        """
        self._require_lease()
        entry = self.find(save_id)
        if entry.status == COMMITTED:
            raise FileExistsError(f"checkpoint id {save_id} (step {entry.step}) is already "
                                  f"committed; nothing to restore")
        if entry.status != ROLLED_BACK or entry.manifest is None:
            raise CheckpointNotFoundError(
                f"checkpoint id {save_id} (step {entry.step}) is {entry.status}, not "
                f"rolled-back: only a rolled-back checkpoint can be restored")
        verify_checkpoint(self.storage, entry.manifest, full=True)  # as `ckpt verify`
        if self.has_manifest(entry.step):
            try:
                self._make_room(entry.step, replace=replace)
            except FileExistsError as exc:
                raise FileExistsError(f"{exc}. Pass --replace to roll it back and restore "
                                      f"{save_id} in its place.") from None
        m = entry.manifest
        m.writer = {**m.writer, "restored_unix": time.time()}
        self.commit(m)
        self.storage.delete(self._rel(entry.step, entry.name))
        # An operator's choice: live again whatever its run (a resume may have gone back
        # past it: ``ckpt.root.lineage``).
        record_restore(self.storage, m.step, m.save_id)
        return m

    def delete(self, step: int) -> None:
        """Delete the committed checkpoint of ``step``: the manifest first (un-commit), then
        its files (those it lists and those named with its attempt id) and its marker, all
        in one request on S3 (with the markers ``remove_committed_markers`` would remove).
        Other versions in the folder (rolled back) stay. A manifest this holder committed
        and proved is not read back: its attempt id names its files.

        The lease must have been renewed within half its TTL (retention runs right after a
        commit proved it): see docs/format.md, "Fencing", on deletes of a stalled holder.
        ``CheckpointNotFoundError`` when ``step`` has no manifest (it is then forgotten).
        """
        self._require_lease(renew=True, within=self._recent_seconds())
        with self._known_lock:
            save_id = self._proven.get(step)
        listed: Iterable[str] = ()
        if save_id is None:  # not one this holder committed: read what is committed there
            try:
                m = self.read_committed(step)
            except CheckpointNotFoundError as exc:
                if not isinstance(exc, FencedCheckpointError):
                    self._note(step, False)
                raise
            save_id, listed = m.save_id, m.files
        self.storage.delete(self._rel(step))
        self._note(step, False)
        names = [n for n in self._folder(step).files if n in listed
                 or data_file_id(n) == save_id or n == marker_name(save_id)]
        markers, self._committed_markers = self._committed_markers, []
        try:
            self.storage.delete_many([self._rel(step, n) for n in sorted(names)] + markers)
        except BaseException:
            self._committed_markers[:0] = markers
            raise
        if names:
            self._drop_empty_folder(step)

    def delete_entry(self, entry: Entry) -> list[str]:
        """Delete one non-committed version (rolled back, fenced, incomplete) and its files."""
        self._require_lease(renew=True)
        if entry.status == COMMITTED:
            raise ValueError("delete a committed checkpoint with Lifecycle.delete(step)")
        folder = self._folder(entry.step)
        keep = self._referenced(entry.step, exclude=entry.name)
        names = {entry.name}
        if entry.id:
            names |= {n for n in folder.files if data_file_id(n) == entry.id
                      or n in (marker_name(entry.id), fenced_name(entry.id))}
        if entry.manifest is not None:
            names |= set(entry.manifest.files) & set(folder.files)
        return self._remove(entry.step, sorted((names - keep) & set(folder.files)))

    def _referenced(self, step: int, exclude: str | None = None) -> set[str]:
        """Data files some manifest or rolled-back manifest of ``step`` still needs.

        A manifest lists its attachment files in ``files`` (the parser refuses one that
        does not), so they are referenced like data files.
        """
        out: set[str] = set()
        for e in self.entries(step):
            if e.manifest is not None and e.name != exclude and e.status != FENCED:
                out |= set(e.manifest.files)
        return out

    # -- leftovers -------------------------------------------------------------------------
    def _scan(self, steps: Iterable[int] | None = None
              ) -> Iterator[tuple[int, _Folder | None, list[Entry], str | None]]:
        """``(step, folder, entries, refused)`` for each step folder; a folder that cannot
        be listed or read as ours (a link, say) comes with ``refused`` (why) instead, and
        is left as it is by every caller."""
        for step in (self.steps() if steps is None else steps):
            try:
                folder = self._folder(step)
                yield step, folder, self.entries(step, folder), None
            except CorruptCheckpointError as exc:
                yield step, None, [], str(exc)

    def leftovers(self, steps: Iterable[int] | None = None) -> list[tuple[int, list[str]]]:
        """Files of dead attempts: ``(step, names)`` for every folder that has some.

        Called by the lease holder when none of its own attempts is in flight (at start-up
        and by ``ckpt gc``), so every attempt without a manifest is dead. Only names this
        module or the writer produce are considered; anything else is left alone, and so is
        what a manifest that cannot be read may hold (see ``_dead_files``; ``kept`` says
        which steps hold one).
        """
        out = []
        for step, folder, entries, _ in self._scan(steps):
            dead = _dead_files(folder, entries) if folder is not None else []
            if dead:
                out.append((step, dead))
        return out

    def kept(self, steps: Iterable[int] | None = None) -> list[tuple[int, str]]:
        """``(step, why)`` for each step that ``cleanup`` and ``ckpt gc`` leave, whole or
        in part, because it holds a manifest this reader cannot read (someone's committed
        data: damaged, moved aside as damaged, of a newer format) or its folder cannot be
        read as ours. ``why`` is one line saying what to do."""
        url = self.storage.url
        out = []
        for step, _, entries, refused in self._scan(steps):
            if refused is not None:
                out.append((step, f"folder refused ({refused}): kept"))
                continue
            unreadable = _unreadable(entries)
            newer = [e for e in unreadable if e.newer]
            if newer:
                out.append((step, f"written by a newer ckpt: kept, never touched by this one "
                                  f"(upgrade ckpt; {newer[0].problem})"))
            elif unreadable:
                names = ", ".join(e.name for e in unreadable)
                out.append((step, f"manifest unreadable ({names}): kept; `ckpt gc {url} "
                                  f"--damaged` after `ckpt verify {url} --step {step}` to "
                                  f"remove"))
        return out

    def damaged(self, steps: Iterable[int] | None = None
                ) -> list[tuple[int, list[str], list[str]]]:
        """What ``remove_damaged`` would remove: ``(step, manifests, files)`` for each step
        holding a manifest that cannot be read and none of a newer format: those manifests,
        and the files of the step that no readable manifest references."""
        out = []
        for step, folder, entries, refused in self._scan(steps):
            unreadable = _unreadable(entries)
            if refused is not None or not unreadable or any(e.newer for e in unreadable):
                continue
            manifests = sorted({e.name for e in unreadable} & set(folder.files))
            readable = [e for e in entries if not any(e is u for u in unreadable)]
            files = _dead_files(folder, readable)
            out.append((step, manifests, [n for n in files if n not in manifests]))
        return out

    def remove_damaged(self, step: int) -> list[str]:
        """Remove ``step``'s manifests that cannot be read (never one of a newer format),
        then the files no readable manifest of the step references (``damaged``): the
        operator's explicit choice (``ckpt gc --damaged``), never a job's. The lease
        holder only. Returns the names removed."""
        self._require_lease(renew=True)
        for _, manifests, files in self.damaged([step]):
            if MANIFEST_NAME in manifests:
                self._note(step, False)
            for name in manifests:  # first: what they held is a leftover only after
                self.storage.delete(self._rel(step, name))
            removed = manifests + self._remove(step, files)
            self._drop_empty_folder(step)
            return removed
        return []

    def cleanup(self, on_removed: Callable[[int, list[str]], None] | None = None) -> list[int]:
        """Remove every dead attempt's files (see ``leftovers``); returns the steps touched.

        A fenced-off manifest is moved aside first, which makes its data files leftovers.
        A manifest that cannot be read is someone's committed data: never removed here, nor
        what it may hold (``kept`` lists those steps; ``remove_damaged`` removes them).
        """
        self._require_lease(renew=True)
        touched, known = [], set()
        for step, folder, entries, refused in self._scan():
            if refused is not None:
                log.warning("step %d left as it is: %s", step, refused)
                continue
            for e in entries:
                if e.status == FENCED and e.name == MANIFEST_NAME:
                    aside = fenced_name(e.id)
                    self._move(step, MANIFEST_NAME, aside)
                    folder.files[aside] = folder.files.pop(MANIFEST_NAME)
            if MANIFEST_NAME in folder.files:
                known.add(step)
            dead = _dead_files(folder, entries)
            if dead:
                self._remove(step, dead)
                touched.append(step)
                if on_removed is not None:
                    on_removed(step, dead)
        with self._known_lock:  # every step was seen: what known_committed would list
            self._known = known
        return touched

    def manifests(self) -> Iterator[Manifest]:
        """Every ``manifest.json`` under the root that parses (counted or not)."""
        for step in self.steps():
            try:
                yield self._read_doc(self._rel(step))
            except (FileNotFoundError, CorruptCheckpointError):
                continue
