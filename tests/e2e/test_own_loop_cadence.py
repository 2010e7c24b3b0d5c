"""The README's own loop, run as written, extended: the cadence continues from the step it
resumed at (saves at 10, 20, 30, then 40 and the final 45, not 31, 41, ...), and every save,
the final one too, carries the loss that `ckpt list` shows."""

from __future__ import annotations

import json

import pytest

from ckpt.cli import main as cli_main
from ckpt.root import CheckpointStore
from tests.e2e.test_own_loop import _torchrun

pytestmark = pytest.mark.timeout(300)


def _listing(capsys, root) -> dict[int, dict]:
    capsys.readouterr()
    assert cli_main(["list", str(root), "--json"]) == 0
    return {row["step"]: row for row in json.loads(capsys.readouterr().out)}


def test_resumed_run_saves_on_the_interval_from_its_resume_step(tmp_path, capsys):
    root = tmp_path / "ckpt"
    _torchrun(root, 30)
    first = _listing(capsys, root)
    assert sorted(first) == [10, 20, 30]
    _torchrun(root, 45)                  # the same program, cadence "10", to 45
    second = _listing(capsys, root)
    # The manager keeps the last 3: any save off the 10-step grid (31, 41, 35, ...) would
    # be among them.
    assert sorted(second) == [30, 40, 45]
    assert second[30]["id"] == first[30]["id"]   # step 30 was not written again
    assert all(r["status"] == "committed" for r in second.values())
    for step, row in second.items():
        loss = row["user_metadata"].get("loss")
        assert isinstance(loss, float) and loss > 0, (step, row["user_metadata"])
    manifest = CheckpointStore(str(root)).read_manifest(45)
    assert manifest.world_size == 2
    capsys.readouterr()
    assert cli_main(["list", str(root)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[-1].split()[0] == "45" and table[-1].split()[7] != "-"  # its LOSS
