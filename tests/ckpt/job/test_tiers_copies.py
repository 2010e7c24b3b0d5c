"""Local copies on the next node (``LocalTierOptions(copies=2)``): the local
tier survives the loss of a node.

Three real gloo processes act as three nodes, each with its own local root
(``local-{node}``) and a tiny model of its own. A first job trains with the local tier every
2 steps (each node's checkpoint copied to the next node, ``local-{n+1}/peer-{n}``) and the
durable one every 4, and stops as a crash does (leases left behind). The test then loses
nodes (their local roots wiped: a replaced machine comes back empty), damages copies, and a
second job resumes and trains on; its state must equal, bit for bit, that of a run that
never stopped.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.ckpt.job import _copy_workers as w
from tests.dist import run_ranks

NODES = 3
LAST, TOTAL = 7, 10  # the first job stops after 7: local 4 and 6, durable 4


def _roots(base: Path) -> tuple[str, str]:
    return str(base / "durable"), str(base / "local-{node}")


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*")) if p.name != "manifest.json"}


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """The roots a first job left when it stopped after step 7 (copied per test)."""
    base = tmp_path_factory.mktemp("crashed")
    out = run_ranks(w.train_body, NODES, *_roots(base), LAST, timeout=240)
    return base, out


def _copy_of(crashed, tmp_path: Path) -> Path:
    base, _ = crashed
    shutil.copytree(base, tmp_path / "job")
    return tmp_path / "job"


def test_each_nodes_local_steps_are_copied_to_the_next_node_bit_for_bit(crashed):
    import json

    base, out = crashed
    for node, events in enumerate(out):
        assert [s for s, _ in events["copy_committed"]] == [2, 4, 6], events
        assert {f["peer_node"] for _, f in events["copy_committed"]} == {(node + 1) % NODES}
        assert not events["copy_failed"] and not events["copy_skipped"]
        # What monitoring makes of it: the newest step held on two nodes, bytes, lag.
        series = events["metrics"]
        assert series[("ckpt_peer_copied_step", None)] == 6
        assert series[("ckpt_peer_copies_total", "committed")] == 3
        assert series[("ckpt_peer_copies_total", "failed")] == 0
        assert 0 < series[("ckpt_peer_copy_lag_seconds", None)] < 60
        # Steps 2, 4 and 6 were copied; the files of 4 and 6 are still there to count.
        kept = sum(len(b) for step in (4, 6) for b in _files(
            base / f"local-{(node + 1) % NODES}" / f"peer-{node}" / f"step_{step:09d}").values())
        assert series[("ckpt_peer_copied_bytes_total", None)] > kept > 0
    for node in range(NODES):
        holder = base / f"local-{(node + 1) % NODES}" / f"peer-{node}"
        # The copies mirror the owner's retention (keep 2) and are byte for byte its files.
        assert sorted(p.name for p in holder.glob("step_*")) == \
            sorted(p.name for p in (base / f"local-{node}").glob("step_*")) == \
            ["step_000000004", "step_000000006"]
        for step in ("step_000000004", "step_000000006"):
            mine, copy = base / f"local-{node}" / step, holder / step
            assert _files(mine) == _files(copy) and _files(copy)
            # The manifest is re-issued under the holder's lease, naming where it came from.
            original = json.loads((mine / "manifest.json").read_text())
            copied = json.loads((copy / "manifest.json").read_text())
            assert copied["writer"]["owner"] != original["writer"]["owner"]
            assert copied["writer"]["copied_from"]["owner"] == original["writer"]["owner"]
            assert {k: v for k, v in copied.items() if k not in ("writer", "manifest_sha256")} \
                == {k: v for k, v in original.items() if k not in ("writer", "manifest_sha256")}


def test_a_lost_node_resumes_from_the_local_tier_through_its_copy(crashed, tmp_path):
    base = _copy_of(crashed, tmp_path)
    shutil.rmtree(base / "local-1")  # node 1 replaced by an empty machine
    out = run_ranks(w.resume_body, NODES, *_roots(base), TOTAL, timeout=240)
    # Local 6 is newer than durable 4: node 1's part of it comes back from node 2's copy.
    assert [(r["step"], r["tier"]) for r in out] == [(6, "local")] * NODES
    assert [s for s, f in out[1]["copy_restored"]] == [6]
    assert out[1]["copy_restored"][0][1]["peer_node"] == 2
    assert not out[0]["copy_restored"] and not out[2]["copy_restored"]
    assert not any(r["load_fallback"] or r["copy_failed"] for r in out), out


def test_two_neighbouring_nodes_lost_fall_back_to_the_durable_tier(crashed, tmp_path):
    base = _copy_of(crashed, tmp_path)
    # Node 1's own checkpoints and their copy on node 2 are both gone.
    shutil.rmtree(base / "local-1")
    shutil.rmtree(base / "local-2")
    out = run_ranks(w.resume_body, NODES, *_roots(base), TOTAL, timeout=240)
    assert [(r["step"], r["tier"]) for r in out] == [(4, "durable")] * NODES
    assert not any(r["copy_restored"] for r in out), out


def test_a_damaged_copy_is_detected_and_the_fall_back_goes_on(crashed, tmp_path):
    base = _copy_of(crashed, tmp_path)
    shutil.rmtree(base / "local-1")
    damaged = sorted((base / "local-2" / "peer-1" / "step_000000006").glob("r*.bin"))[0]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    out = run_ranks(w.resume_body, NODES, *_roots(base), TOTAL, timeout=240)
    # Step 6 is refused (node 1's copy fails its checksum on the way back); step 4 comes
    # back from node 2's copy and loads, from the local tier.
    assert [(r["step"], r["tier"]) for r in out] == [(4, "local")] * NODES
    for r in out:
        assert [(s, f["tier"]) for s, f in r["load_fallback"]] == [(6, "local")], r
        assert "checksum mismatch" in r["load_fallback"][0][1]["reason"]
    assert [s for s, _ in out[1]["copy_restored"]] == [4]
    assert [s for s, _ in out[1]["copy_failed"]] == [6]


def test_a_node_killed_while_it_receives_a_copy_leaves_no_torn_copy(tmp_path):
    root, local = _roots(tmp_path)
    # No durable checkpoint (interval 100): only the local tier can resume the job. Node 2
    # dies (SIGKILL) while it writes node 1's copy of step 6: in the middle of a data file,
    # long before the manifest. The job is torn down with it.
    with pytest.raises(AssertionError, match=r"--- rank 2 ---\nprocess exited with code -9"):
        run_ranks(w.train_body, NODES, root, local, LAST, "100", (2, 6), timeout=240,
                  kill_all_on_death=True)
    torn = tmp_path / "local-2" / "peer-1" / "step_000000006"
    names = sorted(p.name for p in torn.iterdir())
    assert "manifest.json" not in names and any(n.endswith(".bin") for n in names), names
    assert any(n.startswith("pending-") for n in names), names
    # Node 1 is lost too: its step 6 lives only in the torn copy, which must never be read.
    shutil.rmtree(tmp_path / "local-1")
    out = run_ranks(w.resume_body, NODES, root, local, TOTAL, "100", timeout=240)
    assert [(r["step"], r["tier"]) for r in out] == [(4, "local")] * NODES
    assert [s for s, _ in out[1]["copy_restored"]] == [4]
    assert not any(r["load_fallback"] for r in out), out
    # The new holder of node 2's copies removed the torn one's files when it took them;
    # the job then copied its own saves 6, 8 and 10 there.
    kept = sorted(p.name for p in (tmp_path / "local-2" / "peer-1").glob("step_*"))
    assert kept == ["step_000000008", "step_000000010"], kept
    assert not list((tmp_path / "local-2" / "peer-1").rglob("pending-*"))


def test_a_node_of_several_ranks_gets_every_ranks_part_back(tmp_path):
    """Two nodes of two ranks each: a node's local checkpoint holds both ranks' files (its
    first rank copies them); the replaced node gets both back from the other node."""
    root, local = _roots(tmp_path)
    run_ranks(w.train_body, 4, root, local, LAST, w.DURABLE_EVERY, None, 2, timeout=240)
    assert sorted(p.name for p in (tmp_path / "local-0" / "peer-1").glob("step_*")) == \
        ["step_000000004", "step_000000006"]
    shutil.rmtree(tmp_path / "local-1")
    out = run_ranks(w.resume_body, 4, root, local, TOTAL, w.DURABLE_EVERY, 2, timeout=240)
    assert [(r["step"], r["tier"]) for r in out] == [(6, "local")] * 4
    # Node 1's first rank (rank 2) fetched it back, from node 0.
    assert [(s, f["peer_node"]) for s, f in out[2]["copy_restored"]] == [(6, 0)]
    assert not any(r["copy_restored"] for i, r in enumerate(out) if i != 2)


def test_a_copy_of_a_step_a_resume_went_back_past_is_never_resumed_from(crashed, tmp_path):
    """A resume went back from local 6 to step 4 and recorded its run, then every delete of
    6 failed (the job died): node 2 still holds node 1's copy of 6, nodes 0 and 2 their own.
    Node 1 is replaced by an empty machine. Its copy of 6 is of the abandoned trajectory:
    no node resumes from it (it used to be restored to node 1 and loaded); the job resumes
    at step 4 and trains on bit for bit."""
    from ckpt.format import new_run_id
    from ckpt.root import CheckpointStore, record_run

    base = _copy_of(crashed, tmp_path)
    durable = CheckpointStore(str(base / "durable"))
    four = durable.read_manifest(4)
    run_a = CheckpointStore(str(base / "local-0")).read_manifest(6).lineage.run
    assert four.lineage.run == run_a
    record_run(durable.storage, {"run": new_run_id(), "tier": "durable", "parent": {
        "run": run_a, "step": 4, "save_id": four.save_id}})
    shutil.rmtree(base / "local-1")
    out = run_ranks(w.resume_body, NODES, *_roots(base), TOTAL, timeout=240)
    assert [r["step"] for r in out] == [4] * NODES, out
    for r in out:
        reasons = [f["reason"] for s, f in r["load_fallback"] if s == 6]
        assert reasons and all("abandoned" in why for why in reasons), r
