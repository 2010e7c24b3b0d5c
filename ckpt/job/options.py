"""A job's checkpoint options: one frozen dataclass per manager, each field with its default
and its check in one place.

:class:`ManagerOptions` configures a :class:`~ckpt.job.manager.CheckpointManager` (and both
tiers of a :class:`~ckpt.job.tiers.TieredCheckpointManager`); :class:`LocalTierOptions` the
tiered manager's local tier. A bad value is refused when the options are built, with a
``ValueError`` naming the field and the fix. The live objects a manager needs (its events,
its process group) are passed to it beside the options, never in them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from ckpt.cadence import CadencePolicy, parse_interval
from ckpt.job._writer_process import check_writer_mode
from ckpt.job.retention import KeepLast, RetentionPolicy
from ckpt.root import DEFAULT_LEASE_TTL_SECONDS

__all__ = ["ManagerOptions", "LocalTierOptions", "DEFAULT_LOCAL_KEEP"]

DEFAULT_LOCAL_KEEP = 2
"""Local checkpoints kept by default (retention of the local tier)."""

_VERIFY = ("full", "size", "none")


def _check_cadence(owner: str, cadence: Any) -> None:
    if cadence is None or isinstance(cadence, CadencePolicy):
        return
    if isinstance(cadence, (str, int)) and not isinstance(cadence, bool):
        try:
            parse_interval(cadence)
        except ValueError as exc:
            raise ValueError(f"{owner}.cadence={cadence!r}: {exc}") from None
        return
    raise ValueError(f"{owner}.cadence={cadence!r}: expected a CadencePolicy "
                     f"(ckpt.cadence.policies), an interval string ('auto', '100' steps, "
                     f"'300s') or None")


def _check_retention(owner: str, retention: Any) -> tuple | None:
    if retention is None:
        return None
    if isinstance(retention, (str, bytes)) or not hasattr(retention, "__iter__"):
        raise ValueError(f"{owner}.retention={retention!r}: expected a sequence of retention "
                         f"policies (e.g. [KeepLast(3)]), [] to keep everything, or None")
    policies = tuple(retention)
    for p in policies:
        if not callable(getattr(p, "keep", None)):
            raise ValueError(f"{owner}.retention: {p!r} is no retention policy (it has no "
                             f"keep(steps) method); use KeepLast, KeepEvery, KeepBest ...")
    return policies


@dataclass(frozen=True)
class ManagerOptions:
    """How a :class:`~ckpt.job.manager.CheckpointManager` saves, keeps and loads.

    Every field has a default; ``ManagerOptions()`` is a working configuration that never
    saves from ``maybe_save`` (no cadence). ``cadence`` and ``retention`` may also be given
    to the manager as keywords (the same fields, spelled once).
    """

    cadence: CadencePolicy | str | None = None
    """When ``maybe_save`` saves: a ``CadencePolicy`` (``ckpt.cadence.policies``; used by one
    manager only, it keeps state) or an interval string (``"auto"``, ``"100"`` steps,
    ``"300s"``). None (default): ``maybe_save`` never saves (it warns once), ``save`` does."""
    retention: tuple[RetentionPolicy, ...] | None = None
    """Which older checkpoints to delete after each commit (``ckpt.job.retention``). None
    (default): keep the last 3. ``()``: keep everything. Pinned steps are kept whatever the
    policies (:func:`ckpt.job.retention.apply_retention`)."""
    async_save: bool = True
    """Persist in the background (default), or block every save until it is committed."""
    busy: str = "skip"
    """A save due while the previous one persists: ``"skip"`` it (counted, reported;
    default) or ``"wait"`` for the previous one."""
    verify: str = "full"
    """Checks on load: ``"full"`` (every chunk's CRC32C; default), ``"size"`` (file sizes)
    or ``"none"``."""
    num_threads: int | None = None
    """Parallel file writes and reads per rank (None: the store's default)."""
    use_lease: bool = True
    """Hold the root's write lease, fencing off any other writer (default True)."""
    lease_ttl_seconds: float = DEFAULT_LEASE_TTL_SECONDS
    """How long the lease outlives its last heartbeat (``ckpt.root.lease``; > 0); with
    ``writer="process"`` also how long a writer waits for the others at a save's rendezvous."""
    raise_on_failure: bool = False
    """Re-raise a background save's failure at the next call (default: report it through
    events, logs and ``wait()`` only)."""
    max_attempts: int = 3
    """Attempts per save before it is reported failed (>= 1)."""
    retry_backoff_seconds: float = 0.5
    """Pause before the second attempt, doubling per attempt up to 5 s (>= 0)."""
    layout: Mapping[str, Any] | None = None
    """The parallel layout recorded in every manifest (e.g. ``{"dp": 4, "tp": 2}``)."""
    job_name: str | None = None
    """The job's name in the lease record and the run log (default: from the environment)."""
    job_fingerprint: str | None = None
    """What identifies this job to its lease: a holder with the same fingerprint is this
    job's earlier attempt, whose lease may be taken at once (``ckpt.root.lease``)."""
    storage_options: Mapping[str, Any] | None = None
    """fsspec options for a root given as a URL (the durable root's only, in two tiers)."""
    staging_budget_bytes: int | None = None
    """The most host memory a save's copy of this rank's state may take (None: one whole
    copy). A larger state is saved in pieces, the save blocking until committed
    (``ckpt.dcp.staging``)."""
    writer: str = "thread"
    """Where a save's background work runs: ``"thread"`` (default), or ``"process"``: a
    writer process beside the training process (``ckpt.job._writer_process``; docs/store.md,
    "The writer process")."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check_cadence(name, self.cadence)
        object.__setattr__(self, "retention", _check_retention(name, self.retention))
        if self.busy not in ("skip", "wait"):
            raise ValueError(f"{name}.busy={self.busy!r}: expected 'skip' or 'wait'")
        if self.verify not in _VERIFY:
            raise ValueError(f"{name}.verify={self.verify!r}: expected one of "
                             f"{', '.join(_VERIFY)}")
        for key in ("num_threads", "staging_budget_bytes"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name}.{key}={value!r}: expected a positive integer, "
                                 f"or None for the default")
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) \
                or self.max_attempts < 1:
            raise ValueError(f"{name}.max_attempts={self.max_attempts!r}: must be >= 1 "
                             f"(1: no retry)")
        if not self.lease_ttl_seconds > 0:
            raise ValueError(f"{name}.lease_ttl_seconds={self.lease_ttl_seconds!r}: must be "
                             f"> 0 (seconds the lease outlives its last heartbeat)")
        try:
            check_writer_mode(self.writer)
        except ValueError as exc:
            raise ValueError(f"{name}.{exc}") from None
        if not self.retry_backoff_seconds >= 0:
            raise ValueError(f"{name}.retry_backoff_seconds={self.retry_backoff_seconds!r}: "
                             f"must be >= 0")


@dataclass(frozen=True)
class LocalTierOptions:
    """The local tier of a :class:`~ckpt.job.tiers.TieredCheckpointManager` (the rest of its
    options are the durable tier's :class:`ManagerOptions`, which both tiers share)."""

    cadence: CadencePolicy | str | None = None
    """The local tier's interval, as ``ManagerOptions.cadence`` (None: the local tier saves
    only from ``save``)."""
    retention: tuple[RetentionPolicy, ...] | None = None
    """The local tier's retention; None (default): keep the last ``DEFAULT_LOCAL_KEEP``."""
    copies: int = 1
    """1 (default): each node keeps its own local checkpoints; 2: each node's are also
    copied to the next node (``peer-{node}/`` under its local root), so that the local tier
    survives the loss of one node (docs/store.md, "Copies on the next node")."""
    node_rank: int | None = None
    """This process's node (default: torchrun's ``GROUP_RANK``, else 0). Ranks with the same
    node share a local root; a ``{node}`` in the local root is replaced by it."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check_cadence(name, self.cadence)
        retention = _check_retention(name, self.retention)
        object.__setattr__(self, "retention", (KeepLast(DEFAULT_LOCAL_KEEP),)
                           if retention is None else retention)
        if isinstance(self.copies, bool) or self.copies not in (1, 2):
            raise ValueError(f"{name}.copies={self.copies!r}: expected 1 (each node keeps its "
                             f"own local checkpoints) or 2 (and a copy on the next node)")
        if self.node_rank is not None and (isinstance(self.node_rank, bool)
                                           or not isinstance(self.node_rank, int)
                                           or self.node_rank < 0):
            raise ValueError(f"{name}.node_rank={self.node_rank!r}: expected an integer >= 0, "
                             f"or None (torchrun's GROUP_RANK)")


def with_policies(options: Any, owner: str, **given: Any) -> Any:
    """``options`` with the fields a manager was given as keywords (``cadence=``,
    ``retention=``, ``busy=``: each None when not given). A field given both ways, as the
    keyword and as a value other than its default in ``options``, is refused."""
    given = {k: v for k, v in given.items() if v is not None}
    defaults = {f.name: f.default for f in fields(options)}
    for key, value in given.items():
        if getattr(options, key) not in (defaults[key], value):
            raise ValueError(f"{owner}: {key} given twice, as {owner}({key}=...) and as "
                             f"{type(options).__name__}.{key}; give it once")
    return replace(options, **given) if given else options
