"""Every ``ckpt`` failure is one line on stderr, an exit status, and no traceback.

A table of bad invocations, each run as the real command (``python -m ckpt.cli ...``) in a
subprocess: the exit status (1 a corrupt or missing checkpoint, 2 bad usage or input), exactly
one non-empty stderr line, the words that name the problem and its fix, and no "Traceback".
Rows marked for --debug run a second time with it: the same status, a traceback, and the same
last line. The commands of the table run concurrently (each start costs ~2 s of CPU); edge
cases beyond the table call ``ckpt.cli.main`` in process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import ckpt
from tests.ckpt._helpers import flip_byte

pytestmark = pytest.mark.timeout(600)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TRACEBACK = "Traceback (most recent call last)"


def ckpt_cli(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m ckpt.cli ARGV`` as a user runs it."""
    env = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
    return subprocess.run([sys.executable, "-m", "ckpt.cli", *map(str, argv)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)


def run_all(commands: dict) -> dict:
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {key: pool.submit(ckpt_cli, argv) for key, argv in commands.items()}
        return {key: f.result() for key, f in futures.items()}


def _save(root: str, step: int) -> None:
    torch.manual_seed(step)
    ckpt.save({"w": torch.randn(64), "step": step}, root, step)


def _step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:09d}")


def _data_file(root: str, step: int) -> str:
    d = _step_dir(root, step)
    return os.path.join(d, sorted(n for n in os.listdir(d) if n.endswith(".bin"))[0])


def _set_created(root: str, step: int, raw_number: str) -> None:
    """Write ``raw_number`` (JSON text, e.g. NaN) as the manifest's created_unix."""
    import hashlib

    from ckpt.format._check import manifest_bytes

    path = os.path.join(_step_dir(root, step), "manifest.json")
    with open(path, "rb") as f:
        doc = json.loads(f.read())
    doc["created_unix"] = "@CREATED@"
    first, rest = manifest_bytes(doc).split(b"\n", 1)
    rest = rest.replace(b'"@CREATED@"', raw_number.encode())  # sealed with a valid digest
    with open(path, "wb") as f:
        f.write(b'{"manifest_sha256": "' + hashlib.sha256(rest).hexdigest().encode() + b'",\n'
                + rest)


# (id, argv, exit status, words stderr must contain, also run with --debug)
# In argv: {root} one sound (step 10) and one damaged (step 20) checkpoint; {file} a plain
# file; {tmp} an empty folder; {lease_root}/{pins_root} roots with a damaged _lease.json or
# pins.json.
CASES = [
    ("export-out-folder-missing", ["export", "{root}", "--step", "10", "--out", "{tmp}/nope/m.pt"],
     2, ["ckpt export: output folder", "{tmp}/nope does not exist", "create it", "--out"], True),
    ("export-out-folder-is-a-file", ["export", "{root}", "--out", "{file}/m.pt"],
     2, ["{file} is a file", "--out"], False),
    ("export-out-is-a-folder", ["export", "{root}", "--out", "{tmp}"],
     2, ["--out {tmp} is a folder", "model.safetensors"], False),
    ("list-root-missing", ["list", "{tmp}/missing"],
     2, ["ckpt list: checkpoint root {tmp}/missing does not exist", "check the path"], False),
    ("list-root-is-a-file", ["list", "{file}"], 2, ["{file} is a file, not a folder"], False),
    ("plan-size-overflows", ["plan", "--size", "1e400GB", "--bandwidth", "1GB/s"],
     2, ["--size", "'1e400GB'", "too large", "ckpt plan --help"], False),
    ("plan-usage", ["plan", "--bandwidth", "1GB/s"], 2, ["--size", "required"], False),
    ("pin-damaged-refused", ["pin", "{root}", "--step", "20"],
     1, ["refusing to pin step 20", "checksum mismatch", ".bin", "--force"], False),
    # A pins.json nested past any JSON reader's recursion limit: a named, one-line error.
    ("pins-nested", ["pin", "{pins_root}", "--step", "10"],
     2, ["pins.json is damaged", "delete it"], True),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("cli-errors")
    paths = {"root": str(base / "root"), "file": str(base / "a-file"), "tmp": str(base / "empty"),
             "lease_root": str(base / "lease-root"), "pins_root": str(base / "pins-root")}
    os.makedirs(paths["tmp"])
    with open(paths["file"], "w") as f:
        f.write("not a checkpoint root\n")
    for step in (10, 20):
        _save(paths["root"], step)
    flip_byte(_data_file(paths["root"], 20), 7)
    for name in ("lease_root", "pins_root"):
        _save(paths[name], 10)
    with open(os.path.join(paths["lease_root"], "_lease.json"), "w") as f:
        f.write('{"heartbeat_unix": 1' + "0" * 400 + ', "ttl_seconds": 60}')  # not a float
    with open(os.path.join(paths["pins_root"], "pins.json"), "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)
    commands = {}
    for name, argv, _, _, debug in CASES:
        argv = [a.format(**paths) for a in argv]
        commands[name] = argv
        if debug:
            commands[name + "+debug"] = ["--debug", *argv]
    commands["rollback-damaged-lease"] = ["rollback", paths["lease_root"], "--step", "10"]
    return paths, run_all(commands)


def test_damaged_lease_is_taken_over_with_a_warning(results):
    """A lease file nobody can read is held by nobody (its holder's next compare-and-swap
    fails, so it stops writing): a writer takes it over and says so; no traceback."""
    paths, out = results
    r = out["rollback-damaged-lease"]
    assert r.returncode == 0, r.stderr
    assert "_lease.json is damaged" in r.stderr and TRACEBACK not in r.stderr, r.stderr


@pytest.mark.parametrize("name, argv, status, words, debug", CASES, ids=[c[0] for c in CASES])
def test_one_line_error(results, name, argv, status, words, debug):
    paths, out = results
    r = out[name]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == status, (r.returncode, r.stderr)
    assert len(lines) == 1 and TRACEBACK not in r.stderr, r.stderr
    for word in words:
        assert word.format(**paths) in lines[0], (word, lines[0])
    if debug:
        d = out[name + "+debug"]
        assert d.returncode == status, d.stderr
        assert TRACEBACK in d.stderr, d.stderr
        assert d.stderr.splitlines()[-1] == lines[0]


def _in_process(capsys, *argv) -> tuple[int, str, str]:
    """``ckpt ARGV`` in this process (edge cases; the table above runs the real command)."""
    from ckpt.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_damaged_checkpoint_is_not_pinned_unless_forced(results, capsys):
    root = results[0]["root"]
    # The refused pin wrote nothing; --force pins it anyway, and unpin needs no verification.
    assert not os.path.exists(os.path.join(root, "pins.json"))
    assert _in_process(capsys, "pin", root, "--step", 20, "--force")[:2] == \
        (0, "pinned steps: [20]\n")
    assert _in_process(capsys, "pin", root, "--step", 10)[:2] == (0, "pinned steps: [10, 20]\n")
    assert _in_process(capsys, "unpin", root, "--step", 20)[:2] == (0, "pinned steps: [10]\n")
    rc, _, err = _in_process(capsys, "pin", root, "--step", 20)  # still damaged
    assert rc == 1 and "refusing to pin step 20" in err


def test_list_survives_damaged_timestamps(tmp_path, capsys):
    root = str(tmp_path / "root")
    numbers = {10: "NaN", 20: "Infinity", 30: "1e300", 40: "-1e300", 50: "1" + "0" * 400}
    for step, number in [*numbers.items(), (60, None)]:
        _save(root, step)
        if number:
            _set_created(root, step, number)
    table = ckpt_cli(["list", root])  # exit 1: it lists corrupt checkpoints
    assert table.returncode == 1 and table.stderr == "", table.stderr
    rows = {int(ln.split()[0]): ln for ln in table.stdout.splitlines()[1:]}
    assert sorted(rows) == [10, 20, 30, 40, 50, 60]
    for step in (30, 40):  # finite but absurd: listed, the time shown as invalid
        assert rows[step].split()[2:3] == ["committed"] and "invalid" in rows[step], rows[step]
    # NaN and Infinity are not JSON, and a 401-digit integer is beyond the reader's limit:
    # each is a damaged manifest, listed as corrupt with the reason, and the listing goes on.
    for step, why in ((10, "NaN"), (20, "Infinity"), (50, "digits")):
        assert rows[step].split()[2] == "corrupt" and why in rows[step], rows[step]
    assert rows[60].split()[2] == "committed" and "invalid" not in rows[60]

    def no_constants(name):
        raise AssertionError(f"--json printed {name}, which is not JSON")

    rc, listing, err = _in_process(capsys, "list", root, "--json")
    assert rc == 1 and err == "", err
    items = {i["step"]: i for i in json.loads(listing, parse_constant=no_constants)}
    assert items[10]["status"] == items[20]["status"] == items[50]["status"] == "corrupt"
    assert items[30]["created"] == 1e300 and items[60]["status"] == "committed"


def test_missing_root_is_an_error_and_an_empty_one_is_not(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = _in_process(capsys, "list", tmp_path / "nope")
    assert rc == 2 and f"{tmp_path / 'nope'} does not exist" in err
    assert _in_process(capsys, "list", empty) == (0, f"no checkpoints under {empty}\n", "")
    assert not (tmp_path / "nope").exists()  # looking did not create it


def test_s3_missing_bucket_is_an_error_and_an_empty_prefix_is_not(s3_server, s3_root, capsys):
    endpoint = ["--endpoint-url", s3_server.endpoint_url]
    missing = ckpt_cli(["list", "s3://no-such-bucket-here/run1", *endpoint])
    lines = [ln for ln in missing.stderr.splitlines() if ln.strip()]
    assert missing.returncode == 2 and len(lines) == 1, missing.stderr
    assert "bucket 'no-such-bucket-here' does not exist" in lines[0]
    assert _in_process(capsys, "list", s3_root.url, *endpoint) == \
        (0, f"no checkpoints under {s3_root.url}\n", "")


def test_help_has_no_rst_markup(capsys):
    from ckpt.cli import main

    helps = {}
    for name in ("", "list", "verify", "export", "pin", "unpin", "rollback", "plan"):
        with pytest.raises(SystemExit) as exc:
            main([*([name] if name else []), "--help"])
        helps[name] = capsys.readouterr().out
        assert exc.value.code == 0 and helps[name]
        assert "``" not in helps[name] and ":func:" not in helps[name], (name, helps[name])
    assert "--debug" in helps[""] and "--debug" in helps["list"] and "--force" in helps["pin"]
