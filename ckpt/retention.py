"""Retention policies: which committed checkpoints to keep.

A policy is a small object with one method, ``keep(steps) -> set[int]``, given the committed
steps in ascending order. Several policies combine by union (a step is kept if any policy
keeps it). Whatever the policies say, :func:`apply_retention` never deletes the newest
durable checkpoint, a checkpoint newer than it, or a protected step; it deletes nothing at
all when the newest checkpoint fails verification; and a failed delete is reported, never
raised.
"""

from __future__ import annotations

import json
import logging
from typing import Callable, Iterable, Protocol, Sequence

from ckpt.errors import CorruptCheckpointError
from ckpt.store import CheckpointStore

__all__ = ["RetentionPolicy", "KeepLast", "KeepEvery", "KeepPinned", "KeepAll",
           "apply_retention", "PINS_NAME", "read_pins", "set_pinned"]

log = logging.getLogger(__name__)
PINS_NAME = "pins.json"


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
    """Keep the steps an operator pinned (``ckpt pin``), read from ``pins.json`` at the root."""

    def __init__(self, store: CheckpointStore, extra: Iterable[int] = ()):
        self.store = store
        self.extra = set(extra)

    def keep(self, steps: Sequence[int]) -> set[int]:
        return (read_pins(self.store) | self.extra) & set(steps)


def read_pins(store: CheckpointStore) -> set[int]:
    try:
        data = json.loads(store.storage.read_bytes(PINS_NAME))
    except FileNotFoundError:
        return set()
    except ValueError:
        log.warning("%s is not valid JSON; treating every checkpoint as pinned is not possible, "
                    "so no pins are honoured until it is fixed", store.storage.describe(PINS_NAME))
        return set()
    return {int(s) for s in data.get("pinned", []) if isinstance(s, int)}


def set_pinned(store: CheckpointStore, step: int, pinned: bool = True) -> set[int]:
    pins = read_pins(store)
    pins = pins | {step} if pinned else pins - {step}
    store.storage.write_bytes(PINS_NAME, json.dumps({"pinned": sorted(pins)}).encode())
    return pins


def apply_retention(store: CheckpointStore, policies: Sequence[RetentionPolicy], *,
                    protect: Iterable[int] = (),
                    on_deleted: Callable[[int], None] | None = None,
                    on_failed: Callable[[int, BaseException], None] | None = None) -> list[int]:
    """Delete committed checkpoints no policy keeps. Returns the steps deleted."""
    if not policies:
        return []
    committed = store.committed_steps()
    if len(committed) <= 1:
        return []
    newest = committed[-1]
    try:
        store.verify(newest, full=False)
    except CorruptCheckpointError as exc:
        log.warning("retention: newest checkpoint %d does not verify (%s); deleting nothing",
                    newest, exc)
        return []
    keep = {newest} | set(protect)
    for policy in policies:
        keep |= policy.keep(committed)
    deleted = []
    for step in committed:
        if step in keep or step >= newest:
            continue
        try:
            store.delete(step)
            deleted.append(step)
            if on_deleted:
                on_deleted(step)
        except Exception as exc:  # noqa: BLE001 - retention must never crash a job
            log.warning("retention: could not delete checkpoint %d: %s", step, exc)
            if on_failed:
                on_failed(step, exc)
    return deleted
