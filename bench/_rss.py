"""Peak and steady resident memory of a save, each contender in a fresh process.

``run_rss`` starts ``python bench/_rss.py worker MODE ...`` once per mode. The worker
builds the state, imports everything, then takes its baseline (VmRSS) and resets the peak
(``echo 5 > /proc/self/clear_refs``; if that is refused the peak includes start-up). Then:

* ``ours``: one async ``CheckpointManager``, ``--rss-saves`` saves, each followed by
  ``wait()``; VmRSS after every save (growth = last - second; the first save allocates the
  staging buffers).
* ``ours_load`` / ``dcp_load``: one save (untimed), reset the peak, then ``ckpt.load``
  (verify full) / ``dcp.load`` into the live state.
* ``dcp_save``, ``dcp_async``, ``torch_save``: three saves each, for comparison.

Extra RSS = VmHWM - baseline; reported as a multiple of the shard (the state's tensor bytes).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODES = ("ours", "ours_load", "dcp_load", "dcp_save", "dcp_async", "torch_save")


def rss_status() -> dict[str, int]:
    """This process's resident memory now (``VmRSS``) and its peak (``VmHWM``), in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    return out


def reset_rss_peak() -> bool:
    """Start ``VmHWM`` over from the current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def worker(mode: str, size_bytes: int, num_tensors: int, num_saves: int, work: str) -> dict:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from _common import make_state, state_nbytes

    from ckpt.dcp import api
    from ckpt.job import CheckpointManager, KeepLast

    warnings.filterwarnings("ignore")
    if int(os.environ.get("BENCH_TORCH_THREADS", "0")) > 0:
        torch.set_num_threads(int(os.environ["BENCH_TORCH_THREADS"]))
    state = make_state(size_bytes, num_tensors)
    shard = state_nbytes(state)
    root = os.path.join(work, mode)
    if mode == "ours_load":
        api.save(state, root, 1)
    elif mode == "dcp_load":
        dcp.save(state, storage_writer=dcp.FileSystemWriter(root, thread_count=4), no_dist=True)
    gc.collect()
    base = rss_status()["VmRSS"]
    reset = reset_rss_peak()
    rss: list[int] = []
    if mode == "ours":
        mgr = CheckpointManager(root, retention=[KeepLast(1)])
        for step in range(1, num_saves + 1):
            mgr.save(step, state)
            mgr.wait()
            gc.collect()
            rss.append(rss_status()["VmRSS"])
        mgr.close()
    elif mode == "ours_load":
        api.load(state, root, 1, verify="full")
        rss.append(rss_status()["VmRSS"])
    elif mode == "dcp_load":
        dcp.load(state, storage_reader=dcp.FileSystemReader(root), no_dist=True)
        rss.append(rss_status()["VmRSS"])
    else:
        for i in range(num_saves):
            path = os.path.join(root, str(i))
            if mode == "dcp_save":
                dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=4),
                         no_dist=True)
            elif mode == "dcp_async":
                dcp.async_save(state, storage_writer=dcp.FileSystemWriter(
                    path, thread_count=4), no_dist=True).result()
            else:
                os.makedirs(root, exist_ok=True)
                with open(path, "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())
            gc.collect()
            rss.append(rss_status()["VmRSS"])
    peak = rss_status()["VmHWM"]
    return {"mode": mode, "shard_bytes": shard, "baseline_rss": base, "peak_rss": peak,
            "peak_reset": reset, "extra_peak_bytes": peak - base,
            "extra_peak_ratio": (peak - base) / shard if shard else None,
            "rss_after_each": rss,
            "growth_bytes": (rss[-1] - rss[1]) if len(rss) > 2 else None}


def run_rss(size_bytes: int, opts, work: str, log) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in opts.rss_modes:
        saves = opts.rss_saves if mode == "ours" else (1 if mode.endswith("_load") else 3)
        d = tempfile.mkdtemp(prefix=f"rss-{mode}-", dir=work)
        try:
            proc = subprocess.run(
                [sys.executable, os.path.join(HERE, "_rss.py"), "worker", mode,
                 str(size_bytes), str(opts.tensors), str(saves), d],
                capture_output=True, text=True, timeout=opts.rss_timeout,
                env=dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, REPO])))
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-1500:])
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            out[mode] = res
            log(f"  rss {mode}: extra peak {res['extra_peak_bytes'] / 2**20:.0f} MiB = "
                f"{res['extra_peak_ratio']:.2f}x shard"
                + (f", growth over {saves} saves {res['growth_bytes'] / 2**20:+.1f} MiB"
                   if res.get("growth_bytes") is not None else ""))
        except Exception as exc:  # noqa: BLE001
            out[mode] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"  ! rss {mode} failed: {exc}")
        finally:
            import shutil

            shutil.rmtree(d, ignore_errors=True)
    return out


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "worker":
        sys.path[:0] = [HERE, REPO]
        result = worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
                        sys.argv[6])
        print(json.dumps(result))
        sys.stdout.flush()
        os._exit(0)
    print(f"usage: {sys.argv[0]} worker MODE SIZE_BYTES NUM_TENSORS NUM_SAVES DIR",
          file=sys.stderr)
    sys.exit(2)
