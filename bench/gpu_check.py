"""GPU check: what a save costs the training loop on a GPU, that a GPU job resumes exactly,
and that staged sharded state is a host copy of the live shards.

One command, under 8 minutes on one GPU; on a machine without CUDA it prints that it
skipped and exits 0 at once::

    bash scripts/gpu_check.sh            # = python bench/gpu_check.py [--sizes 1,4 ...]

Sections, in this order (``--only train,dtensor,devices,metrics,stall``):

* **train**: the trainer (``configs/tiny.toml``, bf16, FSDP2, ``training.deterministic`` at
  its default, on) under torchrun on 1 GPU with checkpoints: an uninterrupted run, and a
  run SIGKILLed after its first commit and then resumed; their final checkpoints must be
  equal bit for bit and their losses equal. The launches record every process group's
  backend, ``group_desc`` and creating module (bench/_gpu_groups.py): NCCL for the training
  group, gloo for the checkpoint store's groups (at least the manager's two), which are
  known by their ``group_desc`` (``ckpt_*``) or by a creator in the ``ckpt`` package.
* **dtensor** (bench/_gpu_dtensor.py, under torchrun on 1 GPU, and on 2 where two are
  present): an FSDP2-sharded MLP (fp32, uneven shards on 2 ranks) and a tensor-parallel one
  (bf16), one AdamW step each; their model and optimizer state (DTensors) staged with
  ``ckpt.dcp.staging.StagingBuffers`` while the training stream changes every parameter right
  after the stage, and saved by a ``CheckpointManager`` (``block=True``) then loaded back.
  Every staged tensor must hold the source's local bytes from before the change, every
  staged DTensor the source's mesh, placements and global shape around a local tensor on
  the host, the GPU memory allocated must not grow by the staged copy (1 MiB or 1 % of it
  at most), and the loaded checkpoint must equal the saved state bit for bit.
* **devices** (bench/_gpu_devices.py, under torchrun on 2 ranks, every GPU visible to each;
  skipped, and said so, on a machine with one GPU): each rank selects its own GPU and saves
  a state on it through a ``CheckpointManager``, once without ``prepare()`` (the first
  ``maybe_save`` allocates and page-locks the staging buffers on the persist thread) and
  once with it, and once without it through a writer process (``writer="process"``: the
  shared block page-locked on the persist thread; the writer must see no GPU and hold no
  memory on any), each in fresh processes. After the buffers are allocated, after the save
  committed and after ``close``, a rank's process must hold no CUDA context on the other
  GPU (asked of the driver) and NVML must list no memory of its pid there (rank 1: none on
  GPU 0).
* **metrics** (bench/_gpu_metrics.py, the trainer under torchrun on 1 GPU, and on 2 where two
  are present, each rank's ``/metrics`` read while it trains): every rank must serve its GPU
  known to NVML (``train_gpu_known`` 1, needs ``pip install 'ckpt[nvml]'``) with a UUID, and
  non-zero temperature, power, utilization, NVML memory, allocator bytes (allocated,
  reserved, peak) and device memory; on 2 GPUs (the model a mixture of experts on ep2),
  non-zero bytes and seconds of FSDP2's all-gathers and reduce-scatters and of the experts'
  all-to-alls.
* **stall** (1 and 4 GiB, bf16 and fp32 tensors on the GPU; a warm-up round, then
  ``--repeats`` interleaved rounds, every ratio the median of per-round ratios; cases that
  would start after 390 s are skipped, to stay within the 8 minutes):
  ``CheckpointManager.save`` (its ``save_staged`` stall, the time until ``save()`` returns,
  the time the training stream waits on the device for the side-stream copies, and their
  device time ``copy_seconds``), also with ~50 ms of GPU work queued before the save;
  against the floor, a pinned device-to-host copy into preallocated buffers
  (``torch.empty(pin_memory=True)`` + ``copy_(non_blocking=True)`` + synchronize), and
  ``torch.distributed.checkpoint.async_save`` with DCP's pinned-memory stager
  (``DefaultStager(StagingOptions(use_pinned_memory=True, ...))``), synchronous staging
  (time until it returns) and asynchronous staging (until its staging completes, which a
  loop must wait for before the next optimizer step).

``--train-device cpu``, ``--dtensor-device cpu``, ``--devices-device cpu`` and
``--metrics-device cpu`` run those sections' harness on CPU (gloo everywhere, 1 and 2 ranks
for dtensor, 2 for devices and metrics, no GPU memory measured; metrics: the GPU series
unknown, the host's known); tests/test_gpu_check_harness.py and
tests/monitoring/test_gpu_metrics_check.py do.

Results: ``bench/results/gpu_check.json`` and ``gpu_check.md`` (``--out``). Exit status 1
when a check fails (resume not bit for bit, a wrong backend, a staged copy that differs or
holds GPU memory, a rank's context or memory on another GPU, a GPU series unknown or zero),
0 otherwise.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_BACKENDS_ENV = "GPU_CHECK_BACKENDS"  # set: this file runs as the trainer (below)
GiB = 1 << 30


if os.environ.get(_BACKENDS_ENV) and __name__ == "__main__":
    # This file runs as the trainer (the train section's launches): record every process
    # group's backend and creator, in the file named by $GPU_CHECK_BACKENDS.
    from _gpu_groups import run_trainer_recording_groups

    here = Path(__file__).resolve().parent  # run as a script: bench/ is first on the path
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    run_trainer_recording_groups(os.environ[_BACKENDS_ENV])
    sys.exit(0)

import torch  # noqa: E402

for _p in (str(ROOT / "bench"), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)


def _log(*a) -> None:
    print(*a, flush=True)


# -- stall -------------------------------------------------------------------------------------
def _gpu_state(nbytes: int, dtype: torch.dtype, num_tensors: int = 64) -> dict[str, Any]:
    """A model-like state of ~``nbytes`` on the GPU: matrices of varied widths, one tensor in
    four a small vector (as ``_common.make_state``, made on the device)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    elem = torch.empty((), dtype=dtype).element_size()
    total = nbytes // elem
    num_vec = num_tensors // 4
    vec = 4096
    widths = [4096, 1024, 3072, 2048, 512, 8192]
    weights = [1.0 + 7.0 * ((i * 2654435761) % 1000) / 1000.0 for i in range(num_tensors - num_vec)]
    budget = total - num_vec * vec
    model: dict[str, torch.Tensor] = {}
    for i, w in enumerate(weights):
        n = max(1, int(budget * w / sum(weights)))
        cols = widths[i % len(widths)]
        model[f"layers.{i}.proj.weight"] = torch.randn(max(1, n // cols), cols, device="cuda",
                                                       dtype=dtype, generator=gen)
    for i in range(num_vec):
        model[f"layers.{i}.norm.weight"] = torch.randn(vec, device="cuda", dtype=dtype,
                                                       generator=gen)
    return {"model": model, "extra": {"step": 1, "note": "gpu_check"}}


def _tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    return list(state["model"].values())


def _stall_case(work: Path, nbytes: int, dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from _common import Contender, interleave
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from ckpt.job import CheckpointManager, KeepLast, ManagerOptions

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist
    state = _gpu_state(nbytes, dtype)
    tensors = _tensors(state)
    real = sum(t.numel() * t.element_size() for t in tensors)
    floor_bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for b in floor_bufs:
        b.view(-1)[:: max(1, 4096 // b.element_size())].zero_()
    mgr = CheckpointManager(str(work / "ours"), ManagerOptions(use_lease=False),
                            retention=[KeepLast(1)])
    dcp_sync = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                            use_async_staging=False, use_non_blocking_copy=True))
    dcp_async = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                             use_async_staging=True, use_non_blocking_copy=True))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    step = [0]

    def floor() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b, t in zip(floor_bufs, tensors):
            b.copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def ours(busy: bool) -> dict[str, float]:
        torch.cuda.synchronize()
        if busy:  # ~50 ms of queued training work that the copies must wait for
            for _ in range(32):
                a.matmul(a)
        before = torch.cuda.Event(enable_timing=True)
        after = torch.cuda.Event(enable_timing=True)
        before.record()
        step[0] += 1
        t0 = time.perf_counter()
        mgr.save(step[0], state)
        returned = time.perf_counter() - t0
        after.record()  # runs once the training stream's wait for the copies is over
        after.synchronize()
        mgr.wait()
        staged = mgr.events.of_kind("save_staged")[-1].fields
        committed = mgr.events.of_kind("save_committed")[-1].fields
        return {"": returned, "stall": staged["stall_seconds"],
                "stream_wait": before.elapsed_time(after) / 1e3,
                "copy": committed.get("copy_seconds") or float("nan")}

    def dcp_run(stager, asynchronous: bool) -> dict[str, float]:
        path = work / f"dcp_{step[0]}_{int(asynchronous)}"
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        resp = dcp.async_save(state, checkpoint_id=str(path), async_stager=stager, no_dist=True)
        returned = time.perf_counter() - t0
        out = {"": returned}
        if asynchronous:
            resp.staging_completion.result()
            out["staged"] = time.perf_counter() - t0
            resp.upload_completion.result()
        else:
            resp.result()
        shutil.rmtree(path, ignore_errors=True)
        return out

    contenders = [
        Contender("floor", floor),
        Contender("ours", lambda: ours(False)),
        Contender("ours_busy", lambda: ours(True)),
        Contender("dcp_pinned", lambda: dcp_run(dcp_sync, False)),
        Contender("dcp_pinned_async", lambda: dcp_run(dcp_async, True)),
    ]
    try:
        samples = interleave(contenders, repeats, log=_log, warmup=1)
    finally:
        mgr.close()
        dcp_sync.close()
        dcp_async.close()
    errors = {c.name: c.error for c in contenders if c.error}
    return {"bytes": real, "dtype": str(dtype).replace("torch.", ""), "samples": samples,
            "errors": errors}


def _summarise_stall(case: dict[str, Any]) -> dict[str, Any]:
    from _common import median, paired_ratio

    s = case["samples"]
    get = lambda k: s.get(k, [])  # noqa: E731
    return {
        "floor_ms": _ms(median(get("floor"))),
        "ours_stall_ms": _ms(median(get("ours.stall"))),
        "ours_return_ms": _ms(median(get("ours"))),
        "ours_busy_stall_ms": _ms(median(get("ours_busy.stall"))),
        "stream_wait_ms": _ms(median(get("ours.stream_wait"))),
        "stream_wait_busy_ms": _ms(median(get("ours_busy.stream_wait"))),
        "copy_ms": _ms(median(get("ours.copy"))),
        "dcp_pinned_ms": _ms(median(get("dcp_pinned"))),
        "dcp_async_staged_ms": _ms(median(get("dcp_pinned_async.staged"))),
        "stall_vs_floor": paired_ratio(get("ours.stall"), get("floor")),
        "stall_vs_dcp": paired_ratio(get("ours.stall"), get("dcp_pinned")),
        "stall_vs_dcp_async": paired_ratio(get("ours.stall"), get("dcp_pinned_async.staged")),
        "stream_wait_vs_floor": paired_ratio(get("ours.stream_wait"), get("floor")),
    }


def _empty_host_cache() -> None:
    """Release cached pinned blocks (the host allocator keeps them otherwise: 4 cases of
    up to 4 pinned copies each would pile up)."""
    try:
        torch.accelerator.memory.empty_host_cache()
    except (AttributeError, RuntimeError):  # older torch; no accelerator
        pass


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 2)


# -- train: kill and resume under torchrun ----------------------------------------------------
def _train_check(work: Path, steps: int, interval: int, device: str = "cuda") -> dict[str, Any]:
    from _gpu_groups import check_backends

    from tests.e2e._jobs import Job, assert_same_checkpoint, base_env, loss_history, trainer_argv

    backends = work / "backends.jsonl"
    # No CUBLAS_WORKSPACE_CONFIG here: the trainer's training.deterministic sets it, and
    # that is what this check is to show.
    env = base_env(**{_BACKENDS_ENV: str(backends)})
    common = (f"--training.device={device}", "--training.mixed_precision=bf16",
              "--parallel.dp_mode=fsdp", f"--training.steps={steps}",
              f"--checkpoint.interval={interval}", "--checkpoint.keep_last=0")

    def job(name: str, root: Path, jsonl: Path) -> Job:
        argv = trainer_argv(*common, f"--checkpoint.root={root}", f"--metrics.jsonl_path={jsonl}",
                            nproc=1, script=Path(__file__).resolve())
        return Job(argv, work / "logs", name, jsonl, env=env)

    out: dict[str, Any] = {"device": device, "steps": steps, "interval": interval, "ok": False}
    ref_root, ref_jsonl = work / "straight", work / "straight.jsonl"
    t0 = time.monotonic()
    ref = job("straight", ref_root, ref_jsonl).wait_ok(timeout=240)
    out["straight_seconds"] = round(time.monotonic() - t0, 1)
    root, jsonl = work / "resumed", work / "resumed.jsonl"
    first = job("killed", root, jsonl)
    first.wait_event(lambda e: e["kind"] == "save_committed", 180, "the first commit")
    first.kill_all()
    killed_at = max((e["step"] for e in first.events() if e["kind"] == "train_step"), default=0)
    out["killed_after_step"] = killed_at
    if first.proc.returncode != -9 or killed_at >= steps:
        out["error"] = (f"the job was not killed mid-run (exit {first.proc.returncode}, "
                        f"step {killed_at})")
        return out
    second = job("resumed", root, jsonl).wait_ok(timeout=240)
    resumed = [line for line in second.stderr.splitlines() if "resumed from" in line]
    out["resume_line"] = resumed[-1].split("trainer: ", 1)[-1].strip() if resumed else None
    ref_loss, got_loss = loss_history(ref.events()), loss_history(second.events())
    out["losses_equal"] = ref_loss == got_loss
    try:
        out["num_tensors_equal"] = assert_same_checkpoint(ref_root, root, steps)
        out["bit_for_bit"] = True
    except AssertionError as exc:
        out["bit_for_bit"] = False
        out["error"] = str(exc)[:2000]
    records = [json.loads(x) for x in backends.read_text().splitlines() if x.strip()]
    out.update(check_backends(records, device))
    out["ok"] = bool(out["bit_for_bit"] and out["losses_equal"] and out["resume_line"]
                     and out["backends_ok"])
    return out


# -- the sections whose ranks run under torchrun ----------------------------------------------
def _launch_ranks(script: str, run_dir: Path, world: int, *args: str,
                  timeout: float = 240.0) -> dict[str, Any]:
    """``bench/<script> RUN_DIR ARGS...`` under torchrun on ``world`` ranks (every GPU
    visible to each): its exit status, time and the ``rank*.json`` its ranks wrote; ``ok``
    when it exited 0 with every rank's file saying ok (else the log's tail too)."""
    import signal
    import subprocess

    from tests.e2e._jobs import base_env

    run_dir.mkdir(parents=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(world), str(ROOT / "bench" / script), str(run_dir), *args]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, env=base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        from trainer.ft.local import worker_pids

        workers = list(worker_pids(proc.pid).values())  # in sessions of their own
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log, _ = proc.communicate()
        log += f"\n(killed after {timeout:.0f} s)"
    ranks = [json.loads(f.read_text()) for f in sorted(run_dir.glob("rank*.json"))]
    entry: dict[str, Any] = {"world": world, "exit": proc.returncode,
                             "seconds": round(time.monotonic() - t0, 1), "ranks": ranks}
    entry["ok"] = proc.returncode == 0 and len(ranks) == world and all(r["ok"] for r in ranks)
    if not entry["ok"]:
        entry["log_tail"] = log[-4000:]
    return entry


# -- dtensor: staged FSDP2 and TP shards --------------------------------------------------------
def _dtensor_check(work: Path, device: str, world_sizes: list[int]) -> list[dict[str, Any]]:
    """bench/_gpu_dtensor.py under torchrun, once per world size; one entry each."""
    return [{"device": device, **_launch_ranks("_gpu_dtensor.py", work / f"ranks_{world}",
                                               world, device)}
            for world in world_sizes]


# -- devices: a rank's save stays on its own GPU ----------------------------------------------
def _devices_check(work: Path, device: str) -> dict[str, Any]:
    """bench/_gpu_devices.py on 2 ranks, once per scenario (a fresh process each: a context
    one scenario left on GPU 0 would hide the other's); skipped below 2 GPUs."""
    from _gpu_devices import SCENARIOS

    if device == "cuda" and torch.cuda.device_count() < 2:
        return {"skipped": f"needs 2 GPUs, this machine has {torch.cuda.device_count()}",
                "ok": True, "scenarios": []}
    scenarios = [{"scenario": name, "device": device,
                  **_launch_ranks("_gpu_devices.py", work / name, 2, device, name)}
                 for name in SCENARIOS]
    return {"skipped": None, "ok": all(e["ok"] for e in scenarios), "scenarios": scenarios}


def _devices_rows(results: dict[str, Any]) -> list[str]:
    lines = ["A rank's save on its own GPU: what each rank of 2 left on the other GPU (a CUDA "
             "context of its process, or memory NVML lists for its pid) after the buffers "
             "were allocated, the save committed and the manager closed; without `prepare()` "
             "(the first `maybe_save` allocates on the persist thread), with it, and "
             "without it through a writer process (which must see no GPU).", ""]
    if results.get("skipped"):
        return lines + [f"Skipped: {results['skipped']}.", ""]
    lines += ["| scenario | rank | device | result |", "|---|---|---|---|"]
    for entry in results["scenarios"]:
        for rank in entry["ranks"]:
            verdict = "PASS" if rank["ok"] else "FAIL: " + "; ".join(rank["problems"])[:300]
            lines.append(f"| {entry['scenario']} | {rank['rank']} | {rank.get('device', '-')} "
                         f"| {verdict} |")
        if len(entry["ranks"]) < entry["world"] or entry["exit"] != 0:
            lines.append(f"| {entry['scenario']} | - | - | **FAIL** (exit {entry['exit']}): "
                         f"{entry.get('log_tail', '')[-300:]!r} |")
    return lines + [""]


def _dtensor_rows(entry: dict[str, Any]) -> list[str]:
    """One table row per rank and layout."""
    from _common import fmt_bytes

    rows = []
    for rank in entry["ranks"]:
        for name, r in rank["layouts"].items():
            if "error" in r:
                rows.append(f"| {entry['world']} | {rank['rank']} | {name} | - | - | - | - | - "
                            f"| **FAIL**: {r['error'][:200]} |")
                continue
            st, mg, ld = r["stage"], r["manager"], r["loaded"]
            held = [x for x in (st["held_gpu_bytes"], mg["held_gpu_bytes"]) if x is not None]
            problems = st["problems"] + mg["problems"] + ld["problems"]
            rows.append(
                f"| {entry['world']} | {rank['rank']} | {name} | "
                f"{fmt_bytes(st['staged_bytes'])}, {st['num_tensors']} tensors | "
                f"{st['num_problems']} | {'-' if not held else fmt_bytes(max(held))} | "
                f"{mg['num_problems']} | {ld['num_problems']} | "
                f"{'PASS' if r['ok'] else 'FAIL: ' + '; '.join(problems)[:300]} |")
    if not entry["ok"] and all("PASS" in row for row in rows):  # the launch itself failed
        rows.append(f"| {entry['world']} | - | - | - | - | - | - | - | **FAIL** (exit "
                    f"{entry['exit']}): {entry.get('log_tail', '')[-300:]!r} |")
    return rows


# -- report ------------------------------------------------------------------------------------
def _fmt(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _markdown(results: dict[str, Any]) -> str:
    from _common import fmt_bytes

    lines = [f"# GPU check ({results['device']}, torch {results['torch']})", ""]
    if results.get("stall"):
        lines += ["Staging stall, ms (median of rounds; ratios: median of per-round ratios). "
                  "stall: what the training thread waited in the save (`save_staged`); "
                  "training stream waits: device time from just before the save to the "
                  "training stream's next kernel; GPU busy: ~50 ms of matmuls queued first; "
                  "floor: pinned `copy_(non_blocking=True)` + synchronize; DCP: "
                  "`async_save` with its pinned stager (async: until staging completes).", "",
                  "| state | floor: pinned copy | ours: stall | ours: save() returns | "
                  "training stream waits | copies (device) | ours, GPU busy: stall / stream wait "
                  "| DCP pinned | DCP pinned async, staged | stall / floor | stall / DCP | "
                  "stall / DCP async | stream wait / floor |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for case in results["stall"]:
            r = case["summary"]
            lines.append(
                f"| {fmt_bytes(case['bytes'])} {case['dtype']} | {_fmt(r['floor_ms'])} | "
                f"{_fmt(r['ours_stall_ms'])} | {_fmt(r['ours_return_ms'])} | "
                f"{_fmt(r['stream_wait_ms'])} | {_fmt(r['copy_ms'])} | "
                f"{_fmt(r['ours_busy_stall_ms'])} / {_fmt(r['stream_wait_busy_ms'])} | "
                f"{_fmt(r['dcp_pinned_ms'])} | {_fmt(r['dcp_async_staged_ms'])} | "
                f"{_fmt(r['stall_vs_floor'], '{:.3f}x')} | {_fmt(r['stall_vs_dcp'], '{:.3f}x')} | "
                f"{_fmt(r['stall_vs_dcp_async'], '{:.3f}x')} | "
                f"{_fmt(r['stream_wait_vs_floor'], '{:.3f}x')} |")
            for name, err in case["errors"].items():
                lines.append(f"\n! {name} failed: {err}")
        lines.append("")
    if results.get("dtensor"):
        lines += ["Staged DTensors, FSDP2 (fp32) and TP (bf16), per rank: problems found in "
                  "the copy `StagingBuffers.stage` made while the training stream changed the "
                  "parameters right after it (bytes, mesh, placements, local tensor on the "
                  "host), GPU memory still allocated with the staged copies alive (stage or "
                  "manager, the larger), in `CheckpointManager.save`'s staged copy, and in "
                  "the checkpoint loaded back.", "",
                  "| ranks | rank | layout | staged | stage: problems | GPU memory held | "
                  "manager: problems | loaded: problems | result |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for entry in results["dtensor"]:
            lines += _dtensor_rows(entry)
        lines.append("")
    if results.get("devices"):
        lines += _devices_rows(results["devices"])
    if results.get("metrics"):
        from _gpu_metrics import rows as metrics_rows

        lines += metrics_rows(results["metrics"])
    t = results.get("train")
    if t:
        lines += [f"Trainer, bf16 FSDP2, torchrun with 1 rank on {t['device']}, SIGKILL after "
                  "the first commit, resume",
                  "", "| check | result |", "|---|---|",
                  f"| killed after step | {t.get('killed_after_step')} of {t['steps']} |",
                  f"| resumed | {t.get('resume_line') or '-'} |",
                  f"| final checkpoint bit for bit | {t.get('bit_for_bit')} "
                  f"({t.get('num_tensors_equal', 0)} tensors) |",
                  f"| losses equal | {t.get('losses_equal')} |",
                  f"| backends: training / manager | {t.get('training_backends')} / "
                  f"{t.get('manager_backends')} ({'ok' if t.get('backends_ok') else 'WRONG'}) |",
                  f"| **{'PASS' if t['ok'] else 'FAIL'}** | {t.get('error', '')[:300]} |", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,4", help="state sizes in GiB (default 1,4)")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds after a warm-up")
    p.add_argument("--only", default="train,dtensor,devices,metrics,stall",
                   help="sections to run (default train,dtensor,devices,metrics,stall)")
    p.add_argument("--steps", type=int, default=300, help="trainer steps per run")
    p.add_argument("--interval", type=int, default=25, help="trainer checkpoint interval")
    p.add_argument("--dir", default=None, help="work folder (default: /dev/shm if large "
                   "enough, else the temp folder)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--train-device", default="cuda", help="'cpu' checks the train section's "
                   "harness without a GPU (gloo expected instead of NCCL)")
    p.add_argument("--dtensor-device", default="cuda", help="'cpu' checks the dtensor "
                   "section's harness without a GPU (on 1 and 2 gloo ranks)")
    p.add_argument("--devices-device", default="cuda", help="'cpu' checks the devices "
                   "section's harness without a GPU (2 gloo ranks, nothing to measure)")
    p.add_argument("--metrics-device", default="cuda", help="'cpu' checks the metrics "
                   "section's harness without a GPU (2 gloo ranks: the GPU series unknown)")
    args = p.parse_args(argv)
    only = set(args.only.split(","))
    harness = (only <= {"train", "dtensor", "devices", "metrics"}
               and ("train" not in only or args.train_device == "cpu")
               and ("dtensor" not in only or args.dtensor_device == "cpu")
               and ("devices" not in only or args.devices_device == "cpu")
               and ("metrics" not in only or args.metrics_device == "cpu"))
    if not harness and not torch.cuda.is_available():
        _log(f"gpu_check: skipped: no CUDA device here (torch {torch.__version__}, "
             f"cuda {torch.version.cuda})")
        return 0
    sizes = [float(s) for s in args.sizes.split(",") if s]
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    base = args.dir
    if base is None:
        need = 3 * max(sizes, default=1) * GiB
        shm = "/dev/shm"
        base = shm if os.path.isdir(shm) and shutil.disk_usage(shm).free > need else None
    work = Path(tempfile.mkdtemp(prefix="gpu_check_", dir=base))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results: dict[str, Any] = {"device": device, "torch": torch.__version__,
                               "work_dir": str(work), "stall": [], "train": None,
                               "dtensor": [], "devices": None, "metrics": None}
    t_start = time.monotonic()
    ok = True
    try:
        if "train" in only:
            _log("== train: kill and resume, bf16 FSDP2 under torchrun, 1 rank on "
                 + args.train_device)
            results["train"] = t = _train_check(work / "train", args.steps, args.interval,
                                                args.train_device)
            ok &= t["ok"]
            _log(json.dumps(t, indent=1))
        if "dtensor" in only:
            if args.dtensor_device == "cuda":  # a second variant where two GPUs are
                worlds = [1, 2] if torch.cuda.device_count() >= 2 else [1]
            else:
                worlds = [1, 2]
            _log(f"== dtensor: staged FSDP2 and TP shards, {' and '.join(map(str, worlds))} "
                 f"rank(s) on {args.dtensor_device}")
            results["dtensor"] = _dtensor_check(work / "dtensor", args.dtensor_device, worlds)
            ok &= all(e["ok"] for e in results["dtensor"])
            _log(json.dumps(results["dtensor"], indent=1, default=str)[:20000])
        if "devices" in only:
            _log(f"== devices: a rank's save leaves nothing on another GPU, 2 ranks on "
                 f"{args.devices_device}")
            results["devices"] = d = _devices_check(work / "devices", args.devices_device)
            if d["skipped"]:
                _log(f"== devices: skipped: {d['skipped']}")
            ok &= d["ok"]
            _log(json.dumps(d, indent=1, default=str)[:20000])
        if "metrics" in only:
            from _gpu_metrics import metrics_check

            if args.metrics_device == "cuda":
                world = 2 if torch.cuda.device_count() >= 2 else 1
            else:
                world = 2
            _log(f"== metrics: the hardware and communication series, {world} rank(s) on "
                 f"{args.metrics_device}")
            results["metrics"] = m = metrics_check(work / "metrics", args.metrics_device, world)
            ok &= m["ok"]
            _log(json.dumps(m, indent=1, default=str)[:20000])
        if "stall" in only:
            for size in sizes:
                for name in args.dtypes.split(","):
                    if time.monotonic() - t_start > 390:
                        _log(f"== stall {size} GiB {name}: skipped, out of the time budget")
                        continue
                    _log(f"== stall {size} GiB {name}")
                    case_dir = work / f"stall_{size}_{name}"
                    case_dir.mkdir(parents=True)
                    case = _stall_case(case_dir, int(size * GiB), dtypes[name], args.repeats)
                    case["summary"] = _summarise_stall(case)
                    results["stall"].append(case)
                    shutil.rmtree(case_dir, ignore_errors=True)
                    gc.collect()  # give the case's GPU and pinned memory back
                    torch.cuda.empty_cache()
                    _empty_host_cache()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["seconds"] = round(time.monotonic() - t_start, 1)
    results["ok"] = ok
    md = _markdown(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "gpu_check.md").write_text(md + "\n")
    _log(md)
    _log(f"gpu_check: {'PASS' if ok else 'FAIL'} in {results['seconds']} s; "
         f"results in {out}/gpu_check.json and gpu_check.md")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
