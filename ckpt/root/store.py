"""Discovery, verification and deletion of the checkpoints under one root (the read side),
and the one walk to the newest usable checkpoint.

A root holds one folder per step, ``step_NNNNNNNNN/``. A step is *committed* when its
manifest exists, parses, describes that step and was not fenced off; *incomplete* when it
has no manifest (a save in flight, or the leftovers of one that died); *rolled-back* when
its manifest was un-committed (kept, restorable); *fenced* when its manifest was created by
a writer that had lost the lease; *corrupt* when the manifest is unreadable or its files
fail verification. The life-cycle itself (every transition, every file name) lives in
:mod:`ckpt.root.lifecycle`.

:func:`walk_newest` is the one definition of "the newest checkpoint that verifies": which
candidates in which order, what counts as usable, what falls back and how a fallback is
reported. ``CheckpointStore.latest`` (one process, no load), ``ckpt.load_latest`` (every
rank of a group, with a load) and the two-tier resume of ``ckpt.job.tiers`` (candidates of
two roots) all walk through it; the collectives that make the candidate list the same on
every rank stay with their callers.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

from ckpt.errors import (
    AllCheckpointsDamagedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    RankFailuresError,
)
from ckpt.format import Manifest, step_dirname
from ckpt.ranks import Agreement
from ckpt.root.lifecycle import (
    COMMITTED,
    CORRUPT,
    FENCED,
    INCOMPLETE,
    MOVED_ASIDE,
    ROLLED_BACK,
    Entry,
    Lifecycle,
)
from ckpt.root.lineage import Trajectory, read_runs
from ckpt.root.parts import complete_parts
from ckpt.root.verify import verify_attachments, verify_checkpoint
from ckpt.storage import Storage

__all__ = ["CheckpointInfo", "CheckpointStore", "Candidate", "Walked", "walk_newest"]

log = logging.getLogger(__name__)


@dataclass
class CheckpointInfo:
    """One checkpoint (one version of one step) as an operator sees it."""

    step: int
    status: str
    url: str
    bytes: int
    created: float | None = None
    save_id: str | None = None
    owner: str | None = None
    problem: str | None = None
    user_metadata: dict[str, Any] | None = None

    @property
    def id(self) -> str | None:
        return self.save_id

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "id": self.save_id}


def _info(store: "CheckpointStore", e: Entry) -> CheckpointInfo:
    url = store.storage.describe(step_dirname(e.step))
    m = e.manifest
    if m is not None:
        return CheckpointInfo(e.step, e.status, url, m.total_bytes, m.created_unix, m.save_id,
                              m.writer.get("owner"), e.problem, m.user_metadata)
    owner = (e.marker or {}).get("owner")
    created = (e.marker or {}).get("started_unix")
    return CheckpointInfo(e.step, e.status, url, e.bytes,
                          created if isinstance(created, (int, float)) else None, e.id,
                          owner if isinstance(owner, str) else None, e.problem)


class CheckpointStore:
    """Read-side view of a checkpoint root: it lists, reads and verifies, and changes
    nothing. Safe to use from any one process.

    It reads through ``lifecycle`` (default: a new one), the root's
    :class:`~ckpt.root.lifecycle.Lifecycle`; a job's manager gives it its own (the one
    holding the write lease, which knows the committed steps without listing them). Every
    change (delete, un-commit, restore) is the life-cycle's.
    """

    def __init__(self, root: str | Storage, storage_options: dict[str, Any] | None = None,
                 *, lifecycle: Lifecycle | None = None):
        self.storage = root if isinstance(root, Storage) else Storage(root, storage_options)
        self.life = lifecycle or Lifecycle(self.storage)

    # -- listing ---------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Every step that has a folder, committed or not, ascending."""
        return self.life.steps()

    def read_manifest(self, step: int, *, complete: bool = False) -> Manifest:
        """The committed manifest of ``step`` (``CheckpointNotFoundError`` when there is
        none or it was fenced off, ``CorruptCheckpointError`` when it is damaged).

        Format version 2: the root alone (it names every key, file and part; the chunks of
        sharded tensors are in the parts), unless ``complete``: then every part is read,
        checked and merged in (see :meth:`complete`).
        """
        manifest = self.life.read_committed(step)
        return self.complete(manifest) if complete else manifest

    def complete(self, manifest: Manifest) -> Manifest:
        """``manifest`` with every chunk of every part: each part read, checked against its
        SHA-256 and validated, and the whole checked as one (every tensor tiled exactly).
        A version 1 manifest, or a root without sharded tensors, is complete already."""
        return complete_parts(self.storage, manifest)

    def entries(self, step: int) -> list[CheckpointInfo]:
        """Every version of ``step`` (committed, rolled back, incomplete, fenced, corrupt)."""
        return [_info(self, e) for e in self.life.entries(step)]

    def info(self, step: int, *, check: str = "none") -> CheckpointInfo:
        """Status of one step: its committed version if any, else its most telling one.

        ``check``: 'none' (manifest only), 'size', or 'full'.
        """
        entries = self.life.entries(step)
        if not entries:
            return CheckpointInfo(step, INCOMPLETE, self.storage.describe(step_dirname(step)),
                                  0, problem="no manifest: not committed")
        order = {COMMITTED: 0, CORRUPT: 1, FENCED: 2, ROLLED_BACK: 3, INCOMPLETE: 4,
                 MOVED_ASIDE: 5}
        return self._checked(min(entries, key=lambda e: order.get(e.status, 9)), check)

    def _checked(self, e: Entry, check: str) -> CheckpointInfo:
        """``e`` as an operator sees it, a committed one verified as ``check`` says."""
        info = _info(self, e)
        if e.status == COMMITTED and check != "none":
            try:
                self.verify_manifest(e.manifest, full=(check == "full"))
            except CorruptCheckpointError as exc:
                info.status, info.problem = CORRUPT, str(exc)
        return info

    def list(self, *, check: str = "none", all_versions: bool = False) -> list[CheckpointInfo]:
        """One row per step; with ``all_versions`` one row per version (each with an id)."""
        if not all_versions:
            return [self.info(s, check=check) for s in self.steps()]
        return [self._checked(e, check) for step in self.steps()
                for e in self.life.entries(step)]

    def committed_steps(self) -> list[int]:
        """Steps whose folder holds a manifest (cheap: no manifest is read or checked)."""
        return [s for s in self.steps() if self.life.has_manifest(s)]

    # -- verification ----------------------------------------------------------------------
    def verify_manifest(self, manifest: Manifest, *, full: bool = True,
                        progress: Callable[[int, int], None] | None = None) -> None:
        """Check the version ``manifest`` describes as :func:`ckpt.root.verify.verify_checkpoint`
        does (the one definition of a good checkpoint): every file's size (parts included:
        the root lists them) before anything is read; when ``full``, every part, then every
        file's CRC32C and every item's. Raise on the first problem."""
        verify_checkpoint(self.storage, manifest, full=full, progress=progress)

    def verify_attachments(self, manifest: Manifest) -> None:
        """Check the CRC32C of each attachment of ``manifest`` (the files no load reads),
        as a resume does before it takes a version."""
        verify_attachments(self.storage, manifest)

    def verify(self, step: int, *, full: bool = True,
               progress: Callable[[int, int], None] | None = None) -> Manifest:
        manifest = self.read_manifest(step)
        self.verify_manifest(manifest, full=full, progress=progress)
        return manifest

    def candidates(self, tier: str | None = None) -> list["Candidate"]:
        """Every committed step as a candidate of :func:`walk_newest` (``tier``: as there)."""
        return [Candidate(step, self, tier) for step in self.committed_steps()]

    def trajectory(self) -> Trajectory:
        """The root's current trajectory, from its run log (:mod:`ckpt.root.lineage`)."""
        return Trajectory(read_runs(self.storage))

    def latest(self, *, check: str = "size") -> Manifest | None:
        """The newest committed checkpoint that passes ``check`` and was not abandoned by a
        resume; older ones are tried in turn.

        Every checkpoint skipped on the way is logged with the reason (:func:`walk_newest`).
        """
        return walk_newest(self.candidates(), check=check,
                           trajectory=self.trajectory()).manifest


# -- the walk to the newest usable checkpoint ------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """A checkpoint a resume may start from: ``step`` under ``store``. ``tier`` names the
    store in messages (None: the only root walked); ``tolerant``: any error of this
    candidate falls back, not only damage (a node-local tier never stops a resume)."""

    step: int
    store: CheckpointStore
    tier: str | None = None
    tolerant: bool = False

    def describe(self) -> str:
        """In words: ``checkpoint step 20``, or ``checkpoint step 20 of the local tier``."""
        of_tier = f" of the {self.tier} tier" if self.tier else ""
        return f"checkpoint step {self.step}{of_tier}"


@dataclass
class Walked:
    """Where a walk ended: the candidate that loaded and its manifest (both None when none
    did), and each candidate passed over, ``(step, why)``, newest first."""

    candidate: Candidate | None = None
    manifest: Manifest | None = None
    failures: list[tuple[int, str]] = field(default_factory=list)

    def raise_if_all_damaged(self, where: str) -> None:
        """Raise ``AllCheckpointsDamagedError`` (naming ``where`` and every failure) when
        there were candidates and none loaded: "everything damaged", not "nothing there"."""
        if self.candidate is None and self.failures:
            raise AllCheckpointsDamagedError(where, self.failures)


_NOT_USABLE = (CorruptCheckpointError, CheckpointNotFoundError)
"""Errors of reading and checking a candidate that pass it over: damaged, gone, fenced off."""


def _falls_back(exc: BaseException, candidate: Candidate, damage: tuple[type, ...]) -> bool:
    """Does ``exc`` mean "this candidate is damaged: try an older one"? Yes for a
    ``damage`` error (on any rank, for per-rank failures) and, for a ``tolerant``
    candidate, for any error. Anything else (storage down, a state that does not match) is
    raised: an older checkpoint would not fare better."""
    if candidate.tolerant:
        return True
    if isinstance(exc, RankFailuresError):
        return any(isinstance(e, damage) for e in exc.errors.values())
    return isinstance(exc, damage)


def walk_newest(candidates: Iterable[Candidate], *, check: str = "size",
                load: Callable[[Candidate, Manifest], Any] | None = None,
                agreement: Agreement | None = None,
                on_fallback: Callable[[Candidate, str], None] | None = None,
                trajectory: Trajectory | None = None) -> Walked:
    """Find the newest usable checkpoint among ``candidates``.

    Order: newest step first; candidates of one step in the order given (a faster tier
    first). A candidate is usable when its manifest reads as committed and its files pass
    ``check`` (``"none"``, ``"size"``: every file there at full size, ``"full"``: and every
    part and checksum: :func:`ckpt.root.verify.verify_checkpoint`); then ``load(candidate,
    manifest)`` runs, when given (:func:`ckpt.dcp.load`, which also checks the attachments no
    load reads); the candidate counts only if it succeeded. Damage passes the candidate over
    (reading: a corrupt, missing or fenced manifest or file; loading: a checksum or size
    mismatch on any rank, a damaged attachment; for a
    ``tolerant`` candidate any error); anything else is raised. A candidate passed over is
    reported once: a warning ("checkpoint step 20 is not usable (<why>); falling back to an
    earlier one", or "... failed verification while loading (<why>) ..."),
    ``on_fallback(candidate, message)`` and an entry in the result's ``failures``.

    With an ``agreement`` the walk is collective over its group: every rank passes the same
    candidates, and each verdict (usable, loaded) is agreed, so one rank's failure passes a
    candidate over on every rank. Without one, this process decides alone. Collectively,
    a candidate is usable only when the versions every rank read of it (one root's
    manifest, or each node's own in a node-local tier) come from one run (their
    ``lineage.run``, :mod:`ckpt.root.lineage`): a job never loads a mix of two
    trajectories, whatever put one there (agreed in the same all-reduce as the verdict).

    ``trajectory``: the job's current trajectory (:mod:`ckpt.root.lineage`); a version it
    says was abandoned (a resume went back past it) is passed over as not usable, whichever
    root or tier holds it. None: no version is judged by its lineage.
    """
    walked = Walked()
    for candidate in sorted(candidates, key=lambda c: -c.step):  # stable: tier order kept
        error: BaseException | None = None
        manifest = None
        try:
            manifest = candidate.store.read_manifest(candidate.step)
            if trajectory is not None:
                trajectory.check(manifest.step, manifest.save_id, manifest.lineage,
                                 candidate.describe())
            if check != "none":
                candidate.store.verify_manifest(manifest, full=(check == "full"))
        except Exception as exc:  # noqa: BLE001 - _falls_back decides, the rest is raised
            if not _falls_back(exc, candidate, _NOT_USABLE):
                raise
            error = exc
        usable, one_run = _agreed_one_run(agreement, error, manifest)
        if not usable:
            _fall_back(walked, candidate, "is not usable", error, on_fallback)
            continue
        if not one_run:
            _fall_back(walked, candidate, "is not usable", CorruptCheckpointError(
                f"the versions the ranks read of step {candidate.step} come from different "
                f"runs (a mix of two trajectories; `ckpt history` shows them)"), on_fallback)
            continue
        if load is not None:
            try:
                load(candidate, manifest)
            except Exception as exc:  # noqa: BLE001 - _falls_back decides, the rest is raised
                if not _falls_back(exc, candidate, (CorruptCheckpointError,)):
                    raise
                error = exc
            if not _agreed(agreement, error):
                _fall_back(walked, candidate, "failed verification while loading", error,
                           on_fallback)
                continue
        walked.candidate, walked.manifest = candidate, manifest
        return walked
    return walked


def _agreed(agreement: Agreement | None, error: BaseException | None) -> bool:
    """Did the step succeed here (and, with an ``agreement``, on every rank)?"""
    return agreement.all(error is None) if agreement is not None else error is None


def _run_key(manifest: Manifest | None) -> int:
    """A version's run as an integer every rank can compare in an all-reduce (its first 15
    hex digits; -1 for a version without lineage)."""
    run = manifest.lineage.run if manifest is not None and manifest.lineage else None
    return int(run[:15], 16) if run else -1


def _agreed_one_run(agreement: Agreement | None, error: BaseException | None,
                    manifest: Manifest | None) -> tuple[bool, bool]:
    """Did reading the candidate succeed on every rank, and did every rank read a version
    of one run? (One all-reduce; without an ``agreement``: this process alone, one run.)"""
    if agreement is None:
        return error is None, True
    key = _run_key(manifest)
    (failed,), (low, neg_high) = agreement.any_and_min([error is not None], [key, -key])
    return not failed, failed or low == -neg_high


def _fall_back(walked: Walked, candidate: Candidate, verdict: str, error: BaseException | None,
               on_fallback: Callable[[Candidate, str], None] | None) -> None:
    """Report ``candidate`` passed over: warning, ``on_fallback``, ``walked.failures``."""
    why = str(error) if error is not None else "failed on another rank"
    message = f"{candidate.describe()} {verdict} ({why}); falling back to an earlier one"
    log.warning("%s", message)
    walked.failures.append(
        (candidate.step, f"{candidate.tier} tier: {why}" if candidate.tier else why))
    if on_fallback is not None:
        on_fallback(candidate, message)
