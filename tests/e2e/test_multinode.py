"""Two nodes on loopback: one node dies mid-run, comes back, and the job ends bit for bit.

A 2-node job (two ``torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d`` launchers
meeting at one rendezvous endpoint, one worker each: dp2, FSDP2, the tiny config) is run
with checkpoints every 5 steps. Shortly after a commit, one node's launcher and worker are
SIGKILLed together (a machine failure: ``Job.kill_all`` signals the agent and each worker,
since torchrun starts its workers in sessions of their own); the surviving node's worker
fails, its agent
restarts it (``--max-restarts``) and waits in the rendezvous until the killed node's
launcher, started again with the same command, joins. Both resume from the newest
checkpoint, and the job ends where an uninterrupted 2-rank run ends: the same loss at every
step and the same final checkpoint, bit for bit.

The checkpoint root's writers stay a sequence: the lease is held by global rank 0 only;
at the end ``_fence/`` shows generation 1 (the first round) closed and generation 2 (the
resumed round) released, and nothing else; the resumed round's lease took generation 1
over when its holder was killed with its node, or found it released otherwise.

Node names (``--local-addr``) fix the ranks: nodes are ranked by name, so the node named
127.0.0.1 holds global rank 0 (and the lease). The launcher that serves the rendezvous
store (``is_host=true``) is never the one killed: with the c10d backend the store dies
with it. Both the node with rank 0 and the other one are killed, in two tests.
"""

from __future__ import annotations

import json
import re
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


def _fence(root) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for p in sorted((root / "_fence").iterdir()):
        m = re.match(r"^gen_(\d+)\.(open|closing|json)$", p.name)
        assert m, p.name
        out.setdefault(m.group(2), []).append(int(m.group(1)))
    return out


@pytest.mark.parametrize("killed", ["rank0-node", "other-node"])
def test_killed_node_rejoins_and_the_job_ends_bit_for_bit(tmp_path, killed):
    ref_root, ref_events = straight_run(COMMON)  # the reference, outside this job's timing
    root, jsonl = tmp_path / "ckpt", tmp_path / "events.jsonl"
    port, run_id = free_port(), f"mn-{uuid.uuid4().hex[:8]}"
    # The host node serves the rendezvous and survives; the victim is ranked first (rank 0,
    # the lease holder) or second by its name.
    host_addr, victim_addr = (("127.0.0.2", "127.0.0.1") if killed == "rank0-node"
                              else ("127.0.0.1", "127.0.0.2"))
    overrides = (*COMMON, "--checkpoint.interval=5", f"--checkpoint.root={root}",
                 f"--metrics.jsonl_path={jsonl}")

    def launch(addr: str, is_host: bool, name: str) -> Job:
        return Job(node_argv(*overrides, nnodes=2, port=port, run_id=run_id, local_addr=addr,
                             is_host=is_host), tmp_path, name, jsonl, env=multinode_env())

    host = launch(host_addr, True, "host")
    victim = launch(victim_addr, False, "victim")
    jobs = [host, victim]
    try:
        committed = host.wait_event(lambda e: e["kind"] == "save_committed" and e["step"] < 20,
                                    timeout=120, what="a commit before step 20")
        host.wait_step(committed["step"] + 1, since=host.last_index)
        victim_rank = 0 if killed == "rank0-node" else 1
        assert set(victim.workers()) == {victim_rank}, victim.workers()
        victim.kill_all()
        before = list(host.events())
        last_logged = max(e["step"] for e in before if e["kind"] == "train_step")
        assert last_logged < STEPS, "the job finished before the node was killed"
        again = launch(victim_addr, False, "victim-again")
        jobs.append(again)
        resumed = host.wait_event(lambda e: e["kind"] == "resumed", since=len(before),
                                  timeout=120, what="the resume after the node came back")
        assert committed["step"] <= resumed["step"] <= last_logged, (resumed, committed)
        host.wait_ok(timeout=120)
        again.wait_ok(timeout=60)
    finally:
        for job in jobs:
            if job.proc.poll() is None:
                job.kill_all()
    for job in (host, again):
        assert ABORT_MARK not in job.stderr, job.tails()
    out = host.stderr + again.stderr
    assert re.findall(r"resumed from \S+ step (\d+)", out) == [str(resumed["step"])], out[-3000:]

    # Bit for bit with an uninterrupted run (losses, replayed steps, final checkpoint).
    events = host.events()
    ref = loss_history(ref_events)
    got = loss_history(events)
    assert got == ref, {s: (got.get(s), ref[s]) for s in ref if got.get(s) != ref[s]}
    for step, values in all_losses(events).items():
        assert all(v == ref[step] for v in values), (step, values, ref[step])
    assert_same_checkpoint(ref_root, root, STEPS)

    # One writer at a time: generation 1 (first round) then 2 (after the node came back).
    acquired = [e for e in events if e["kind"] == "lease_acquired"]
    assert [e["generation"] for e in acquired] == [1, 2], acquired
    assert acquired[1]["took_over"] is (killed == "rank0-node"), acquired
    fence = _fence(root)
    assert fence.get("open") == [1, 2], fence
    assert fence.get("json") == [1, 2], fence  # both closed: 1 by its taker or itself
    lease = json.loads((root / "_lease.json").read_text())
    assert lease["generation"] == 2 and lease["released"] is True, lease
    assert lease["run_id"] == run_id, lease
    assert (root / "_fence" / "gen_000000002.json").exists()  # every generation closed
    closes = {g: json.loads((root / "_fence" / f"gen_{g:09d}.json").read_text())
              for g in (1, 2)}
    # Every committed step's manifest is listed by its generation's close record, and the
    # generations do not overlap: each commit of generation 1 precedes generation 2's lease.
    manifests = [json.loads((d / "manifest.json").read_text())
                 for d in sorted(root.glob("step_*"))]
    by_gen: dict[int, list[dict]] = {1: [], 2: []}
    for m in manifests:
        gen = m["writer"]["lease_generation"]
        by_gen[gen].append(m)
        assert m["save_id"] in closes[gen]["committed"], (m["step"], gen, closes)
    assert by_gen[1] and by_gen[2], {g: [m["step"] for m in ms] for g, ms in by_gen.items()}
    assert max(m["step"] for m in by_gen[1]) <= resumed["step"] < min(m["step"] for m in by_gen[2])
    assert max(m["created_unix"] for m in by_gen[1]) < lease["acquired_unix"], lease
    assert {m["writer"]["owner"] for m in by_gen[2]} == {lease["holder"]}, lease
    assert len({m["writer"]["owner"] for m in by_gen[1]}) == 1
    # Taken over from a dead holder: the taker closed generation 1 (listing its manifests)
    # before writing; released by a live one: the holder closed it itself.
    gen1_holder = by_gen[1][0]["writer"]["owner"]
    expected_closer = lease["holder"] if killed == "rank0-node" else gen1_holder
    assert closes[1]["closed_by"] == expected_closer, (closes[1], lease, gen1_holder)
    assert closes[2]["closed_by"] == lease["holder"], (closes[2], lease)
