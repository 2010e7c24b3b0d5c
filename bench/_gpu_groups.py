"""Which backend each process group of a trainer launch has: recorded in the ranks, judged here.

:func:`run_trainer_recording_groups` runs ``python -m trainer`` with
``dist.init_process_group``, ``dist.new_group`` and ``dist.new_subgroups_by_enumeration``
wrapped, so every group a rank creates leaves one JSON line: its kind, its ``group_desc``,
the module that asked for it (the first caller outside torch) and its backend.

:func:`check_backends` reads those records: the training group must be NCCL on a GPU (gloo
on CPU), and the checkpoint store's groups, at least the manager's two, gloo. The store's
groups are known by their ``group_desc`` (``ckpt_control``, ``ckpt_persist``, any
``ckpt_*``) or by a creator anywhere in the ``ckpt`` package: a group created by a
subgroup call has no description, and the modules that create them move
(``ckpt.manager`` first, ``ckpt.manager_groups`` next, ``ckpt.ranks.groups`` now).
"""

from __future__ import annotations

import json
import sys
from typing import Any, Iterable

__all__ = ["run_trainer_recording_groups", "checkpoint_group_backends", "check_backends",
           "first_caller_outside_torch", "CKPT_PACKAGE", "CKPT_GROUP_DESC_PREFIX"]

CKPT_PACKAGE = "ckpt"
CKPT_GROUP_DESC_PREFIX = "ckpt_"


def first_caller_outside_torch(frame) -> str:
    """The module of the first frame outside torch, from ``frame`` outwards."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "?")
        if name != "torch" and not name.startswith("torch."):
            return name
        frame = frame.f_back
    return "?"


def run_trainer_recording_groups(record: str, argv0: str = "trainer") -> None:
    """Run ``python -m trainer`` (``sys.argv[1:]``) in this process, appending one JSON line
    per process group created to the file ``record``."""
    import runpy

    import torch.distributed as dist

    init, new_group, new_subgroups = (dist.init_process_group, dist.new_group,
                                      dist.new_subgroups_by_enumeration)

    def write(kind: str, caller: str, desc: Any, group: Any) -> None:
        try:
            backend = str(dist.get_backend(group))
        except (RuntimeError, ValueError):  # a group this rank is not a member of
            backend = None
        with open(record, "a") as f:
            f.write(json.dumps({"kind": kind, "caller": caller, "desc": desc,
                                "backend": backend, "rank": dist.get_rank()}) + "\n")

    def init_recorded(*args, **kwargs):
        caller = first_caller_outside_torch(sys._getframe(1))
        out = init(*args, **kwargs)
        write("init", caller, kwargs.get("group_desc"), None)
        return out

    def new_group_recorded(*args, **kwargs):
        caller = first_caller_outside_torch(sys._getframe(1))
        group = new_group(*args, **kwargs)
        write("new_group", caller, kwargs.get("group_desc"), group)
        return group

    def new_subgroups_recorded(*args, **kwargs):
        caller = first_caller_outside_torch(sys._getframe(1))
        mine, groups = new_subgroups(*args, **kwargs)
        write("new_subgroups", caller, kwargs.get("group_desc"), mine)
        return mine, groups

    dist.init_process_group = init_recorded
    dist.new_group = new_group_recorded
    dist.new_subgroups_by_enumeration = new_subgroups_recorded
    sys.argv[0] = argv0
    runpy.run_module("trainer", run_name="__main__", alter_sys=True)


def _is_checkpoint_group(record: dict[str, Any]) -> bool:
    desc = record.get("desc") or ""
    caller = record.get("caller") or ""
    return (record.get("kind") in ("new_group", "new_subgroups")
            and (desc.startswith(CKPT_GROUP_DESC_PREFIX) or caller == CKPT_PACKAGE
                 or caller.startswith(CKPT_PACKAGE + ".")))


def checkpoint_group_backends(records: Iterable[dict[str, Any]]) -> list[str | None]:
    """The backends of the groups the checkpoint store created, in creation order."""
    return [r.get("backend") for r in records if _is_checkpoint_group(r)]


def check_backends(records: Iterable[dict[str, Any]], device: str) -> dict[str, Any]:
    """``{"training_backends", "manager_backends", "backends_ok"}``: the default group on
    NCCL (``device`` "cuda") or gloo, and at least two checkpoint groups, every one gloo."""
    records = list(records)
    training = [str(r.get("backend")) for r in records if r.get("kind") == "init"]
    store = checkpoint_group_backends(records)
    want = "nccl" if device == "cuda" else "gloo"
    ok = (bool(training) and all(want in b for b in training)
          and len(store) >= 2 and all(b == "gloo" for b in store))
    return {"training_backends": sorted(set(training)),
            "manager_backends": sorted({str(b) for b in store}), "backends_ok": ok}
