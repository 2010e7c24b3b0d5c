"""``ckpt show``, ``ckpt diff``, ``ckpt history`` and the ``ckpt list`` table on a terminal.

One root holds step 1 (one process: one chunk per tensor) and step 2 (saved by 2 gloo
ranks: every tensor in two row shards), so ``diff`` meets both of its paths: same chunking
(compared chunk by chunk) and different chunking (assembled whole, up to a limit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import ckpt
from ckpt.cadence import HISTORY_NAME
from ckpt.cli import main as cli_main
from ckpt.cli._common import format_table
from tests.ckpt._helpers import flip_byte
from tests.dist import run_ranks

pytestmark = pytest.mark.timeout(180)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _values() -> dict:
    torch.manual_seed(0)
    return {"w": torch.randn(8, 6), "v": torch.randn(8, 4), "big": torch.randn(16, 8),
            "i": torch.arange(8, dtype=torch.int64).reshape(8, 1)}


def _state(step: int) -> dict:
    vals = _values()
    if step >= 3:
        vals["v"][5, 3] += 0.25
    return {**vals, "trainer": {"fingerprint": "fp-0123", "step": step}}


def _sharded_save(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    vals = _values()
    vals["v"][5, 3] += 0.25
    state = {k: distribute_tensor(t, mesh, [Shard(0)]) for k, t in vals.items()}
    state["trainer"] = {"fingerprint": "fp-0123", "step": 2}
    ckpt.save(state, root, 2, user_metadata={"loss": 0.5})


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("inspect") / "root")
    ckpt.save(_state(1), url, 1, user_metadata={"loss": 1.5, "note": "first"})
    run_ranks(_sharded_save, 2, url, timeout=150)
    ckpt.save(_state(3), url, 3)                  # like 2 in values, chunked like 1
    ckpt.save(_state(4), url, 4)                  # same as 3 but for trainer.step
    return url


def cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        rc = cli_main([str(a) for a in argv])
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_show_text_json_and_by_id(root, capsys):
    rc, out, err = cli(capsys, "show", root, "--step", 2)
    assert rc == 0, err
    assert out.startswith("step 2  id ") and "committed" in out.splitlines()[0]
    assert "(world size 2)" in out and "fingerprint  fp-0123" in out
    rc, js, _ = cli(capsys, "show", root, "--step", 1, "--tensors", "--json")
    info = json.loads(js)
    assert rc == 0 and info["step"] == 1 and info["world_size"] == 1
    assert info["num_tensors"] == 4 and info["user_metadata"] == {"loss": 1.5, "note": "first"}
    assert info["tensors"]["w"] == {"shape": [8, 6], "dtype": "float32", "bytes": 192,
                                    "num_chunks": 1}
    assert info["tensor_bytes"] == 192 + 128 + 512 + 64
    assert info["total_bytes"] >= info["tensor_bytes"]
    assert info["config_fingerprint"] == "fp-0123"  # trainer.fingerprint, read and checked
    assert info["writer"]["lease_generation"] >= 1 and info["versions"]["ckpt"]
    rc, by_id, _ = cli(capsys, "show", root, "--id", info["id"], "--json")
    assert rc == 0 and json.loads(by_id)["step"] == 1
    rc, text, _ = cli(capsys, "show", root, "--step", 1, "--tensors")
    assert "8x6" in text and "fingerprint  fp-0123" in text and 'note="first"' in text
    # Errors: one line, exit 1 for a missing checkpoint, 2 for bad usage.
    rc, _, err = cli(capsys, "show", root, "--step", 9)
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "step" in err
    rc, _, err = cli(capsys, "show", root, "--id", "nosuchid")
    assert rc == 1 and "nosuchid" in err and len(err.strip().splitlines()) == 1
    rc, _, err = cli(capsys, "show", root, "--step", 1, "--id", info["id"])
    assert rc == 2 and "not both" in err


def test_diff_exit_codes_and_both_paths(root, capsys):
    # Identical: same checkpoint by step and by id.
    rc, js, _ = cli(capsys, "show", root, "--step", 3, "--json")
    id3 = json.loads(js)["id"]
    rc, out, err = cli(capsys, "diff", root, 3, id3)
    assert rc == 0, err
    assert "5 identical" in out or "identical" in out
    # Same chunking, one element changed: 1, with that tensor's max abs diff.
    rc, js, err = cli(capsys, "diff", root, 1, 3, "--json")
    assert rc == 1, err
    res = json.loads(js)
    rows = {r["key"]: r for r in res["tensors"]}
    assert rows["v"]["status"] == "changed"
    assert rows["v"]["max_abs_diff"] == pytest.approx(0.25, abs=1e-6)
    assert {rows[k]["status"] for k in ("w", "big", "i")} == {"identical"}
    objs = {r["key"]: r for r in res["objects"]}
    assert objs["trainer.step"] == {"key": "trainer.step", "status": "changed", "a": "1",
                                    "b": "3"}
    assert objs["trainer.fingerprint"]["status"] == "identical"
    # Different chunking (2 rank shards vs one chunk): assembled, same verdicts.
    rc, js, err = cli(capsys, "diff", root, 2, 3, "--json")
    res = json.loads(js)
    assert rc == 1 and {r["key"]: r["status"] for r in res["tensors"]} == {
        "w": "identical", "v": "identical", "big": "identical", "i": "identical"}
    assert [r["key"] for r in res["objects"] if r["status"] != "identical"] == ["trainer.step"]
    rc, out, _ = cli(capsys, "diff", root, 1, 2)
    assert rc == 1 and "changed  v" in out and "max abs diff 0.25" in out
    # Over the size limit for assembling: not compared, said in one line, exit 2.
    rc, out, err = cli(capsys, "diff", root, 1, 2, "--max-tensor-bytes", 256)
    assert rc == 2 and "big" in err and "--max-tensor-bytes" in err
    assert len(err.strip().splitlines()) == 1
    assert "not_compared  big" in out


def test_diff_added_removed_reshaped_and_corrupt(tmp_path, capsys):
    url = str(tmp_path / "r")
    ckpt.save({"a": torch.zeros(3), "b": torch.ones(2), "c": torch.ones(4)}, url, 1)
    ckpt.save({"a": torch.zeros(3), "c": torch.ones(2, 2), "d": torch.ones(1),
               "b2": torch.ones(2, dtype=torch.float64)}, url, 2)
    rc, js, err = cli(capsys, "diff", url, 1, 2, "--json")
    assert rc == 1, err
    status = {r["key"]: r["status"] for r in json.loads(js)["tensors"]}
    shown = json.loads(cli(capsys, "show", url, "--json")[1])
    assert shown["step"] == 2 and shown["config_fingerprint"] is None  # not a trainer's
    assert status == {"a": "identical", "b": "removed", "c": "shape_changed", "d": "added",
                      "b2": "added"}
    # Damaged data it compares: the diff refuses (exit 2 as diff(1): 1 means "different"
    # only; one line naming the file).
    loc = ckpt.CheckpointStore(url).read_manifest(2).tensors["a"]["chunks"][0]["location"]
    flip_byte(os.path.join(url, "step_000000002", loc.file), loc.offset + 1)
    rc, _, err = cli(capsys, "diff", url, 1, 2)
    assert rc == 2 and "checksum mismatch" in err and loc.file in err
    assert len(err.strip().splitlines()) == 1
    rc, _, err = cli(capsys, "diff", url, 1, 7)
    assert rc == 2 and "step_000000007" in err and len(err.strip().splitlines()) == 1
    rc, _, err = cli(capsys, "diff", url, 1, "nosuchid")
    assert rc == 2 and "nosuchid" in err and len(err.strip().splitlines()) == 1


def test_diff_as_a_process_with_progress(root):
    env = {**os.environ, "PYTHONPATH": REPO}
    p = subprocess.run([sys.executable, "-m", "ckpt", "diff", root, "3", "4", "--progress"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "trainer.step" in p.stdout and "100.0%" in p.stderr and "diff [" in p.stderr
    q = subprocess.run([sys.executable, "-m", "ckpt", "diff", root, "3", "3"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert q.returncode == 0 and q.stderr == ""  # no bar when stderr is not a terminal


def test_history_and_lease(tmp_path, capsys):
    from ckpt.cadence import FailureHistory
    from ckpt.storage import Storage

    url = str(tmp_path / "h")
    ckpt.save({"x": torch.zeros(1)}, url, 1)
    rc, out, _ = cli(capsys, "history", url)
    assert rc == 0 and "no failure history" in out and "released, generation 1" in out
    h = FailureHistory(failure_times=[1.7e9, 1.7e9 + 3600], uptime_seconds=7200.0)
    Storage(url).write_bytes(HISTORY_NAME, json.dumps(h.to_dict()).encode())
    rc, js, _ = cli(capsys, "history", url, "--json", "--mtbf-hours", "2")
    info = json.loads(js)
    assert rc == 0 and info["num_failures"] == 2 and info["uptime_seconds"] == 7200
    # The auto cadence's estimate: (w * prior + uptime) / (w + failures).
    assert info["mtbf_seconds"] == pytest.approx((7200 + 7200) / 3)
    assert info["mtbf_observed_seconds"] == 3600
    assert info["lease"]["generation"] == 1 and info["lease"]["released"] is True
    rc, out, _ = cli(capsys, "history", url)
    failures = out[:out.index("trajectories")]
    assert "failures     2" in out and "MTBF" in out and failures.count("\n    ") == 2
    # Read only: the files are unchanged.
    assert json.loads(Storage(url).read_bytes(HISTORY_NAME)) == h.to_dict()
    Storage(url).write_bytes(HISTORY_NAME, b'{"version": 1, "failure_times": "x"}')
    rc, _, err = cli(capsys, "history", url)
    assert rc == 2 and HISTORY_NAME in err and len(err.strip().splitlines()) == 1
    rc, _, err = cli(capsys, "history", url, "--mtbf-hours", "0")
    assert rc == 2 and "--mtbf-hours" in err


def test_list_table_fits_the_terminal_and_keeps_everything():
    note = "fenced: written by a writer that had lost the lease (generation 3); " * 2
    rows = [("STEP", "ID", "NOTE"), ("10", "abc", note.strip()), ("20", "def", "")]
    lines = format_table(rows, 60)
    assert all(len(ln) < 60 for ln in lines)
    indent = lines[0].index("NOTE")
    assert " ".join(ln[indent:].strip() for ln in lines[1:-1]) == note.strip()
    assert lines[-1].split() == ["20", "def"]
    piped = format_table(rows, None)  # not a terminal: one line per row, nothing wrapped
    assert len(piped) == 3 and piped[1].endswith(note.strip())
