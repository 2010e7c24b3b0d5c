"""The ``ckpt`` command's outcomes: one exit status per outcome across every command, and
output that says what it found (pins, leftovers, a step that does not exist), in messages
rather than exception names, safe for a terminal.

Run in process (``ckpt.cli.main``): each subprocess start costs a Python with torch, and the
real entry point is covered by tests/ckpt/cli/test_cli.py and test_cli_errors.py.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch

import ckpt
from ckpt.cli import main as cli_main
from ckpt.root import acquire_lease, release_lease
from ckpt.root.lease import LEASE_NAME
from ckpt.storage import Storage
from tests.ckpt._helpers import flip_byte

pytestmark = pytest.mark.timeout(180)


def cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        rc = cli_main([str(a) for a in argv])
    except SystemExit as exc:  # argparse: usage errors and --help
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def _save(root: str, step: int, **kwargs) -> None:
    torch.manual_seed(step)
    ckpt.save({"model": {"w": torch.randn(8), "head": {"b": torch.randn(2)}}, "step": step},
              root, step,
              user_metadata={"loss": step / 100}, **kwargs)


def _data_file(root: str, step: int) -> str:
    d = os.path.join(root, f"step_{step:09d}")
    return os.path.join(d, sorted(n for n in os.listdir(d) if n.endswith(".bin"))[0])


@pytest.fixture
def root(tmp_path) -> str:
    url = str(tmp_path / "root")
    for step in (10, 20):
        _save(url, step)
    return url


MISSING_ROOT = [
    ["list"], ["verify"], ["verify", "--step", "1"], ["show"], ["diff", "1", "2"], ["history"],
    ["export", "--out", "{tmp}/m.pt"], ["pin", "--step", "1"], ["unpin", "--step", "1"],
    ["rollback", "--step", "1"], ["restore", "--id", "abcdef123456"], ["gc"], ["gc", "--yes"],
    ["gc", "--rolled-back", "--yes"],
]


@pytest.mark.parametrize("argv", MISSING_ROOT, ids=[" ".join(a) for a in MISSING_ROOT])
def test_a_missing_root_is_exit_2_for_every_command(tmp_path, capsys, argv):
    missing = tmp_path / "nope"
    rc, out, err = cli(capsys, argv[0], missing, *[a.format(tmp=tmp_path) for a in argv[1:]])
    assert rc == 2, (rc, out, err)
    assert err.strip() == f"ckpt {argv[0]}: checkpoint root {missing} does not exist; check " \
                          f"the path (the folder that holds the step_* folders)"
    assert out == "" and not missing.exists()


def test_verify_names_a_step_that_does_not_exist(root, capsys):
    rc, out, err = cli(capsys, "verify", root, "--step", 7)
    assert rc == 1 and err == ""
    assert out.startswith("step 7: no checkpoint at step 7 (") and "CORRUPT" not in out
    assert "step_000000007" in out and f"ckpt list {root} --all" in out


def test_list_that_finds_a_corrupt_checkpoint_exits_1(root, capsys):
    flip_byte(_data_file(root, 20), 1)
    rc, out, _ = cli(capsys, "list", root, "--check", "full")
    assert rc == 1 and out.splitlines()[2].split()[2] == "corrupt"
    rc, out, _ = cli(capsys, "list", root, "--check", "full", "--json")
    assert rc == 1 and [r["status"] for r in json.loads(out)] == ["committed", "corrupt"]
    # A flipped byte keeps every size: the size check (the default) finds nothing.
    assert cli(capsys, "list", root)[0] == 0
    assert cli(capsys, "list", root, "--check", "none")[0] == 0


def test_pins_are_visible(root, capsys):
    assert cli(capsys, "pin", root, "--step", 10)[0] == 0
    rc, out, _ = cli(capsys, "list", root)
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert rc == 0 and rows["10"].endswith("pinned") and "pinned" not in rows["20"]
    rc, out, _ = cli(capsys, "list", root, "--json")
    assert {r["step"]: r["pinned"] for r in json.loads(out)} == {10: True, 20: False}
    rc, out, _ = cli(capsys, "show", root, "--step", 10)
    assert rc == 0 and "  pinned       yes" in out
    assert "  pinned       no" in cli(capsys, "show", root)[1]
    rc, out, _ = cli(capsys, "show", root, "--step", 10, "--json")
    assert json.loads(out)["pinned"] is True


def test_list_all_shows_what_gc_would_remove(root, capsys):
    storage = Storage(root)
    life = acquire_lease(storage, ttl_seconds=30, job_name="crashed")
    try:
        life.begin(30, "abcdef123456")  # an attempt that died before its commit
    finally:
        release_lease(life)
    storage.write_bytes("step_000000030/r00000_abcdef123456_0.bin", b"x" * 100)
    storage.write_bytes("step_000000020/r00001_0123456789ab_0.bin", b"y" * 40)  # no marker
    storage.write_bytes("step_000000020/notes.txt", b"not ours: never touched")

    rc, out, _ = cli(capsys, "gc", root)
    assert rc == 0 and "step 20: would remove 1 leftover" in out and "step 30: would remove 2" \
        in out
    rc, out, _ = cli(capsys, "list", root, "--all")
    rows = [line.split(None, 7) for line in out.splitlines()[1:]]
    assert rc == 0 and [(r[0], r[2]) for r in rows] == \
        [("10", "committed"), ("20", "committed"), ("20", "leftover"), ("30", "incomplete")]
    assert "1 file(s) of aborted saves (r00001_0123456789ab_0.bin); `ckpt gc` removes them" \
        in rows[2][-1] and rows[2][3:5] == ["40", "B"]
    assert rows[3][1] == "abcdef123456" and \
        rows[3][-1].endswith("an aborted save; `ckpt gc` removes its 2 file(s)")
    rc, out, _ = cli(capsys, "list", root, "--all", "--json")
    leftover = [r for r in json.loads(out) if r["status"] == "leftover"]
    assert leftover == [{**leftover[0], "step": 20, "bytes": 40,
                         "files": ["r00001_0123456789ab_0.bin"]}]
    # While a live job holds the lease, an attempt without a manifest may be its save.
    storage.write_bytes(LEASE_NAME, json.dumps(
        {"holder": "h", "job": "train", "host": "node7", "pid": 99,
         "heartbeat_unix": time.time(), "ttl_seconds": 600}).encode())
    rc, out, _ = cli(capsys, "list", root, "--all")
    assert out.count("a save in flight") == 2 and "`ckpt gc` removes" not in out
    storage.delete(LEASE_NAME)
    assert cli(capsys, "gc", root, "--yes")[0] == 0
    rc, out, _ = cli(capsys, "list", root, "--all")
    assert [line.split()[2] for line in out.splitlines()[1:]] == ["committed", "committed"]
    assert storage.exists("step_000000020/notes.txt")


def test_expected_errors_read_as_messages(root, tmp_path, capsys):
    assert cli(capsys, "rollback", root, "--step", 10)[0] == 0
    rolled = [r["id"] for r in json.loads(cli(capsys, "list", root, "--all", "--json")[1])
              if r["status"] == "rolled-back"][0]
    assert cli(capsys, "restore", root, "--id", rolled)[0] == 0
    rc, _, err = cli(capsys, "restore", root, "--id", rolled)  # committed again already
    assert rc == 2 and err.strip() == f"ckpt restore: checkpoint id {rolled} (step 20) is " \
                                      f"already committed; nothing to restore"
    rc, _, err = cli(capsys, "export", root, "--select", "modl.", "--out", tmp_path / "m.pt")
    assert rc == 2 and err.startswith("ckpt export: --select 'modl.' matches no key")
    assert "Error" not in err and "--debug" not in err and not (tmp_path / "m.pt").exists()
    rc, _, err = cli(capsys, "export", root, "--dtype", "float7", "--out", tmp_path / "m.pt")
    assert rc == 2 and "Error" not in err and "float7" in err
    rc, _, err = cli(capsys, "gc", root, "--rolled-back", "--older-than", "7x")
    assert rc == 2 and "Error" not in err and "invalid duration '7x'" in err
    rc, _, err = cli(capsys, "pin", root, "--step", "-1")
    assert rc == 2 and "Error" not in err and "invalid step '-1'" in err
    (tmp_path / "hf" / "x").mkdir(parents=True)
    rc, _, err = cli(capsys, "export", root, "--format", "hf", "--out", tmp_path / "hf")
    assert rc == 2 and "Error" not in err and "is a folder that is not empty" in err


def test_show_tensors_escapes_control_characters(tmp_path, capsys):
    url = str(tmp_path / "root")
    ckpt.save({"m": {"a\x1b[31mred": torch.ones(2), "line\nbreak": torch.zeros(3)},
               "bell\x07": 1}, url, 1, user_metadata={"note\x1b": "v"})
    for argv in (["show", url, "--tensors"], ["diff", url, "1", "1", "--all"]):
        rc, out, _ = cli(capsys, *argv)
        assert rc == 0, out
        assert "\x1b" not in out and "\x07" not in out, out
        assert "a\\x1b[31mred" in out and "line\\x0abreak" in out
    rc, out, _ = cli(capsys, "show", url, "--tensors")
    assert len([ln for ln in out.splitlines() if "break" in ln]) == 1  # one row, one line
    assert "note\\x1b=" in out


def test_plan_sizes_need_a_unit(capsys):
    rc, _, err = cli(capsys, "plan", "--size", "14", "--bandwidth", "1GB/s")
    assert rc == 2 and "--size" in err and "'14' has no unit: write e.g. 14GB" in err
    rc, _, err = cli(capsys, "plan", "--size", "14GB", "--bandwidth", "2")
    assert rc == 2 and "--bandwidth" in err and "no unit" in err
    rc, out, _ = cli(capsys, "plan", "--size", "14B", "--bandwidth", "1GB/s")
    assert rc == 0 and "14 B" in out


def test_help_texts_summaries_and_the_writers_name(root, tmp_path, capsys, monkeypatch):
    for command in ("verify", "pin", "unpin", "rollback"):
        rc, out, _ = cli(capsys, command, "--help")
        line = next(ln for ln in out.splitlines() if ln.strip().startswith("--step"))
        assert rc == 0 and len(line.split()) > 2, (command, line)  # the option has a help text
    rc, out, _ = cli(capsys, "export", root, "--out", tmp_path / "m.safetensors")
    size = os.path.getsize(tmp_path / "m.safetensors")
    assert rc == 0 and out.strip().startswith("exported step 20: 2 tensors, ")
    assert f"{size} B written to {tmp_path / 'm.safetensors'}" in out
    rc, out, _ = cli(capsys, "export", root, "--select", "model.head.", "--format", "hf",
                     "--no-config", "--out", tmp_path / "hf")
    assert rc == 0 and "exported step 20: 1 of 2 tensors, " in out
    # A library save names its program as the writer, not "job".
    monkeypatch.setattr(sys, "argv", ["/somewhere/train_tiny.py", "--lr", "3"])
    _save(root, 30)
    rc, out, _ = cli(capsys, "show", root, "--step", 30)
    assert "  writer       job 'train_tiny.py' (owner " in out
