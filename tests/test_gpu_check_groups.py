"""bench/gpu_check.py finds the checkpoint store's process groups wherever they are created.

The train section records each group a trainer launch creates (kind, ``group_desc``,
creating module, backend) and requires the store's groups on gloo. It used to look for the
creator ``ckpt.manager``; the groups had moved to another module, so the check failed on
every machine. Here the judging function gets the records a launch writes today, and
those of a package laid out otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def groups():
    sys.path.insert(0, str(BENCH))
    try:
        import _gpu_groups
    finally:
        sys.path.remove(str(BENCH))
    return _gpu_groups


def _launch(manager_module: str, training: str = "nccl", subgroups: bool = False,
            ckpt_backend: str = "gloo") -> list[dict]:
    """The records of a one-node trainer launch: the default group, the DeviceMesh's and
    the trainer's own gloo group, and the checkpoint manager's two groups."""
    records = [{"kind": "init", "caller": "ckpt.ranks.torchrun", "desc": None,
                "backend": training, "rank": 0},
               {"kind": "new_group", "caller": "trainer.train", "desc": None,
                "backend": "gloo", "rank": 0},
               {"kind": "new_group", "caller": "trainer.mesh", "desc": "mesh_dp",
                "backend": training, "rank": 0}]
    for desc in ("ckpt_control", "ckpt_persist"):
        records.append({"kind": "new_subgroups" if subgroups else "new_group",
                        "caller": manager_module, "desc": None if subgroups else desc,
                        "backend": ckpt_backend, "rank": 0})
    return records


@pytest.mark.parametrize("module", ["ckpt.ranks.groups", "ckpt.job.manager",
                                    "ckpt.checkpoint_managers._groups", "ckpt._src.groups"])
def test_the_managers_groups_are_found_wherever_they_are_created(groups, module):
    out = groups.check_backends(_launch(module), "cuda")
    assert out == {"training_backends": ["nccl"], "manager_backends": ["gloo"],
                   "backends_ok": True}


def test_found_by_description_from_any_creator(groups):
    records = _launch("somewhere.else")  # a creator outside ckpt, descriptions kept
    assert groups.checkpoint_group_backends(records) == ["gloo", "gloo"]


def test_subgroups_are_found_by_their_creator(groups):
    """A manager over a subgroup (each node's local tier) creates its groups with
    ``new_subgroups_by_enumeration``: no description, only the creator tells."""
    records = _launch("ckpt.ranks.groups", subgroups=True)
    assert groups.checkpoint_group_backends(records) == ["gloo", "gloo"]


def test_other_groups_are_not_the_stores(groups):
    records = _launch("trainer.checkpointing", subgroups=True)  # no desc, not ckpt's
    assert groups.checkpoint_group_backends(records) == []
    assert groups.check_backends(records, "cuda")["backends_ok"] is False
    # A module whose name only starts like the package's is not in it.
    records = _launch("ckpt_tools.groups", subgroups=True)
    assert groups.checkpoint_group_backends(records) == []


@pytest.mark.parametrize("case,device,ok", [
    (dict(), "cuda", True),
    (dict(training="gloo"), "cuda", False),          # the training group not on NCCL
    (dict(training="gloo"), "cpu", True),            # the CPU harness: gloo everywhere
    (dict(ckpt_backend="nccl"), "cuda", False),      # a store group on NCCL
])
def test_backends_verdict(groups, case, device, ok):
    assert groups.check_backends(_launch("ckpt.ranks.groups", **case), device)[
        "backends_ok"] is ok


def test_the_creator_is_the_first_caller_outside_torch(groups):
    """The recorder names the module that called into torch, skipping torch's own frames
    (``new_subgroups_by_enumeration`` calling ``new_group``, and the like)."""
    import types

    def module(name: str, source: str) -> types.ModuleType:
        mod = types.ModuleType(name)
        exec(compile(source, f"<{name}>", "exec"), mod.__dict__)
        return mod

    torch_side = module("torch.distributed.distributed_c10d", "def call(f):\n    return f()\n")
    ckpt_side = module("ckpt.some_module", "def call(g, f):\n    return g(f)\n")
    wrapper = lambda: groups.first_caller_outside_torch(sys._getframe(1))  # noqa: E731
    assert ckpt_side.call(torch_side.call, wrapper) == "ckpt.some_module"
