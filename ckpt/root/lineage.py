r"""The trajectories of a root: the run log, and the one rule that says which versions are
live (docs/format.md, "Lineage").

A *run* is one stretch of training along one trajectory: it begins when a job starts, and
again each time a job loads a checkpoint (a resume, a rollback to a chosen step). Every
version a run commits records the run and the version it was loaded from
(:class:`ckpt.format.lineage.Lineage`, the manifest's ``lineage``).

The run log. Each resume records its run in the job's root (the durable root of a job with
two tiers) before the run saves anything: ``_lineage.json`` = ``{"format":
"ckpt-lineage", "runs": [record, ...]}``, oldest first. A record is ``{"run", "parent",
"started_unix", "host", "job", "kind": "resume", "abandoned": [{"step", "save_id", "run",
"tier"}, ...]}`` where ``abandoned`` lists the committed versions newer than the parent
that the resume went back past (for ``ckpt history``), or ``{"kind": "restore", "run",
"restored": <save id>, "step"}`` when an operator's ``ckpt restore`` re-admitted one
version. Only the root's lease holder writes it.

The rule (:class:`Trajectory`): the newest ``resume`` record's run is the *tip*; following
``parent`` back from it gives the current trajectory, a chain of ``(run, last step)``: the
tip with no limit, each ancestor up to the step its child resumed from. A version is
**live** when its run is on the chain at or before that run's limit, or an operator
restored it. A version of a run the log knows that is not live was *abandoned*: a resume
went back past it, and nothing (no resume, on any node, tier or copy) loads it or combines
it with live ones, whether or not it could be deleted. A version of a run the log does not
know (written by ``ckpt.save`` or by a manager that never loaded, or older than the log) is
live: the log holds evidence against versions, never for them.

Combining versions of one step (the local tier's nodes, copies on the next node) needs, on
top, that every part comes from one run (:func:`ckpt.format.lineage.same_run`).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from typing import Any

from ckpt.errors import AbandonedCheckpointError, CorruptCheckpointError
from ckpt.format import Lineage, jsonio, new_run_id, parse_lineage
from ckpt.storage import Storage

__all__ = ["LINEAGE_NAME", "Trajectory", "read_runs", "record_run", "record_restore"]

log = logging.getLogger(__name__)

LINEAGE_NAME = "_lineage.json"
MAX_RUNS = 4096
"""Records kept in the run log (the oldest are dropped: their versions count as unknown,
and retention has long removed them by then)."""
MAX_LOG_BYTES = 8 << 20


def read_runs(storage: Storage) -> list[dict[str, Any]]:
    """The run log of ``storage``'s root, oldest first ([] when there is none).

    A damaged log is reported (a warning naming it) and read as empty: with no evidence,
    every version counts as live, as before lineage existed; the next record moves the
    damaged file aside (``_lineage.damaged-<hex>.json``) rather than losing it.
    """
    try:
        data = storage.read_bytes(LINEAGE_NAME, max_bytes=MAX_LOG_BYTES)
    except FileNotFoundError:
        return []
    except CorruptCheckpointError as exc:  # larger than a run log can be: unread
        log.warning("%s; every checkpoint counts as live until a resume records its run "
                    "again", exc)
        return []
    try:
        return _parse_log(data, storage.describe(LINEAGE_NAME))
    except CorruptCheckpointError as exc:
        log.warning("%s; every checkpoint counts as live until a resume records its run "
                    "again", exc)
        return []


def _parse_log(data: bytes, source: str) -> list[dict[str, Any]]:
    doc = jsonio.loads(data, source, max_bytes=MAX_LOG_BYTES)
    if type(doc) is not dict or doc.get("format") != "ckpt-lineage" \
            or type(doc.get("runs")) is not list:
        raise CorruptCheckpointError(f"{source}: run log is damaged (expected an object with "
                                     f"format 'ckpt-lineage' and a list 'runs')", path=source)
    out = []
    for i, rec in enumerate(doc["runs"]):
        where = f"{source}: runs[{i}]"
        if type(rec) is not dict:
            raise CorruptCheckpointError(f"{where} must be an object", path=source)
        lin = parse_lineage({"run": rec.get("run"), "parent": rec.get("parent")}, where)
        abandoned = rec.get("abandoned", [])
        if type(abandoned) is not list or any(type(a) is not dict for a in abandoned):
            raise CorruptCheckpointError(f"{where}.abandoned must be a list of objects",
                                         path=source)
        kind = rec.get("kind", "resume")
        restored = rec.get("restored")
        if kind not in ("resume", "restore") or (kind == "restore"
                                                 and not isinstance(restored, str)):
            raise CorruptCheckpointError(f"{where}: kind must be 'resume', or 'restore' with "
                                         f"a string 'restored'", path=source)
        out.append({**rec, "run": lin.run, "parent": lin.parent, "abandoned": abandoned,
                    "kind": kind})
    return out


def record_run(storage: Storage, record: dict[str, Any]) -> list[dict[str, Any]]:
    """Append ``record`` (see the module docstring) to the run log; returns the log.

    The root's lease holder only (the log is read, extended and written back). A damaged
    log is moved aside first, never overwritten. Raises on a storage error: a run that
    cannot record itself must not go on (its versions could not be told apart).
    """
    record = {"started_unix": time.time(), "host": socket.gethostname(), "kind": "resume",
              "abandoned": [], **record}
    runs: list[dict[str, Any]] = []
    try:
        data = storage.read_bytes(LINEAGE_NAME, max_bytes=MAX_LOG_BYTES)
    except FileNotFoundError:
        data = None
    except CorruptCheckpointError as exc:  # larger than any run log: not one, replaced
        log.warning("%s; it is no run log of ckpt and is replaced by a new one", exc)
        data = None
    if data is not None:
        try:
            runs = _parse_log(data, storage.describe(LINEAGE_NAME))
        except CorruptCheckpointError as exc:
            aside = f"_lineage.damaged-{os.urandom(6).hex()}.json"
            storage.write_bytes(aside, data)
            log.warning("%s; moved aside to %s, a new log begins", exc, storage.describe(aside))
    runs = (runs + [record])[-MAX_RUNS:]
    storage.write_bytes(LINEAGE_NAME, jsonio.dumps({"format": "ckpt-lineage", "runs": runs},
                                                   indent=1))
    return runs


def record_restore(storage: Storage, step: int, save_id: str) -> None:
    """Record that an operator re-admitted version ``save_id`` of ``step`` (``ckpt
    restore``): it is live again, whatever its run (lease holder only)."""
    record_run(storage, {"kind": "restore", "run": new_run_id(), "parent": None,
                         "restored": save_id, "step": int(step)})


class Trajectory:
    """The current trajectory of a root, from its run log: which versions are live."""

    def __init__(self, runs: list[dict[str, Any]]):
        self.records = list(runs)
        self.runs = [r for r in self.records if r.get("kind", "resume") == "resume"]
        self.by_run = {r["run"]: r for r in self.runs}
        self.restored = {r["restored"] for r in self.records if r.get("kind") == "restore"}
        self.tip = self.runs[-1]["run"] if self.runs else None
        # run -> the last step of it on the current trajectory (the tip: no limit)
        self.chain: dict[str | None, float] = {}
        run, limit = self.tip, math.inf
        while self.runs and run not in self.chain:  # a cycle only comes from a crafted log
            self.chain[run] = limit
            parent = (self.by_run.get(run) or {}).get("parent")
            if not parent:
                break
            run, limit = parent.get("run"), parent["step"]

    def why_abandoned(self, step: int, save_id: str, lineage: Lineage | None) -> str | None:
        """None when version ``save_id`` of ``step`` (its ``lineage``) is live; else why not."""
        if save_id in self.restored:
            return None
        run = lineage.run if lineage is not None else None
        if run in self.chain:
            if step <= self.chain[run]:
                return None
        elif run not in self.by_run:
            return None  # no evidence against it
        for rec in self.runs:
            parent = rec.get("parent") or {}
            if rec["run"] != run and parent.get("run", "") == run and parent["step"] < step:
                when = time.strftime("%Y-%m-%d %H:%M:%S",
                                     time.gmtime(rec.get("started_unix") or 0))
                return (f"abandoned: run {rec['run']} resumed from step {parent['step']} of "
                        f"run {run or '(before lineage)'} at {when} UTC, going back past it")
        return f"abandoned: its run {run} is not on the current trajectory (run {self.tip})"

    def check(self, step: int, save_id: str, lineage: Lineage | None, where: str) -> None:
        """Raise ``AbandonedCheckpointError`` naming ``where`` when the version is not live."""
        why = self.why_abandoned(step, save_id, lineage)
        if why is not None:
            raise AbandonedCheckpointError(f"{where} is {why}; it is never resumed from "
                                           f"(`ckpt history` shows the trajectories)")
