"""Replica groups on torchft keep training when one dies (docs/trainer.md, "Fault-tolerant
replica groups"): real processes on loopback, gloo, a real lighthouse, real SIGKILLs.

One launch (``trainer.ft.local.LocalReplicaGroups``: a lighthouse and two replica groups of
one rank, each its own ``torchrun --max-restarts``) goes through three failures in turn,
and the tests below each check one of them on what it recorded:

1. the worker of the group that does not write checkpoints is SIGKILLed: the writing group
   keeps committing steps alone; the killed group's torchrun restarts it, it receives the
   live state from its peer and trains in step again;
2. the worker of the writing group is SIGKILLed: the other group takes the store's lease
   over (the holder's pid is gone on this host) and writes the next checkpoints; the
   killed group rejoins as in 1;
3. both workers are SIGKILLed at once: both groups resume from the store's newest
   checkpoint, as a job without fault tolerance does.

The run then ends: both groups' replicas are bit-identical (model, optimizer, schedulers,
RNG, counters), and the store verifies, its commits one sequence with nothing left torn.
Steps are paced (``fault.inject_step_delay_seconds``) so that the run outlasts the three
outages on a loaded machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt.root import CheckpointStore
from tests.e2e._jobs import ROOT, TINY, base_env, free_port

pytestmark = pytest.mark.ft
if not os.environ.get("CI"):
    pytest.importorskip("torchft")  # the 'ft' extra; CI installs it, so there it must run
from trainer.ft.local import LocalReplicaGroups  # noqa: E402

STEPS = 300
INTERVAL = 10
PHASE_TIMEOUT = 150.0


def _args(root: Path) -> list[str]:
    return ["--config", str(TINY), f"--training.steps={STEPS}", "--training.log_every=100",
            f"--checkpoint.root={root}", f"--checkpoint.interval={INTERVAL}",
            "--checkpoint.keep_last=0", "--fault.hang_timeout_seconds=60",
            "--fault.inject_step_delay_seconds=0.1",
            "--fault_tolerance.heartbeat_timeout_seconds=1",
            "--fault_tolerance.join_timeout_seconds=1",
            "--fault_tolerance.timeout_seconds=10",
            "--fault_tolerance.connect_timeout_seconds=60",
            "--fault_tolerance.lease_ttl_seconds=10",
            "--fault_tolerance.lease_retry_steps=5"]


def _after(events: list[dict], t: float, kind: str, **match) -> list[dict]:
    return [e for e in events if e["kind"] == kind and e["time"] > t
            and all(e.get(k) == v for k, v in match.items())]


def _kill_and_rejoin(job: LocalReplicaGroups, victim: int) -> dict:
    """SIGKILL group ``victim``'s worker; wait until it trains in a full quorum again."""
    other = 1 - victim
    t_kill = time.time()
    pid = job.kill_worker(victim)
    healed = job.wait_for(lambda: _after(job.events(victim), t_kill, "ft_healed"),
                          PHASE_TIMEOUT, f"group {victim} rejoining")[0]
    back = job.wait_for(lambda: _after(job.events(victim), healed["time"], "ft_step",
                                       committed=True, quorum_size=2),
                        PHASE_TIMEOUT, f"group {victim} committing in a full quorum")[0]
    during = [e for e in job.steps(other) if t_kill < e["time"] < back["time"]]
    return {"pid": pid, "t_kill": t_kill, "healed": healed, "back": back,
            "recovery_seconds": back["time"] - t_kill,
            "survivor_steps": [e["step"] for e in during]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ft")
    root = out / "ckpt"
    job = LocalReplicaGroups(_args(root), groups=2, out=out, max_restarts=3,
                             port=free_port(), env=base_env())
    rec: dict = {"root": root, "job": job}
    try:
        job.start()
        job.wait_for(lambda: job.writer() is not None and all(
            any(e["quorum_size"] == 2 for e in job.steps(g)[-3:]) for g in (0, 1)),
            PHASE_TIMEOUT, "both groups training together and a writer")
        writer = job.writer()
        job.wait_for(lambda: CheckpointStore(str(root)).committed_steps(), PHASE_TIMEOUT,
                     "a first checkpoint")
        # 1. the group that does not write dies
        rec["standby"] = {"group": 1 - writer, **_kill_and_rejoin(job, 1 - writer)}
        rec["writer_before"] = writer
        # 2. the writing group dies: the lease moves
        t = time.time()
        rec["writer_killed"] = {"group": writer, **_kill_and_rejoin(job, writer)}
        rec["lease_moved"] = _after(job.events(1 - writer), t, "ft_writer", role="writer")
        job.wait_for(lambda: max(CheckpointStore(str(root)).committed_steps())
                     > rec["writer_killed"]["back"]["step"], PHASE_TIMEOUT,
                     "a checkpoint by the new writer")
        # 3. every group dies at once
        t3 = rec["t_kill_all"] = time.time()
        pids = [job.kill_worker(0), job.kill_worker(1)]
        job.wait_for(lambda: not any(os.path.exists(f"/proc/{p}") and
                                     open(f"/proc/{p}/stat").read().split()[2] != "Z"
                                     for p in pids), 30, "both workers gone")
        rec["newest_at_kill_all"] = max(CheckpointStore(str(root)).committed_steps())
        rec["resumed"] = {g: job.wait_for(lambda g=g: _after(job.events(g), t3, "resumed"),
                                          PHASE_TIMEOUT, f"group {g} resuming")[0]
                          for g in (0, 1)}
        rec["codes"] = job.wait(timeout=600)
        rec["events"] = {g: job.events(g) for g in (0, 1)}
    finally:
        job.stop()
    rec["logs"] = job.tails(6000)
    return rec


def _digests(rec, g: int) -> dict:
    d = [e for e in rec["events"][g] if e["kind"] == "ft_replica_digest"]
    assert d, f"group {g} logged no final digest\n{rec['logs']}"
    return d[-1]


def test_run_finishes_with_bit_identical_replicas(run):
    assert run["codes"] == {0: 0, 1: 0}, run["logs"]
    a, b = _digests(run, 0), _digests(run, 1)
    assert a["step"] == b["step"] == STEPS
    keys = ("model", "optim", "rng", "trainer")
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}


def _committed_sequence(events: list[dict], since: float, until: float) -> list[int]:
    return [e["step"] for e in events if e["kind"] == "ft_step" and e["committed"]
            and since < e["time"] < until]


def test_the_standby_group_dies_and_the_writer_trains_on(run):
    """Killed at the standby group: the writing group keeps committing during the outage,
    loses no committed step (its committed steps stay consecutive), and the killed group
    rejoins with the live state."""
    r = run["standby"]
    survivor = 1 - r["group"]
    assert len(r["survivor_steps"]) >= 3, (r, run["logs"])
    seq = _committed_sequence(run["events"][survivor], r["t_kill"] - 5, r["back"]["time"])
    assert seq == list(range(seq[0], seq[0] + len(seq))), seq  # none lost, none repeated
    assert r["healed"]["step"] > r["healed"]["from_step"]  # behind, brought up to the peer
    assert r["back"]["step"] >= r["healed"]["step"]


def test_the_writer_group_dies_and_the_lease_moves(run):
    r = run["writer_killed"]
    survivor = 1 - r["group"]
    assert run["lease_moved"], run["logs"]
    assert len(r["survivor_steps"]) >= 1, (r, run["logs"])
    # The survivor is the group killed in 1: its steps count from its return there (before
    # it, it was dead, and its steps before that death are not this outage's).
    since = max(r["t_kill"] - 5, run["standby"]["back"]["time"] - 0.001)
    seq = _committed_sequence(run["events"][survivor], since, r["back"]["time"])
    assert seq == list(range(seq[0], seq[0] + len(seq))), seq
    # The store: every version committed (nothing torn, nothing fenced: never two writers),
    # one sequence in time, and it verifies.
    store = CheckpointStore(str(run["root"]))
    infos = store.list(all_versions=True)
    assert {i.status for i in infos} == {"committed"}, [(i.step, i.status) for i in infos]
    steps = [i.step for i in infos]
    assert steps == sorted(steps) and steps[-1] == STEPS
    created = [i.created for i in sorted(infos, key=lambda i: i.step)]
    assert created == sorted(created)
    owners = [i.owner for i in sorted(infos, key=lambda i: i.step)]
    runs = [o for i, o in enumerate(owners) if i == 0 or o != owners[i - 1]]
    assert len(runs) == len(set(runs)), owners  # each writer's commits are one stretch
    out = subprocess.run([sys.executable, "-m", "ckpt", "verify", str(run["root"])], cwd=ROOT,
                         env=base_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_group_dies_and_the_job_resumes_from_the_store(run):
    """The first group back resumes from the newest checkpoint of when all were dead, so no
    committed step is lost. A group slower to come back (a loaded machine) may find newer
    ones, saved by the first meanwhile: it resumes from the newest then, never an older."""
    newest = run["newest_at_kill_all"]
    steps = [run["resumed"][g]["step"] for g in (0, 1)]
    first = min((0, 1), key=lambda g: run["resumed"][g]["time"])
    assert run["resumed"][first]["step"] == newest, (run["resumed"], newest)
    assert min(steps) == newest, (run["resumed"], newest)
    committed = {e["step"] for g in (0, 1) for e in run["events"][g]
                 if e["kind"] == "save_committed"}
    for g in (0, 1):  # a later one: a step the first group committed after it resumed
        step = run["resumed"][g]["step"]
        assert step == newest or (step in committed and g != first), (run["resumed"], newest)


def test_every_committed_step_reads_the_next_batches_once(run):
    """The data guarantee: a committed step of a quorum of n groups consumes group batches
    [b, b + n), group r of them reading batch b + r; the next step starts at b + n. A step
    that does not commit consumes nothing: the next one reads its batches again. So what a
    dead group had not consumed is neither skipped nor read twice."""
    chained = 0
    for g in (0, 1):
        prev = None
        for e in run["events"][g]:
            if e["kind"] in ("ft_started", "ft_healed"):  # a new process, or a peer's state
                prev = None
            if e["kind"] != "ft_step":
                continue
            start = e["batch_index"] - e["replica_rank"]
            if e["committed"]:
                assert e["batches_committed"] - start == e["quorum_size"], e
            if prev is not None:
                expected = prev["batches_committed"] if prev["committed"] else \
                    prev["batch_index"] - prev["replica_rank"]
                assert start == expected, (prev, e)
                chained += 1
            prev = e
    assert chained > STEPS
    # Where both groups ran the same step from the same position, they read different
    # batches. (Steps after the moment both died are replayed from the store: the replays
    # are their own lineage.)
    readers: dict[tuple[bool, int, int, int], set[int]] = {}
    for g in (0, 1):
        for e in run["events"][g]:
            if e["kind"] == "ft_step" and e["committed"]:
                key = (e["time"] > run["t_kill_all"], e["step"],
                       e["batch_index"] - e["replica_rank"], e["replica_rank"])
                readers.setdefault(key, set()).add(g)
    assert all(len(groups) == 1 for groups in readers.values()), \
        [k for k, v in readers.items() if len(v) > 1][:5]
    pairs = {k[:3] for k in readers if (*k[:3], 1 - k[3]) in readers}
    assert len(pairs) > STEPS // 4


def test_an_unreachable_lighthouse_is_one_line_and_a_failed_exit(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    out = subprocess.run(
        [sys.executable, "-m", "trainer", "--config", str(TINY), "--parallel.dp_replicate=2",
         "--fault_tolerance.enabled=true", "--fault_tolerance.group_id=0",
         f"--fault_tolerance.lighthouse={url}", "--fault_tolerance.connect_timeout_seconds=1"],
        cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"python -m trainer: error: fault_tolerance.lighthouse: no "
                               f"lighthouse answers at {url}"), lines
    assert "python -m trainer lighthouse" in lines[0]
