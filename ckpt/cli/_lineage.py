"""The trajectories of a root as an operator sees them (``ckpt history``, ``ckpt rollback``).

A tree of runs (:mod:`ckpt.root.lineage`): each run with where it resumed from, the versions
it saved that are live, and those a later resume went back past (abandoned), whether still
committed (never resumed from) or rolled back (restorable). Read only.
"""

from __future__ import annotations

import time
from typing import Any

from ckpt.errors import CheckpointError
from ckpt.root import COMMITTED, LINEAGE_NAME, ROLLED_BACK, CheckpointStore, Trajectory, read_runs

__all__ = ["trajectories", "print_trajectories", "branch_of"]

UNKNOWN = "(not in the run log)"


def _iso(unix: Any) -> str | None:
    if not isinstance(unix, (int, float)):
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix))


def trajectories(store: CheckpointStore) -> dict[str, Any]:
    """The run log and every version of the root (committed or rolled back), each with its
    run and whether it is live, as a JSON-ready dict: ``{"file", "tip", "runs": [...],
    "versions": [...]}``; each run lists its ``live`` and ``abandoned`` versions' steps and
    its ``children`` (the runs that resumed from it)."""
    records = read_runs(store.storage)
    traj = Trajectory(records)
    versions = []
    for step in store.steps():
        for e in store.life.entries(step):
            if e.status not in (COMMITTED, ROLLED_BACK) or e.manifest is None:
                continue
            m = e.manifest
            why = traj.why_abandoned(m.step, m.save_id, m.lineage)
            versions.append({
                "step": m.step, "id": m.save_id, "status": e.status,
                "run": m.lineage.run if m.lineage is not None else None,
                "parent": m.lineage.parent if m.lineage is not None else None,
                "live": why is None, "why": why, "created": _iso(m.created_unix)})
    runs: dict[Any, dict[str, Any]] = {}
    for rec in traj.runs:
        runs[rec["run"]] = {
            "run": rec["run"], "parent": rec.get("parent"),
            "started": _iso(rec.get("started_unix")),
            "job": rec.get("job"), "host": rec.get("host"), "tier": rec.get("tier"),
            "current": rec["run"] == traj.tip, "on_trajectory": rec["run"] in traj.chain,
            "live": [], "abandoned": [], "left_behind": rec.get("abandoned", []),
            "children": []}
    for v in versions:  # runs the log does not know still own their versions
        run = runs.setdefault(v["run"], {
            "run": v["run"], "parent": v["parent"], "started": None, "job": None, "host": None,
            "tier": None, "current": False, "on_trajectory": v["run"] in traj.chain,
            "live": [], "abandoned": [], "left_behind": [], "children": [], "unknown": True})
        run["live" if v["live"] else "abandoned"].append(
            {"step": v["step"], "id": v["id"], "status": v["status"], "why": v["why"]})
    roots = []
    for run in runs.values():
        parent = (run["parent"] or {}).get("run", "")
        if run["parent"] and parent in runs and parent != run["run"]:
            runs[parent]["children"].append(run["run"])
        else:
            roots.append(run["run"])
    return {"file": store.storage.describe(LINEAGE_NAME), "tip": traj.tip,
            "restored": sorted(traj.restored), "roots": roots,
            "runs": list(runs.values()), "versions": versions}


def _steps(versions: list[dict[str, Any]]) -> str:
    out = []
    for v in versions:
        note = "" if v["status"] == COMMITTED else " rolled back"
        out.append(f"{v['step']}{note}")
    return ", ".join(out)


def print_trajectories(info: dict[str, Any]) -> None:
    """``info`` (:func:`trajectories`) as a tree in the terminal."""
    if not info["runs"]:
        print(f"trajectories: no run log at {info['file']} and no versions")
        return
    print(f"trajectories ({info['file']}; current run: {info['tip'] or 'none recorded'}):")
    by_run = {r["run"]: r for r in info["runs"]}
    seen: set = set()

    def show(run_id: Any, depth: int) -> None:
        if run_id in seen:
            return
        seen.add(run_id)
        r = by_run[run_id]
        pad = "  " * depth
        p = r["parent"]
        if r.get("unknown") and run_id is None:
            origin = "versions written before lineage existed"
        elif r.get("unknown") and p is None:
            origin = "saved by ckpt.save or by a job that never loaded"
        elif p is None:
            origin = "fresh start"
        else:
            origin = f"resumed from step {p['step']} of run {p['run'] or '(before lineage)'}"
        when = f", {r['started']}" if r["started"] else ""
        job = f", job {r['job']}" if r["job"] else ""
        tags = " <- current" if r["current"] else ""
        tags += f" {UNKNOWN}" if r.get("unknown") else ""
        print(f"{pad}* run {run_id or '-'}: {origin}{when}{job}{tags}")
        if r["live"]:
            print(f"{pad}    live:      {_steps(r['live'])}")
        if r["abandoned"]:
            print(f"{pad}    abandoned: {_steps(r['abandoned'])} (a resume went back past them: "
                  f"never resumed from)")
        for child in r["children"]:
            show(child, depth + 1)

    for root in info["roots"]:
        show(root, 0)
    for run_id in by_run:  # a cycle or a crafted log: still shown
        show(run_id, 0)
    if info["restored"]:
        print(f"  restored by an operator: {', '.join(info['restored'])}")


def branch_of(store: CheckpointStore, steps: list[int]) -> str:
    """The branch that un-committing ``steps`` abandons, in words (``ckpt rollback``)."""
    runs: dict[Any, list[int]] = {}
    for step in steps:
        try:
            lineage = store.read_manifest(step).lineage
        except CheckpointError:
            continue
        runs.setdefault(lineage.run if lineage is not None else None, []).append(step)
    if not runs:
        return ""
    parts = [f"run {run or '(before lineage)'} steps {', '.join(map(str, sorted(s)))}"
             for run, s in runs.items()]
    return "; ".join(parts)
