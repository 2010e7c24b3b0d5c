"""The one contract of a job's checkpoints: what every manager does, with the same meaning.

:class:`Checkpointer` is what a training loop is written against; two implementations:
:class:`~ckpt.job.manager.CheckpointManager` (one root) and
:class:`~ckpt.job.tiers.TieredCheckpointManager` (a fast local tier per node under the
durable root). :class:`CheckpointReader` is its read half, which a reader that never writes
also implements (:class:`~ckpt.job.reader.ReadOnlyCheckpointer`: a standby replica group
resumes from a root another group writes, changing nothing there).

Contract (which ranks call what): every rank of the job constructs the checkpointer and
calls ``maybe_save``/``save``/``load_latest``/``uncommit_newer``/``check_lease``/``close`` at
the same points with the same arguments (they are collective); ``latest_step``,
``all_steps``, ``in_flight`` and the properties are local (no collective) and may be called
by any rank at any time. What each tier does differently is documented in docs/store.md
("One contract, two managers").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

from ckpt.cadence import CadencePolicy, FailureHistory
from ckpt.format import Lineage, Manifest
from ckpt.root import CheckpointStore
from ckpt.storage import Storage

__all__ = ["Checkpointer", "CheckpointReader", "ResumeInfo"]


@dataclass(frozen=True)
class ResumeInfo:
    """Where the state was loaded from (the same on every rank)."""

    step: int
    tier: str  # "durable" (the root) or "local" (a two-tier job's local tier)
    where: str  # the root's URL (for "local": this node's local root)


class CheckpointReader(ABC):
    """Resume from a root: the read half of :class:`Checkpointer`.

    Attributes (an implementation's attributes or properties): ``storage``, the root (two
    tiers: the durable one); ``store``, its read side.
    """

    storage: Storage
    store: CheckpointStore

    @property
    @abstractmethod
    def resumed(self) -> ResumeInfo | None:
        """Where the newest :meth:`load_latest` loaded from; None before one, or when it
        found nothing to load."""

    @abstractmethod
    def load_latest(self, state: dict[str, Any], *, step: int | None = None,
                    strict: bool = True, ignore_keys: tuple[str, ...] = (),
                    raise_if_all_damaged: bool = False,
                    extra_state: Callable[[Manifest], dict[str, Any]] | None = None
                    ) -> Manifest | None:
        """Collective: load ``step`` if given (a committed step of the root), else the
        newest checkpoint that verifies on every rank and belongs to the current trajectory
        (``ckpt.root.lineage``), into ``state`` in place (transactional: after a failure
        ``state`` is as before). Returns its manifest, or None when there is nothing to
        resume from. ``strict``, ``ignore_keys``: as for ``ckpt.load``;
        ``raise_if_all_damaged``: raise ``AllCheckpointsDamagedError`` instead of returning
        None when every checkpoint failed; ``extra_state(manifest)``: more entries loaded in
        the same transaction. A writing checkpointer then continues the run from the step
        loaded (newer steps un-committed, a new run recorded); a reader changes nothing."""

    @abstractmethod
    def all_steps(self) -> list[int]:
        """The committed steps of the root, ascending (local; nothing verified)."""

    def latest_step(self) -> int | None:
        """The newest of :meth:`all_steps`, or None (local)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    @abstractmethod
    def close(self, *, flush: bool = True) -> None:
        """Release what it holds; a second call does nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close(flush=exc[0] is None)


class Checkpointer(CheckpointReader):
    """A job's checkpoints: saves on a cadence in the background, retention, the write lease,
    and resume (see the module docstring for who calls what).

    Attributes besides :class:`CheckpointReader`'s: ``cadence``, the policy ``maybe_save``
    follows (two tiers: the durable tier's); ``lease_lost``, another job took a write lease
    of this checkpointer (agreed by every rank at a save, or by :meth:`check_lease`): its
    saves no longer count.
    """

    cadence: CadencePolicy | None
    lease_lost: bool

    @property
    @abstractmethod
    def history(self) -> FailureHistory:
        """The job's failure history (for the ``auto`` cadence; two tiers: the durable
        tier's), the same on every rank."""

    @abstractmethod
    def save_history(self) -> None:
        """Write :attr:`history` now (the coordinator, holding the lease); saves also do."""

    @property
    @abstractmethod
    def lineage(self) -> Lineage:
        """The lineage the versions saved now record (the same on every rank)."""

    @property
    @abstractmethod
    def lease_lost_url(self) -> str | None:
        """The root whose lease was lost, or None."""

    @property
    @abstractmethod
    def newest_committed_step(self) -> int | None:
        """The newest step this checkpointer committed or found committed (two tiers: the
        durable tier's), the same on every rank."""

    @abstractmethod
    def check_lease(self) -> bool:
        """Collective: agree now whether a lease is lost; returns :attr:`lease_lost`."""

    @abstractmethod
    def prepare(self, state: dict[str, Any]) -> None:
        """Allocate the staging buffers for ``state`` now, so that the first save only
        copies (local)."""

    @abstractmethod
    def in_flight(self) -> bool:
        """A save is persisting in the background (local)."""

    @abstractmethod
    def maybe_save(self, step: int, state: dict[str, Any], *,
                   user_metadata: dict[str, Any] | None = None,
                   attachments: dict[str, Any] | None = None) -> bool:
        """Collective, after every training step: save ``step`` when the cadence says so.
        Returns True when a save started."""

    @abstractmethod
    def save(self, step: int, state: dict[str, Any], *, block: bool = False,
             force: bool = False, user_metadata: dict[str, Any] | None = None,
             attachments: dict[str, Any] | None = None) -> bool:
        """Collective: save ``step`` now. Returns True when a save started, False when it
        was skipped (the previous save in flight with ``busy="skip"``, the step committed,
        the lease lost; each a ``save_skipped`` event). ``block``: wait until committed.
        ``force``: never skipped: waits for a save in flight; True when ``step`` holds this
        run's state already; ``FileExistsError`` when an earlier run committed it,
        ``LeaseLostError`` when the lease is lost. ``attachments``: small files kept with
        the checkpoint (``ckpt.save``'s)."""

    @abstractmethod
    def wait(self, raise_errors: bool = True) -> Manifest | None:
        """Block until the saves in flight are committed or failed; returns the committed
        manifest of the root (on its coordinator; None elsewhere or on failure). Re-raises
        the newest save's failure when ``raise_errors``."""

    @abstractmethod
    def start_run(self, parent: Manifest | None, *, tier: str | None = None) -> Lineage:
        """Collective: begin a new run (``ckpt.root.lineage``) from ``parent``, the
        checkpoint the state was just loaded from (None: a fresh start); :meth:`load_latest`
        does it, a caller that loaded the state another way calls it before saving. Every
        version saved from now on records the new run and ``parent`` (:attr:`lineage`).
        The coordinator first appends the run to the job's run log (``_lineage.json`` of the
        root; two tiers: the durable root's, which both tiers' resumes read, and the local
        tier saves as the same run), naming the committed steps newer than ``parent`` that
        it goes back past: no resume takes them from then on. ``tier``: where ``parent``
        was loaded from, as the log records it. A failure to record raises on every rank.
        Returns the new lineage."""

    @abstractmethod
    def uncommit_newer(self, step: int) -> list[int]:
        """Collective: un-commit every committed step of the root newer than ``step`` (-1:
        all, a deliberate fresh start); returns those un-committed (on the coordinator)."""

    @abstractmethod
    def close(self, *, flush: bool = True) -> None:
        """Finish (``flush``) or abandon the saves in flight, release the leases and free
        the staging buffers and groups. Collective while a save is in flight."""
