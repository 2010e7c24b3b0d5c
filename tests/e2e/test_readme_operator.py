"""The README's operator block runs, as written, against the checkpoints the demo leaves.

The demo (scripts/demo.sh) trains ``configs/tiny.toml`` for ``STEPS`` steps, saving every
``--checkpoint.interval`` steps, killed once and resumed; its retention keeps the config's
``keep_last`` newest. The same run without the kill (one process) leaves the same steps, so
every command of the block runs here on such a root (paths into a temporary folder; the
placeholder ``--id ID`` skipped): each exits 0 (``ckpt diff`` 1: different), so none names
a step the demo's retention deleted. The batch is made smaller than the demo's: which steps
are saved and kept does not depend on it.
"""

from __future__ import annotations

import re
import shlex

import pytest

from ckpt.cli import main as ckpt_main
from ckpt.root import CheckpointStore
from tests.e2e._jobs import ROOT, Job, trainer_argv
from trainer.__main__ import main as trainer_main

pytestmark = pytest.mark.timeout(300)


def _demo_args() -> list[str]:
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    steps = re.search(r"STEPS=\$\{STEPS:-(\d+)\}", demo).group(1)
    interval = re.search(r"--checkpoint\.interval=(\d+)", demo).group(1)
    return [f"--training.steps={steps}", f"--checkpoint.interval={interval}"]


def _operator_block() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## The operator's view\n.*?```bash\n(.*?)```", readme, re.S).group(1)
    return [line.split("  #")[0].split(" # ")[0].strip() for line in block.splitlines()
            if line.strip() and not line.startswith("#")]


def test_the_operator_block_runs_on_what_the_demo_leaves(tmp_path, monkeypatch, capsys):
    root = tmp_path / "runs" / "demo" / "ckpt"
    Job(trainer_argv(*_demo_args(), f"--checkpoint.root={root}",
                     "--training.global_batch_size=2", "--training.seq_len=8"),
        tmp_path, "demo").wait_ok(timeout=240)
    committed = CheckpointStore(str(root)).committed_steps()
    monkeypatch.chdir(tmp_path)
    ran = 0
    for line in _operator_block():
        argv = shlex.split(line)
        if "ID" in argv:
            continue  # `ckpt restore --id ID`: an id from `ckpt list --all`
        if argv[0] == "ckpt":
            code = ckpt_main(argv[1:])
        else:
            assert argv[:3] == ["python", "-m", "trainer"], f"unexpected command {line!r}"
            code = trainer_main(argv[3:])
        out, err = capsys.readouterr()
        ok = (0, 1) if argv[1:2] == ["diff"] else (0,)
        assert code in ok, f"{line!r} (steps after the demo: {committed}): exit {code}\n" \
            f"{out[-1500:]}{err[-1500:]}"
        ran += 1
    assert ran >= 12
