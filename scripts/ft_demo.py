"""The fault-tolerance demonstration that scripts/ft_demo.sh runs (one machine, loopback).

A lighthouse and two replica groups of the tiny config (one rank each, gloo), durable
checkpoints under OUT/ckpt. Once both train together and one holds the store's lease, the
worker of the *other* group is SIGKILLed; the writing group trains on alone, the killed
group's torchrun restarts it, it receives the live state from its peer and trains in step
again. The run ends, both groups log a digest of their replica, and ``ckpt verify`` checks
the store. The last line is one JSON object:

- ``recovery_seconds``: from the SIGKILL to the killed group's first committed step in a
  full quorum again;
- ``healthy_steps_during_outage``: steps the writing group committed meanwhile;
- ``replicas_identical``: both groups' model, optimizer (and schedulers), RNG and counters
  equal at the end (SHA-256 of each rank's state);
- ``durable_verified``: ``ckpt verify`` of the root passed;
- and the details: groups, steps, exit statuses, the healthy group's longest step during
  the outage, its uncommitted steps, the final checkpoint.

    python scripts/ft_demo.py OUTDIR [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ckpt.root import CheckpointStore  # noqa: E402
from trainer.ft.local import LocalReplicaGroups, free_port  # noqa: E402


def say(msg: str) -> None:
    print(f"== {msg}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--timeout", type=float, default=600)
    opts = ap.parse_args()
    out = Path(opts.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    root = out / "ckpt"
    args = ["--config", str(REPO / "configs" / "tiny.toml"), f"--training.steps={opts.steps}",
            "--training.log_every=50", f"--checkpoint.root={root}",
            "--checkpoint.interval=20", "--checkpoint.keep_last=0",
            "--fault.hang_timeout_seconds=60", "--fault.inject_step_delay_seconds=0.1",
            "--fault_tolerance.heartbeat_timeout_seconds=1",
            "--fault_tolerance.join_timeout_seconds=1", "--fault_tolerance.timeout_seconds=10",
            "--fault_tolerance.lease_ttl_seconds=10", "--fault_tolerance.lease_retry_steps=5"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.setdefault("OMP_NUM_THREADS", "1")
    job = LocalReplicaGroups(args, groups=2, out=out, max_restarts=3, port=free_port(),
                             env=env)
    result: dict = {}
    try:
        say(f"1. a lighthouse ({job.url}) and 2 replica groups of the tiny config, "
            f"{opts.steps} steps; logs in {out}")
        job.start()
        job.wait_for(lambda: job.writer() is not None and all(
            any(e["quorum_size"] == 2 for e in job.steps(g)[-3:]) for g in (0, 1)),
            opts.timeout, "both groups training together")
        job.wait_for(lambda: CheckpointStore(str(root)).committed_steps(), opts.timeout,
                     "a first checkpoint")
        writer = job.writer()
        victim = 1 - writer
        say(f"2. both groups train in one quorum; group {writer} holds the lease and writes "
            f"the checkpoints (step {CheckpointStore(str(root)).committed_steps()[-1]} "
            f"committed)")
        t_kill = time.time()
        at = job.last_step(writer)
        pid = job.kill_worker(victim)
        say(f"3. SIGKILL of group {victim}'s worker (pid {pid}) at step {at}; group {writer} "
            f"trains on alone")
        healed = job.wait_for(lambda: [e for e in job.events(victim) if e["kind"] ==
                                       "ft_healed" and e["time"] > t_kill],
                              opts.timeout, "the killed group rejoining")[0]
        back = job.wait_for(lambda: [e for e in job.steps(victim) if e["time"] > healed["time"]
                                     and e["quorum_size"] == 2], opts.timeout,
                            "the killed group training in the quorum")[0]
        during = [e for e in job.events(writer) if e["kind"] == "ft_step"
                  and t_kill < e["time"] < back["time"]]
        longest = max((e["step_seconds"] for e in job.events(writer)
                       if e["kind"] == "train_step" and t_kill < e["time"] <= back["time"]),
                      default=None)
        say(f"4. group {victim} restarted by torchrun, received group {writer}'s state at step "
            f"{healed['step']} ({healed['seconds']:.2f}s; {healed['process_seconds']:.1f}s "
            f"after its process started) and trains in step again, "
            f"{back['time'] - t_kill:.1f}s after the kill; group {writer} committed "
            f"{sum(e['committed'] for e in during)} steps meanwhile")
        codes = job.wait(opts.timeout)
        say(f"5. the run ended: exit status by group {codes}")
        digests = {}
        for g in (0, 1):
            d = [e for e in job.events(g) if e["kind"] == "ft_replica_digest"]
            digests[g] = {k: d[-1][k] for k in ("step", "model", "optim", "rng", "trainer")} \
                if d else None
        identical = digests[0] is not None and digests[0] == digests[1]
        say(f"   replica digests at the end: {digests[0]} (group 0), {digests[1]} (group 1)")
        say("6. ckpt verify of the durable root")
        verify = subprocess.run([sys.executable, "-m", "ckpt", "verify", str(root)], cwd=REPO,
                                env=env, capture_output=True, text=True)
        print(verify.stdout.strip() or verify.stderr.strip(), flush=True)
        committed = CheckpointStore(str(root)).committed_steps()
        result = {
            "recovery_seconds": round(back["time"] - t_kill, 2),
            "healthy_steps_during_outage": sum(e["committed"] for e in during),
            "replicas_identical": identical,
            "durable_verified": verify.returncode == 0,
            "killed_group": victim, "writer_group": writer, "killed_at_step": at,
            "rejoined_at_step": healed["step"],
            "heal_transfer_seconds": round(healed["seconds"], 3),
            "restart_to_rejoin_seconds": healed["process_seconds"] and
            round(healed["process_seconds"], 2),
            "healthy_uncommitted_steps_during_outage": sum(not e["committed"] for e in during),
            "healthy_longest_step_seconds": longest and round(longest, 2),
            "steps": opts.steps, "final_checkpoint": committed[-1] if committed else None,
            "exit_codes": codes,
        }
    except Exception as exc:  # noqa: BLE001 - the JSON line says what failed
        print(job.tails(2000), file=sys.stderr)
        result = {"recovery_seconds": None, "healthy_steps_during_outage": None,
                  "replicas_identical": False, "durable_verified": False,
                  "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
    finally:
        job.stop()
    print(json.dumps(result), flush=True)
    ok = result.get("replicas_identical") and result.get("durable_verified") and \
        result.get("exit_codes") == {0: 0, 1: 0}
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
