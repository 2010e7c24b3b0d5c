"""``python -m trainer`` bad input: one line on stderr, exit status 2, no traceback.

A table of bad invocations, each run as the real command in a subprocess, that fail before
anything is built (so stderr holds exactly the one line): it names the file or key at fault
and the fix. Rows marked for --debug run again with it: the same status, a traceback, the
same last line. One more row injects an unforeseen exception into start-up (a wrapper that
replaces ``Trainer.__init__``): the catch-all reports it as one line with its type, exit 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import ckpt
from tests.e2e._jobs import ROOT, TINY, base_env
from trainer.distributed import EXIT_CONFIG, EXIT_FAILED

pytestmark = pytest.mark.timeout(600)

TRACEBACK = "Traceback (most recent call last)"
# Replaces Trainer.__init__ with one that raises, then runs the trainer's own entry point.
INJECT = ("import sys, trainer.train as t\n"
          "def boom(self, *a, **k):\n"
          "    raise RuntimeError('injected start-up fault')\n"
          "t.Trainer.__init__ = boom\n"
          "from trainer.__main__ import main\n"
          "sys.exit(main())\n")

# (id, arguments, exit status, words the line must contain, also run with --debug)
# {root} holds one committed checkpoint (step 10); {file} is a plain file; {tmp} a folder;
# {deep} a TOML file nested past the reader's recursion limit; {latin1} not UTF-8.
CASES = [
    ("load-step-missing", ["--checkpoint.root={root}", "--checkpoint.load_step=999"],
     EXIT_CONFIG, ["checkpoint.load_step=999", "step_000000999", "committed steps: 10",
                   "leave checkpoint.load_step unset"], True),
    ("load-step-on-empty-root", ["--checkpoint.root={tmp}", "--checkpoint.load_step=5"],
     EXIT_CONFIG, ["checkpoint.load_step=5", "holds no committed checkpoint"], False),
    ("root-is-a-file", ["--checkpoint.root={file}"],
     EXIT_CONFIG, ["checkpoint.root: {file} is a file, not a folder", "--checkpoint.root"],
     False),
    ("root-below-a-file", ["--checkpoint.root={file}/run1"],
     EXIT_CONFIG, ["checkpoint.root: {file} is a file"], False),
    ("config-is-a-folder", ["--config", "{tmp}"],
     EXIT_CONFIG, ["--config {tmp} is a folder", "TOML file"], False),
    ("config-nested-too-deeply", ["--config", "{deep}"],
     EXIT_CONFIG, ["{deep}: invalid TOML", "nested too deeply", "flatten"], True),
    ("config-not-utf8", ["--config", "{latin1}"], EXIT_CONFIG, ["{latin1}: not UTF-8"], False),
    ("config-missing", ["--config", "{tmp}/nope.toml"],
     EXIT_CONFIG, ["config file not found: {tmp}/nope.toml"], False),
    ("plan-usage", ["plan", "--params", "7B", "--nodes", "x"],
     2, ["python -m trainer plan: argument --nodes", "'x'", "--help"], False),
    ("unforeseen-error", ["-c", INJECT, "--checkpoint.root={tmp}"],
     EXIT_FAILED, ["training failed: RuntimeError: injected start-up fault",
                   "run with --debug for the traceback"], True),
]


def _command(args: list[str]) -> list[str]:
    if args[0] == "-c":  # the fault-injecting wrapper, then the trainer's arguments
        return [sys.executable, "-c", args[1], "--config", str(TINY), *args[2:]]
    if args[0] in ("plan", "--config"):
        return [sys.executable, "-m", "trainer", *args]
    return [sys.executable, "-m", "trainer", "--config", str(TINY), *args]


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, env=base_env(), capture_output=True, text=True,
                          timeout=180)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("trainer-errors")
    paths = {"root": str(base / "root"), "file": str(base / "a-file"), "tmp": str(base / "empty"),
             "deep": str(base / "deep.toml"), "latin1": str(base / "latin1.toml")}
    os.makedirs(paths["tmp"])
    with open(paths["file"], "w") as f:
        f.write("not a folder\n")
    with open(paths["deep"], "w") as f:
        f.write("[training]\nbetas = " + "[" * 50_000 + "]" * 50_000 + "\n")
    with open(paths["latin1"], "wb") as f:
        f.write("[training]\n# d\u00e9j\u00e0 vu\nsteps = 5\n".encode("latin-1"))
    ckpt.save({"w": torch.zeros(2)}, paths["root"], 10)
    commands = {}
    for name, args, _, _, debug in CASES:
        args = [a if a == INJECT else a.format(**paths) for a in args]
        commands[name] = _command(args)
        if debug:
            commands[name + "+debug"] = [*_command(args), "--debug"]
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {k: pool.submit(_run, argv) for k, argv in commands.items()}
        return paths, {k: f.result() for k, f in futures.items()}


@pytest.mark.parametrize("name, args, status, words, debug", CASES, ids=[c[0] for c in CASES])
def test_one_line_error(results, name, args, status, words, debug):
    paths, out = results
    r = out[name]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == status, (r.returncode, r.stderr[-3000:])
    assert len(lines) == 1 and TRACEBACK not in r.stderr, r.stderr[-3000:]
    for word in words:
        assert word.format(**paths) in lines[0], (word, lines[0])
    if debug:
        d = out[name + "+debug"]
        assert d.returncode == status, d.stderr[-3000:]
        assert TRACEBACK in d.stderr, d.stderr[-3000:]
        last = d.stderr.splitlines()[-1]
        # The same line (the trainer's log lines carry a time stamp: compare what follows).
        assert last.split("] ", 1)[-1] == lines[0].split("] ", 1)[-1], (last, lines[0])


def test_nothing_was_created_or_changed(results):
    paths, _ = results
    # No new step, nothing un-committed (the lease's own control files may be there).
    assert sorted(n for n in os.listdir(paths["root"]) if not n.startswith("_")) == \
        ["step_000000010"]
    assert "manifest.json" in os.listdir(os.path.join(paths["root"], "step_000000010"))
    assert os.listdir(paths["tmp"]) == []
    assert os.path.isfile(paths["file"])


def test_help_has_no_rst_markup():
    import argparse

    import trainer.__main__ as entry
    from trainer.layout_plan import add_layout_plan_arguments

    assert "``" not in entry.__doc__ and "--debug" in entry.__doc__
    parser = argparse.ArgumentParser(prog="python -m trainer plan")
    add_layout_plan_arguments(parser)
    assert "``" not in parser.format_help()
