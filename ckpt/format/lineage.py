"""A version's lineage as the manifest records it: the run that made it, and the version
that run's state was loaded from (docs/format.md, "Lineage").

``manifest["lineage"] = {"run": "<hex>", "parent": {"run": R | null, "step": S,
"save_id": I} | null}`` (OPTIONAL: versions written before lineage existed have none).
The rule that uses it is :mod:`ckpt.root.lineage`'s.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any, Iterable

from ckpt.errors import CorruptCheckpointError

__all__ = ["Lineage", "parse_lineage", "same_run", "new_run_id"]

_RUN_RE = re.compile(r"^[0-9a-f]{6,64}$")


def new_run_id() -> str:
    """A fresh run id (16 lowercase hex digits)."""
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True)
class Lineage:
    """The lineage of one version: the run that made it and where that run came from
    (``parent``: ``{"run", "step", "save_id"}`` of the version loaded, or None)."""

    run: str | None
    parent: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "parent": self.parent}

    def describe(self) -> str:
        """In words, for messages and ``ckpt history``."""
        if self.parent is None:
            return f"run {self.run} (fresh start)"
        return (f"run {self.run} (resumed from step {self.parent['step']} of run "
                f"{self.parent['run'] or '(before lineage)'})")


def parent_of(step: int, save_id: str, lineage: Lineage | None) -> dict[str, Any]:
    """The ``parent`` record naming version ``(step, save_id)``, whose lineage is
    ``lineage`` (None: written before lineage existed)."""
    return {"run": lineage.run if lineage is not None else None, "step": int(step),
            "save_id": str(save_id)}


def parse_lineage(raw: Any, source: str) -> Lineage | None:
    """A ``lineage`` member, checked (None when absent). Raises ``CorruptCheckpointError``
    naming ``source`` and the field."""
    if raw is None:
        return None

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{source}: lineage{what}; the manifest is damaged, "
                                      f"load an earlier step", path=source)

    if type(raw) is not dict:
        raise bad(" must be an object")
    run = raw.get("run")
    if not isinstance(run, str) or not _RUN_RE.match(run):
        raise bad(".run must be 6 to 64 lowercase hex digits")
    parent = raw.get("parent")
    if parent is not None:
        if type(parent) is not dict:
            raise bad(".parent must be an object or null")
        prun, pstep, psid = parent.get("run"), parent.get("step"), parent.get("save_id")
        if prun is not None and (not isinstance(prun, str) or not _RUN_RE.match(prun)):
            raise bad(".parent.run must be null or 6 to 64 lowercase hex digits")
        if type(pstep) is not int or not 0 <= pstep < 2 ** 63:
            raise bad(".parent.step must be an int in [0, 2**63)")
        if not isinstance(psid, str) or len(psid) > 64:
            raise bad(".parent.save_id must be a string of at most 64 characters")
        parent = {"run": prun, "step": pstep, "save_id": psid}
    return Lineage(run, parent)


def same_run(lineages: Iterable[Lineage | None]) -> bool:
    """Do these versions (of one step: several nodes' parts, copies) come from one run?"""
    return len({(x.run if x is not None else None) for x in lineages}) <= 1
