"""Retention policies: which committed checkpoints to keep.

A policy is a small object with one method, ``keep(steps) -> set[int]``, given the committed
steps in ascending order. Several policies combine by union (a step is kept if any policy
keeps it); a policy is asked only while some step is left to delete, so one that reads
storage (``KeepPinned``) goes last and costs nothing when the others keep everything.
Whatever the policies say, :func:`apply_retention` never deletes the newest durable
checkpoint, a checkpoint newer than it, a pinned step (``pins.json``, as docs/format.md
requires: read last, only when a step is left to delete) or a protected step; it deletes
nothing at all when the newest checkpoint fails verification; and a failed delete is
reported, never raised. A save in flight is not committed, so no policy ever sees it.
It is two halves: :func:`plan_retention` (the policies decide, in the process that holds
them) and :func:`carry_out_retention` (the newest verified, then the deletions through the
root's life-cycle; a manager in process mode runs it in its writer process).

:class:`KeepBest` keeps the best ``k`` by a metric of ``user_metadata``. A manager records
its best-k policies at the root (``_retention.json``, :func:`record_retention`) so that
``ckpt list`` can say which checkpoints are kept for that reason (:func:`read_retention`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence

from ckpt.errors import CheckpointError, CheckpointNotFoundError, FencedCheckpointError
from ckpt.format import Manifest, jsonio
from ckpt.root import CheckpointStore

__all__ = ["RetentionPolicy", "KeepLast", "KeepEvery", "KeepPinned", "KeepAll", "KeepBest",
           "apply_retention", "plan_retention", "carry_out_retention", "RetentionPlan",
           "PINS_NAME", "read_pins", "set_pinned", "RETENTION_NAME",
           "record_retention", "read_retention"]

log = logging.getLogger(__name__)
PINS_NAME = "pins.json"
RETENTION_NAME = "_retention.json"


class RetentionPolicy(Protocol):
    def keep(self, steps: Sequence[int]) -> set[int]: ...


class KeepAll:
    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(steps)


class KeepLast:
    """Keep the newest ``k`` committed checkpoints."""

    def __init__(self, k: int):
        if k < 1:
            raise ValueError(f"KeepLast(k={k}): k must be >= 1 (the newest is always kept)")
        self.k = k

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(sorted(steps)[-self.k:])


class KeepEvery:
    """Keep every checkpoint whose step is a multiple of ``n`` (e.g. a long-term archive)."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"KeepEvery(n={n}): n must be >= 1")
        self.n = n

    def keep(self, steps: Sequence[int]) -> set[int]:
        return {s for s in steps if s % self.n == 0}


class KeepPinned:
    """Keep the steps an operator pinned (``ckpt pin``), read from ``pins.json`` at the root
    each time it is asked (a pin may come at any time, from any process): list it last.

    If ``pins.json`` exists but cannot be parsed, every checkpoint is kept (with a warning)
    until it is fixed: a damaged pin list must not turn into deletions.
    """

    def __init__(self, store: CheckpointStore, extra: Iterable[int] = ()):
        self.store = store
        self.extra = set(extra)

    def keep(self, steps: Sequence[int]) -> set[int]:
        try:
            pins = read_pins(self.store, strict=True)
        except ValueError as exc:
            log.warning("retention keeps every checkpoint: %s", exc)
            return set(steps)
        return (pins | self.extra) & set(steps)


class KeepBest:
    """Keep the ``k`` committed checkpoints with the best ``user_metadata[key]``: the lowest
    with ``mode="min"`` (a loss), the highest with ``mode="max"`` (an accuracy), as
    Lightning's ``save_top_k``/``monitor`` and Orbax's ``best_fn`` do.

    A checkpoint without a finite number under ``key`` (none saved, a NaN loss) is never
    among the best; other policies may keep it. Of equal values the newer wins. Combine it
    with ``KeepLast`` to keep recent ones too: the newest is kept anyway, and pinned and
    in-flight ones are never deleted (:func:`apply_retention`).

    Each manifest is read once (the first time its step is seen) and its value remembered;
    the manifest a save has just committed is handed over without a read (:meth:`note`).
    """

    def __init__(self, store: CheckpointStore, key: str, k: int = 1, mode: str = "min"):
        if not isinstance(key, str) or not key:
            raise ValueError(f"KeepBest(key={key!r}): name a user_metadata key, e.g. 'loss'")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"KeepBest(k={k!r}): k must be an integer >= 1")
        if mode not in ("min", "max"):
            raise ValueError(f"KeepBest(mode={mode!r}): expected 'min' (lower is better, a "
                             f"loss) or 'max' (higher is better, an accuracy)")
        self.store, self.key, self.k, self.mode = store, key, k, mode
        self._values: dict[int, float | None] = {}

    def describe(self) -> dict[str, Any]:
        """The policy as ``_retention.json`` records it."""
        return {"key": self.key, "k": self.k, "mode": self.mode}

    def reason(self) -> str:
        """Why a step it keeps is kept, in words (``ckpt list``)."""
        return f"best {self.k} by {self.key} ({self.mode})"

    def note(self, step: int, user_metadata: dict[str, Any] | None) -> None:
        """The committed checkpoint of ``step`` holds ``user_metadata`` (no read needed)."""
        value = (user_metadata or {}).get(self.key) if isinstance(user_metadata, dict) else None
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
            math.isfinite(value)
        self._values[step] = float(value) if ok else None

    def keep(self, steps: Sequence[int]) -> set[int]:
        steps = list(steps)
        for step in steps:
            if step not in self._values:
                try:
                    self.note(step, self.store.read_manifest(step).user_metadata)
                except CheckpointError as exc:  # damaged or gone: not among the best
                    log.warning("retention: cannot read %s of step %d (%s)", self.key, step,
                                exc)
        present = set(steps)
        self._values = {s: v for s, v in self._values.items() if s in present}
        sign = 1.0 if self.mode == "min" else -1.0
        ranked = sorted((sign * v, -s) for s, v in self._values.items() if v is not None)
        return {-neg_step for _, neg_step in ranked[:self.k]}


def record_retention(store: CheckpointStore, policies: Sequence[RetentionPolicy]) -> None:
    """Record the :class:`KeepBest` policies among ``policies`` at the root
    (``_retention.json``), or remove a record no longer true; the lease holder calls it
    at start. Advisory: a failure is logged, never raised."""
    best = [p.describe() for p in policies if isinstance(p, KeepBest)]
    try:
        if best:
            store.storage.write_bytes(RETENTION_NAME, jsonio.dumps({"best": best}))
        elif store.storage.exists(RETENTION_NAME):
            store.storage.delete(RETENTION_NAME)
    except Exception as exc:  # noqa: BLE001 - only `ckpt list` reads it
        log.warning("could not record the retention policies in %s: %s",
                    store.storage.describe(RETENTION_NAME), exc)


def read_retention(store: CheckpointStore) -> list[KeepBest]:
    """The best-k policies recorded at the root ([] when none). Raises ``ValueError`` naming
    the file when it is damaged."""
    where = store.storage.describe(RETENTION_NAME)
    try:
        data = store.storage.read_bytes(RETENTION_NAME, max_bytes=1 << 20)
        doc = jsonio.loads(data, where, max_bytes=1 << 20)
    except FileNotFoundError:
        return []
    try:
        return [KeepBest(store, **p) for p in doc["best"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where} is damaged ({exc}); the next job with a KeepBest policy "
                         f"rewrites it, or delete it") from None


def read_pins(store: CheckpointStore, *, strict: bool = False) -> set[int]:
    """The pinned steps. An unreadable ``pins.json`` raises ``ValueError`` when ``strict``,
    else it is logged and reads as no pins."""
    where = store.storage.describe(PINS_NAME)
    try:
        data = jsonio.loads(store.storage.read_bytes(PINS_NAME, max_bytes=16 << 20), where,
                            max_bytes=16 << 20)
        pins = data.get("pinned") if isinstance(data, dict) else None
        if not isinstance(pins, list) or not all(
                isinstance(s, int) and not isinstance(s, bool) and 0 <= s < (1 << 63)
                for s in pins):
            raise ValueError('expected {"pinned": [step, ...]} with integer steps')
    except FileNotFoundError:
        return set()
    except ValueError as exc:
        msg = (f"{where} is damaged ({exc}); fix it or delete it (`ckpt pin` rewrites it "
               f"once it is gone)")
        if strict:
            raise ValueError(msg) from None
        log.warning("%s", msg)
        return set()
    return set(pins)


def set_pinned(store: CheckpointStore, step: int, pinned: bool = True) -> set[int]:
    """Pin (or unpin) ``step``; returns the pinned steps. Refuses a damaged ``pins.json``
    rather than overwriting the pins it holds."""
    pins = read_pins(store, strict=True)
    pins = pins | {step} if pinned else pins - {step}
    store.storage.write_bytes(PINS_NAME, jsonio.dumps({"pinned": sorted(pins)}))
    return pins


@dataclass(frozen=True)
class RetentionPlan:
    """What retention decided after a commit: delete ``steps`` (ascending, each older than
    ``newest_step``), once the newest checkpoint, ``newest_step``, verifies. Decided by
    :func:`plan_retention` where the policies live, carried out by
    :func:`carry_out_retention` (in the same process, or in a manager's writer process:
    ``ckpt.job._writer_process``)."""

    newest_step: int
    steps: tuple[int, ...]


def plan_retention(store: CheckpointStore, policies: Sequence[RetentionPolicy], *,
                   protect: Iterable[int] = (), newest_manifest: Manifest | None = None,
                   committed: Sequence[int] | None = None) -> RetentionPlan | None:
    """The committed checkpoints no policy keeps, as a plan (None: nothing to delete).

    The policies are asked in order, each only while some step is left to delete, and the
    pins (``pins.json``, :class:`KeepPinned`) last when no policy reads them; the newest
    checkpoint, anything newer and ``protect`` are kept whatever they say.
    ``newest_manifest``: the manifest this process just committed (its ``user_metadata``
    goes to :class:`KeepBest` without a read). ``committed``: the committed steps as the
    root's writer knows them (``Lifecycle.known_committed``); without it the root is listed.
    """
    if not policies:
        return None
    if newest_manifest is not None:
        for policy in policies:
            if isinstance(policy, KeepBest):
                policy.note(newest_manifest.step, newest_manifest.user_metadata)
    committed = sorted(committed) if committed is not None else store.committed_steps()
    if len(committed) <= 1:
        return None
    newest = committed[-1]
    keep = {newest} | set(protect)

    def doomed() -> list[int]:
        return [s for s in committed if s not in keep and s < newest]

    if not any(isinstance(p, KeepPinned) for p in policies):
        policies = [*policies, KeepPinned(store)]  # pins hold whatever the policies say
    for policy in policies:
        if not doomed():
            return None
        keep |= policy.keep(committed)
    steps = doomed()
    return RetentionPlan(newest, tuple(steps)) if steps else None


def carry_out_retention(store: CheckpointStore, plan: RetentionPlan, *,
                        newest_manifest: Manifest | None = None,
                        on_deleted: Callable[[int], None] | None = None,
                        on_failed: Callable[[int, BaseException], None] | None = None,
                        on_gone: Callable[[int], None] | None = None) -> list[int]:
    """Delete the steps of ``plan`` through the store's life-cycle (the lease holder),
    after checking that its newest checkpoint verifies (its files' sizes; against
    ``newest_manifest`` without a read when it is that step's): nothing is deleted when it
    does not. Returns the steps deleted. A failed delete is reported (``on_failed``), never
    raised; a step found without a manifest is gone already (``on_gone``; no failure)."""
    newest = plan.newest_step
    try:
        if newest_manifest is not None and newest_manifest.step == newest:
            store.verify_manifest(newest_manifest, full=False)
        else:
            store.verify(newest, full=False)
    except CheckpointError as exc:  # corrupt, vanished, or storage unreachable
        log.warning("retention: newest checkpoint %d does not verify (%s); deleting nothing",
                    newest, exc)
        return []
    deleted = []
    for step in plan.steps:
        try:
            store.life.delete(step)  # the root's life-cycle, the one the store reads through
            deleted.append(step)
            if on_deleted:
                on_deleted(step)
        except CheckpointNotFoundError as exc:
            if isinstance(exc, FencedCheckpointError):
                log.warning("retention: could not delete checkpoint %d: %s", step, exc)
                if on_failed:
                    on_failed(step, exc)
            else:
                log.info("retention: checkpoint %d is gone already", step)
                if on_gone:
                    on_gone(step)
        except Exception as exc:  # noqa: BLE001 - retention must never crash a job
            log.warning("retention: could not delete checkpoint %d: %s", step, exc)
            if on_failed:
                on_failed(step, exc)
    return deleted


def apply_retention(store: CheckpointStore, policies: Sequence[RetentionPolicy], *,
                    protect: Iterable[int] = (),
                    on_deleted: Callable[[int], None] | None = None,
                    on_failed: Callable[[int, BaseException], None] | None = None,
                    newest_manifest: Manifest | None = None,
                    committed: Sequence[int] | None = None) -> list[int]:
    """Delete committed checkpoints no policy keeps (:func:`plan_retention`, then
    :func:`carry_out_retention`). Returns the steps deleted.

    ``newest_manifest``: the manifest this process just committed, when it is the newest:
    its files are checked against it without reading and parsing it back (a save's
    retention would otherwise parse the manifest it has just written). ``committed``: the
    committed steps as the root's writer knows them (``Lifecycle.known_committed``);
    without it the root is listed. The newest checkpoint is verified (its files' sizes)
    only when some step is to be deleted; a step found without a manifest is already gone
    (not a failure).
    """
    plan = plan_retention(store, policies, protect=protect, newest_manifest=newest_manifest,
                          committed=committed)
    if plan is None:
        return []
    return carry_out_retention(store, plan, newest_manifest=newest_manifest,
                               on_deleted=on_deleted, on_failed=on_failed)
