"""Goodput's ground truth: a job's breakdown computed from its raw event log and the times
its workers were killed, and the comparison with what the job exported.

Independent of ``ckpt.cadence.goodput`` (the ledger it checks): it reads only rank 0's
JSONL event log (every process of the job appends to it) and the harness's own clock.

Definitions (docs/monitoring.md, "Goodput"), from the log:

* a process's events run from its ``lease_acquired`` (its checkpoint manager's start) to
  the next process's; its first step starts at its first ``train_step``'s time less that
  step's ``step_seconds``;
* ``productive``: ``step_seconds`` of every ``train_step`` whose step a later process did
  not train again (a killed process's steps after the step its successor resumed from are
  ``recomputed``);
* ``startup``: from the launch to the first process's first step; ``restart``: from each
  kill to the next process's first step;
* ``checkpoint_stall``: ``stall_seconds`` of ``save_staged`` (both tiers) and
  ``wait_seconds`` of ``save_waited``;
* ``other``: the rest of the wall time from the launch to the end.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

CATEGORIES = ("productive", "startup", "restart", "recomputed", "checkpoint_stall",
              "reduced_quorum", "uncommitted", "other")
TOLERANCE_POINTS = 2.0


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every whole line of a JSONL event log (a line cut by a SIGKILL is left out)."""
    out = []
    if path.exists():
        for line in path.read_bytes().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def truth(events: list[dict[str, Any]], *, launch_unix: float, kills: list[float],
          end_unix: float) -> dict[str, Any]:
    """``{"wall_seconds", "goodput", "seconds": {category: s}}`` of a job launched at
    ``launch_unix`` whose workers were killed at ``kills`` (one process each, in order),
    taken at ``end_unix``, from rank 0's raw event log ``events``."""
    events = [e for e in events if e["time"] <= end_unix]
    starts = [i for i, e in enumerate(events) if e["kind"] == "lease_acquired"]
    if len(starts) != len(kills) + 1:
        raise ValueError(f"{len(starts)} process starts in the log for {len(kills)} kills: "
                         f"every kill must restart the job once before the end")
    procs = [events[a:b] for a, b in zip(starts, starts[1:] + [len(events)])]
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    first_step = []
    for i, proc in enumerate(procs):
        steps = [e for e in proc if e["kind"] == "train_step"]
        if not steps:
            raise ValueError(f"process {i} trained no step before {end_unix}")
        first_step.append(steps[0]["time"] - steps[0]["step_seconds"])
        if i + 1 < len(procs):
            resumed = [e["step"] for e in procs[i + 1] if e["kind"] == "resumed"]
            kept_up_to = resumed[0] if resumed else 0
        else:
            kept_up_to = None  # the live process: everything it trained so far counts
        for e in steps:
            lost = kept_up_to is not None and e["step"] > kept_up_to
            seconds["recomputed" if lost else "productive"] += e["step_seconds"]
    seconds["startup"] = first_step[0] - launch_unix
    seconds["restart"] = sum(first_step[i + 1] - k for i, k in enumerate(kills))
    for e in events:
        kind = e["kind"].removeprefix("local_")
        if kind == "save_staged":
            seconds["checkpoint_stall"] += e.get("stall_seconds") or 0.0
        elif kind == "save_waited":
            seconds["checkpoint_stall"] += e.get("wait_seconds") or 0.0
    wall = end_unix - launch_unix
    seconds["other"] = wall - sum(v for k, v in seconds.items() if k != "other")
    return {"wall_seconds": wall, "goodput": seconds["productive"] / wall, "seconds": seconds}


_SAMPLE = re.compile(r'^(train_goodput_\w+)\{([^}]*)\} (\S+)$', re.M)


def exported(metrics_page: str) -> dict[str, Any]:
    """The same breakdown as one rank's ``/metrics`` page serves it."""
    seconds, out = {}, {}
    for name, labels, value in _SAMPLE.findall(metrics_page):
        if name == "train_goodput_seconds":
            seconds[re.search(r'category="(\w+)"', labels).group(1)] = float(value)
        else:
            out[name] = float(value)
    return {"wall_seconds": out["train_goodput_wall_seconds"],
            "goodput": out["train_goodput_ratio"], "seconds": seconds,
            "first_start_unix": out["train_goodput_job_start_timestamp_seconds"]}


def compare(want: dict[str, Any], got: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per category and for goodput: each side's share of its own wall time, in
    points, and their difference."""
    rows = []
    for c in CATEGORIES:
        a = 100 * want["seconds"][c] / want["wall_seconds"]
        b = 100 * got["seconds"].get(c, 0.0) / got["wall_seconds"]
        rows.append({"category": c, "truth_seconds": want["seconds"][c],
                     "exported_seconds": got["seconds"].get(c, 0.0), "truth_points": a,
                     "exported_points": b, "difference": b - a})
    a, b = 100 * want["goodput"], 100 * got["goodput"]
    rows.append({"category": "goodput", "truth_seconds": want["wall_seconds"],
                 "exported_seconds": got["wall_seconds"], "truth_points": a,
                 "exported_points": b, "difference": b - a})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| category | truth, s | exported, s | truth, % of wall | exported, % of wall | "
             "difference, points |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['category']} | {r['truth_seconds']:.1f} | "
                     f"{r['exported_seconds']:.1f} | {r['truth_points']:.1f} | "
                     f"{r['exported_points']:.1f} | {r['difference']:+.1f} |")
    return "\n".join(lines)
