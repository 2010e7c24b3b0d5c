"""The ``ckpt`` command line.

Each command runs at least once as a real subprocess (``python -m ckpt ...``: the entry
point, argument parsing and exit status); independent invocations run concurrently. Each
start costs a Python with torch (~3 s of CPU), so edge cases call ``ckpt.cli.main`` in
process instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import ckpt
from ckpt.cli import main as cli_main
from ckpt.root.lease import LEASE_NAME
from tests.ckpt._helpers import assert_same, flip_byte, snapshot

pytestmark = pytest.mark.timeout(180)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
STEPS = (10, 20, 30)


def run_cli(*argv_list: list[str]) -> list[subprocess.CompletedProcess]:
    """Run several ``python -m ckpt ARGV`` at once; results in the same order."""
    env = {**os.environ, "PYTHONPATH": REPO}
    procs = [subprocess.Popen([sys.executable, "-m", "ckpt", *map(str, argv)], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for argv in argv_list]
    out = []
    for argv, p in zip(argv_list, procs):
        try:
            stdout, stderr = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise AssertionError(f"ckpt {argv} did not finish within 120s")
        out.append(subprocess.CompletedProcess(argv, p.returncode, stdout, stderr))
    return out


def cli(capsys, *argv) -> tuple[int, str, str]:
    """``ckpt ARGV`` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    try:
        rc = cli_main([str(a) for a in argv])
    except SystemExit as exc:  # argparse errors
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def _state(step: int) -> dict:
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 3)
    return {"model": model.state_dict(), "step": step,
            "extra": {"ids": [1, 2], "name": "run-a", "pair": (0.5, "x"), "raw": b"\x00\x01"},
            "hist": [torch.arange(3), torch.ones(2, dtype=torch.bfloat16)]}


@pytest.fixture
def root(tmp_path) -> tuple[str, dict]:
    url = str(tmp_path / "root")
    expected = {}
    for step in STEPS:
        state = _state(step)
        ckpt.save(state, url, step, user_metadata={"loss": step / 100})
        expected[step] = snapshot(state)
    return url, expected


def _data_file(url: str, step: int) -> str:
    d = os.path.join(url, f"step_{step:09d}")
    return os.path.join(d, sorted(n for n in os.listdir(d) if n.endswith(".bin"))[0])


def test_list_verify_export(root, tmp_path, capsys):
    url, expected = root
    pt, st, latest = (str(tmp_path / n) for n in ("s20.pt", "s20.safetensors", "latest.pth"))
    t0 = time.time()
    js, verify_one, ex_pt = run_cli(
        ["list", url, "--json"], ["verify", url, "--step", 20, "--progress"],
        ["export", url, "--step", 20, "--out", pt])
    for r in (js, verify_one, ex_pt):
        assert r.returncode == 0, (r.args, r.stdout, r.stderr)
    rc, table, _ = cli(capsys, "list", url)
    assert rc == 0
    rc, verify_all, _ = cli(capsys, "verify", url)
    assert rc == 0
    assert cli(capsys, "export", url, "--step", 20, "--out", st)[0] == 0
    assert cli(capsys, "export", url, "--out", latest)[0] == 0

    lines = table.splitlines()
    assert lines[0].split() == ["STEP", "ID", "STATUS", "SIZE", "CREATED", "LOSS", "NOTE"]
    assert [ln.split()[:3:2] for ln in lines[1:]] == [[str(s), "committed"] for s in STEPS]
    assert all(len(ln.split()[1]) == 12 for ln in lines[1:])  # every row has its id
    assert "0.2" in lines[2]  # the loss from user_metadata

    items = json.loads(js.stdout)
    assert [(i["step"], i["status"]) for i in items] == [(s, "committed") for s in STEPS]
    for i in items:
        assert i["bytes"] > 0 and abs(i["created"] - t0) < 300
        assert i["user_metadata"] == {"loss": i["step"] / 100}

    assert [ln.split(":")[0] for ln in verify_all.splitlines()] == [f"step {s}" for s in STEPS]
    assert all(": ok (" in ln for ln in verify_all.splitlines())
    assert verify_one.stdout.splitlines() == [verify_one.stdout.splitlines()[0]]
    assert verify_one.stdout.startswith("step 20: ok")
    assert "step 20 [" in verify_one.stderr and "100.0%" in verify_one.stderr
    assert "#" * 30 in verify_one.stderr

    # .pt: a plain nested state, loadable without unpickling arbitrary objects.
    assert "exported step 20" in ex_pt.stdout
    loaded = torch.load(pt, weights_only=True)
    assert_same(expected[20], loaded)
    assert_same(expected[30], torch.load(latest, weights_only=True))
    # .safetensors: flat keys; non-tensor values in the header, exactly recoverable.
    from safetensors import safe_open

    from ckpt.format import decode_object

    with safe_open(st, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    assert_same({"model.weight": expected[20]["model"]["weight"],
                 "model.bias": expected[20]["model"]["bias"],
                 "hist.0": expected[20]["hist"][0], "hist.1": expected[20]["hist"][1]}, tensors)
    assert meta["ckpt_step"] == "20"
    objects = {k: decode_object(json.dumps(v).encode())
               for k, v in json.loads(meta["ckpt_objects"]).items()}
    assert objects["step"] == 20 and objects["extra.pair"] == (0.5, "x")
    assert objects["extra.raw"] == b"\x00\x01" and objects["extra.ids"] == [1, 2]
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_verify_names_the_corrupt_file(root, capsys):
    url, _ = root
    bad = _data_file(url, 20)
    flip_byte(bad, 3)
    all_, = run_cli(["verify", url])
    assert all_.returncode == 1
    out = all_.stdout.splitlines()
    assert out[0].startswith("step 10: ok") and out[2].startswith("step 30: ok")
    assert out[1].startswith("step 20: CORRUPT") and os.path.basename(bad) in out[1]
    assert "checksum mismatch" in out[1]
    rc, one_ok, _ = cli(capsys, "verify", url, "--step", 10)
    assert rc == 0 and one_ok.startswith("step 10: ok")
    assert cli(capsys, "verify", url, "--size-only")[0] == 0  # a flipped byte keeps the size
    rc, listing, _ = cli(capsys, "list", url, "--json", "--check", "full")
    items = {i["step"]: i for i in json.loads(listing)}
    assert items[20]["status"] == "corrupt" and os.path.basename(bad) in items[20]["problem"]
    assert items[10]["status"] == items[30]["status"] == "committed"
    # Truncation is caught by sizes alone, and a missing step is exit 1 too.
    with open(bad, "r+b") as f:
        f.truncate(5)
    rc, out, _ = cli(capsys, "verify", url, "--size-only", "--step", 20)
    assert rc == 1 and "5 bytes" in out
    rc, out, err = cli(capsys, "verify", url, "--step", 99)
    assert rc == 1 and "step_000000099" in out + err


def test_pin_and_unpin(root, capsys):
    url, _ = root
    pin10, = run_cli(["pin", url, "--step", 10])
    assert pin10.returncode == 0 and "pinned steps: [10]" in pin10.stdout
    with open(os.path.join(url, "pins.json")) as f:
        assert json.load(f) == {"pinned": [10]}
    rc, _, err = cli(capsys, "pin", url, "--step", 99)
    assert rc == 1 and "step_000000099" in err
    rc, _, err = cli(capsys, "pin", url)
    assert rc == 2 and "--step" in err
    rc, out, _ = cli(capsys, "pin", url, "--step", 30)
    assert "pinned steps: [10, 30]" in out
    rc, out, _ = cli(capsys, "unpin", url, "--step", 10)
    assert rc == 0 and "pinned steps: [30]" in out
    with open(os.path.join(url, "pins.json"), "w") as f:
        f.write("[oops")
    rc, _, err = cli(capsys, "pin", url, "--step", 10)
    assert rc == 2 and "damaged" in err  # never overwrites the pins it cannot read
    with open(os.path.join(url, "pins.json"), "w") as f:
        json.dump({"pinned": [30]}, f)
    from ckpt.job import KeepLast, KeepPinned
    from ckpt.job.retention import apply_retention

    store = ckpt.CheckpointStore(url)
    assert apply_retention(store, [KeepLast(1), KeepPinned(store)]) == [10, 20]


def test_rollback_uncommits_newer_and_deletes_nothing(root, capsys):
    url, expected = root
    before = {s: sorted(os.listdir(os.path.join(url, f"step_{s:09d}"))) for s in STEPS}
    # Refused while a live job holds the write lease.
    with open(os.path.join(url, LEASE_NAME), "w") as f:
        json.dump({"holder": "h", "job": "train", "host": "node7", "pid": 99,
                   "heartbeat_unix": time.time(), "ttl_seconds": 600}, f)
    rc, _, err = cli(capsys, "rollback", url, "--step", 10)
    assert rc == 2 and "node7" in err and "--force" in err
    assert cli(capsys, "rollback", url, "--step", 15, "--force")[0] == 1  # no such step
    assert ckpt.CheckpointStore(url).committed_steps() == list(STEPS)
    os.unlink(os.path.join(url, LEASE_NAME))

    rb, = run_cli(["rollback", url, "--step", 10])
    assert rb.returncode == 0, rb.stderr
    assert "step 30: rolled back (id " in rb.stdout and "step 20: rolled back" in rb.stdout
    listing, = run_cli(["list", url, "--json"])
    assert [(i["step"], i["status"]) for i in json.loads(listing.stdout)] == \
        [(10, "committed"), (20, "rolled-back"), (30, "rolled-back")]
    assert "rolled-back" in cli(capsys, "list", url)[1]
    # Nothing deleted: every data file is still there, the manifest only renamed.
    for s in STEPS:
        now = sorted(os.listdir(os.path.join(url, f"step_{s:09d}")))
        if s == 10:
            assert now == before[s]
        else:
            kept = [n for n in now if n.startswith("rolled-back-")]
            assert len(kept) == 1 and now == sorted(n if n != "manifest.json" else kept[0]
                                                    for n in before[s])
    # A resumed job starts from step 10.
    state = _state(0)
    assert ckpt.load_latest(state, url).step == 10
    assert_same(expected[10], snapshot(state))


def test_bad_usage_and_empty_root(tmp_path, capsys):
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    rc, _, err = cli(capsys, "export", empty, "--out", tmp_path / "x.txt")
    assert rc == 2 and ".safetensors" in err
    rc, _, err = cli(capsys, "verify", empty)
    assert rc == 1 and "no committed checkpoints" in err
    rc, out, _ = cli(capsys, "list", empty)
    assert rc == 0 and "no checkpoints" in out
    rc, _, err = cli(capsys, "export", empty, "--out", tmp_path / "x.pt")
    assert rc == 1 and "no committed checkpoint" in err
