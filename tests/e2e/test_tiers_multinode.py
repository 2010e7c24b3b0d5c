"""Two tiers on two nodes (loopback): each node keeps its own local tier.

A 2-node job (one worker per node, DDP: every node holds whole tensors) saves its local
tier every 3 steps into a root per node (``local-{node}``) and the durable one every 10.
The second node is SIGKILLed with its launcher just after a local commit; the surviving
node's worker is restarted by its agent and waits for the killed node to come back.

* ``process``: the node comes back with its local tier: the job resumes from the local tier.
* ``node``: the node comes back with an empty local root (a replaced machine): the newer
  local steps of the first node alone are not usable, every rank falls back to the durable
  tier together, and the first node deletes its newer local steps.
* ``node-with-copy``: the same, with ``checkpoint.local_copies = 2``: the first node holds
  a copy of the second's local steps, the replaced node gets its part back from it, and the
  job resumes from the local tier.

Either way the job ends bit for bit where an uninterrupted run ends.
"""

from __future__ import annotations

import re
import shutil
import time
import uuid

import pytest

from tests.e2e._jobs import (
    ABORT_MARK,
    COMMON,
    STEPS,
    Job,
    all_losses,
    assert_same_checkpoint,
    free_port,
    loss_history,
    multinode_env,
    node_argv,
    straight_run,
)

pytestmark = pytest.mark.slow

DDP = ("--parallel.dp_mode=ddp",)


@pytest.mark.parametrize("lost", ["process", "node", "node-with-copy"])
def test_a_node_killed_resumes_from_the_right_tier_bit_for_bit(tmp_path, lost):
    ref_root, ref_events = straight_run((*COMMON, *DDP))
    root, jsonl = tmp_path / "ckpt", tmp_path / "events.jsonl"
    local = tmp_path / "local-{node}"
    port, run_id = free_port(), f"tiers-{uuid.uuid4().hex[:8]}"
    # Copies can lag rounds behind under load: node 0 keeps enough of its own local steps
    # that the copied step waited for below is still one it holds at the kill.
    keep = 4 if lost == "node-with-copy" else 2
    # Copies run behind the steps; paced steps let one land well before the next durable
    # commit (the kill must come while the copied local step is the newest).
    copies = ["--checkpoint.local_copies=2", "--fault.inject_step_delay_seconds=0.25"]
    overrides = (*COMMON, *DDP, "--checkpoint.interval=10", f"--checkpoint.root={root}",
                 f"--checkpoint.local_root={local}", "--checkpoint.local_interval=3",
                 f"--metrics.jsonl_path={jsonl}",
                 f"--checkpoint.local_keep_last={keep}",
                 *(copies if lost == "node-with-copy" else []))

    def launch(addr: str, is_host: bool, name: str) -> Job:
        return Job(node_argv(*overrides, nnodes=2, port=port, run_id=run_id, local_addr=addr,
                             is_host=is_host), tmp_path, name, jsonl, env=multinode_env())

    host = launch("127.0.0.1", True, "host")  # group rank 0: node 0, writes the events
    victim = launch("127.0.0.2", False, "victim")
    jobs = [host, victim]
    try:
        # The durable commit of step 10 first: under load it can land after later local
        # commits, and the kill must come after it (the local tier is then the newer one).
        host.wait_event(lambda e: e["kind"] == "save_committed" and e["step"] == 10,
                        timeout=120, what="the durable commit of step 10")
        # Node 0's commit of a local step newer than every durable commit so far, at least
        # 4 steps before the next one, so that the kill comes while that step is the
        # newest. With copies: a copy round that node 0 saw acknowledged (in the same round
        # node 1's copy of that step came to node 0); under load a round can be skipped for
        # a newer one, so not every local step gets its copy.
        kind = "copy_committed" if lost == "node-with-copy" else "local_save_committed"
        newest_durable = [10]

        def ahead(e: dict) -> bool:
            if e["kind"] == "save_committed":
                newest_durable[0] = max(newest_durable[0], e["step"])
            return e["kind"] == kind and newest_durable[0] < e["step"] and e["step"] % 10 <= 6

        committed = host.wait_event(ahead, timeout=120,
                                    what=f"a {kind} step ahead of the durable tier")
        # A local step counts only when every node committed it: wait for the second
        # node's own commit of that step (its events are not logged) before the kill.
        theirs = tmp_path / "local-1" / f"step_{committed['step']:09d}" / "manifest.json"
        if lost == "node-with-copy":  # ... and its copy on node 0
            theirs = tmp_path / "local-0" / "peer-1" / theirs.relative_to(tmp_path / "local-1")
        deadline = time.monotonic() + 60
        while not theirs.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert theirs.exists(), f"node 1 never committed local step {committed['step']}"
        victim.kill_all()
        if lost != "process":
            shutil.rmtree(tmp_path / "local-1")
        before = list(host.events())
        last_logged = max(e["step"] for e in before if e["kind"] == "train_step")
        durable_before = [e["step"] for e in before if e["kind"] == "save_committed"]
        again = launch("127.0.0.2", False, "victim-again")
        jobs.append(again)
        resumed = host.wait_event(lambda e: e["kind"] == "resumed", since=len(before),
                                  timeout=120, what="the resume after the node came back")
        host.wait_ok(timeout=120)
        again.wait_ok(timeout=60)
    finally:
        for job in jobs:
            if job.proc.poll() is None:
                job.kill_all()
    for job in (host, again):
        assert ABORT_MARK not in job.stderr, job.tails()
    out = host.stderr + again.stderr
    if lost != "node":
        assert max(durable_before) < committed["step"] <= resumed["step"] <= last_logged
        assert re.search(rf"resumed from the local tier \(\S+local-0\) step {resumed['step']}",
                         out), out[-3000:]
    else:
        assert resumed["step"] == max(durable_before), (resumed, durable_before)
        assert re.search(rf"resumed from \S+ckpt step {resumed['step']}", out), out[-3000:]
        fell_back = [e["step"] for e in host.events()
                     if e["kind"] == "load_fallback" and e.get("tier") == "local"]
        assert not fell_back  # not a failed load: node 1 simply has no local step
    events = host.events()
    ref = loss_history(ref_events)
    got = loss_history(events)
    assert got == ref, {s: (got.get(s), ref[s]) for s in ref if got.get(s) != ref[s]}
    for step, values in all_losses(events).items():
        assert all(v == ref[step] for v in values), (step, values, ref[step])
    assert_same_checkpoint(ref_root, root, STEPS)
    # Each node's local root holds its own last `keep` local steps, the final one included.
    for node in (0, 1):
        kept = sorted(p.name for p in (tmp_path / f"local-{node}").glob("step_*"))
        assert len(kept) == keep and kept[-1] == f"step_{STEPS:09d}", (node, kept)
        if lost == "node-with-copy":  # and the other node's, copied: the final one surely
            # (a round skipped for a newer one leaves an earlier step without its copy)
            copies = tmp_path / f"local-{1 - node}" / f"peer-{node}"
            copied = sorted(p.name for p in copies.glob("step_*"))
            assert copied and copied[-1] == kept[-1] and set(copied) <= set(kept), \
                (node, kept, copied)
    if lost == "node-with-copy":  # (node 1's events are not logged: its log line is)
        assert f"local step {resumed['step']} fetched back from node 0's copy" in \
            again.stderr, again.tails()
