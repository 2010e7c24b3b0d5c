"""Run a test body on N real processes joined in a gloo process group.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes; each one calls
``init_process_group(backend)`` over a TCP rendezvous on loopback, runs
``fn(rank, world_size, *args)``, and reports its result or traceback back to the parent.
The parent raises one error that lists every failing rank. ``fn`` must be a module-level
function (it is pickled by reference into the spawned processes).

``backend="cuda:gloo"`` starts a default group with no CPU backend, as NCCL's is on a GPU
host: a collective on CPU tensors over it raises "No backend type associated with device
type cpu", as it would under NCCL, while groups made with ``new_group(backend="gloo")`` work.

Ranks are forked from a forkserver that has imported torch, ckpt and the trainer once per
test process (``multiprocessing``'s own mechanism; a fresh interpreter per rank spent about
4 s of CPU importing them, most of a short multi-rank test). Each rank is still a fresh,
single-threaded process: the server only imports, and a rank takes the parent's current
environment and working directory, as a spawned one would.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import socket
import traceback
from typing import Any, Callable

__all__ = ["run_ranks", "free_port"]


_PORTS_LOW, _PORTS_HIGH = 12000, 32000  # below Linux's ephemeral range (32768-60999)
_PORT_SPAN = 8  # ports free from the one returned on: a job's ranks use port + rank
_next_port: list[int] = []


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, with the next ``_PORT_SPAN - 1`` free too
    (the metrics of rank r listen on port + r).

    Taken below the kernel's ephemeral range, so that no outgoing connection (a gloo pair, an
    HTTP client) is given it before its listener binds, and from a range of its own per
    pytest-xdist worker, so that parallel tests do not pick the same one; within it, each
    process starts at a random offset and moves on."""
    if not _next_port:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
        index = int(worker[2:]) if worker[2:].isdigit() else 0
        width = (_PORTS_HIGH - _PORTS_LOW) // 8
        low = _PORTS_LOW + (index % 8) * width
        _next_port.extend([low, low + width - _PORT_SPAN,
                           low + random.randrange(0, width - _PORT_SPAN, _PORT_SPAN)])
    low, high, port = _next_port
    for _ in range((high - low) // _PORT_SPAN):
        base = port
        port = port + _PORT_SPAN if port + _PORT_SPAN <= high else low
        try:
            for p in range(base, base + _PORT_SPAN):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        _next_port[2] = port
        return base
    raise RuntimeError(f"no {_PORT_SPAN} consecutive free ports in {low}-{high}")


# Imported once in the forkserver; a rank forked from it starts with them loaded.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint",
            "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
            "torch.distributed.pipelining", "ckpt", "monitoring", "trainer.train"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(fn, rank, world_size, port, args, queue, env, backend, parent_env, cwd):
    # A spawned process would have the parent's environment and directory of now; the
    # forkserver has those of when it started.
    os.environ.clear()
    os.environ.update(parent_env)
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
        )
        result = fn(rank, world_size, *args)
        # Under "cuda:gloo" the default group cannot run a CPU barrier: a gloo group can.
        dist.barrier(group=None if backend == "gloo" else dist.new_group(backend="gloo"))
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
    # Flush the result to the parent before leaving: os._exit would kill the queue's feeder
    # thread with the result still in its buffer.
    queue.close()
    queue.join_thread()
    # Leave without running interpreter finalizers: a gloo worker thread releasing a
    # tensor during finalization can abort the process (see PLATFORM.md).
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    backend: str = "gloo",
    kill_all_on_death: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks joined in a default group
    of ``backend`` (``"cuda:gloo"``: one without a CPU backend); return results by rank.

    ``kill_all_on_death``: when a rank dies without reporting (a test that SIGKILLs one),
    kill every other rank at once, as torchrun's agent tears a job down (else they are
    given a moment to finish, then stopped); the error then lists each rank's end."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, args, queue, dict(env or {}), backend,
                  dict(os.environ), os.getcwd()),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    import queue as _queue
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
                results[rank] = (status, payload)
            except _queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and len(results) < world_size:
                    # A rank died without reporting: give the others a moment, then stop.
                    dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if kill_all_on_death and any(i not in results for i in dead):
                        for i, p in enumerate(procs):
                            if p.is_alive():
                                p.kill()
                                p.join()
                                results.setdefault(i, ("error", "killed: another rank died"))
                        for i in dead:
                            results.setdefault(
                                i, ("error", f"process exited with code {procs[i].exitcode}"))
                        break
                    if all(i not in results for i in dead):
                        time.sleep(2.0)
                        while not queue.empty():
                            rank, status, payload = queue.get()
                            results[rank] = (status, payload)
                        for i in dead:
                            results.setdefault(
                                i, ("error", f"process exited with code {procs[i].exitcode}")
                            )
                        break
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    errors = []
    for rank in range(world_size):
        status, payload = results.get(rank, ("error", f"no result within {timeout:.0f}s (hung?)"))
        if status != "ok":
            errors.append(f"--- rank {rank} ---\n{payload}")
    if errors:
        raise AssertionError(f"{len(errors)} of {world_size} ranks failed:\n" + "\n".join(errors))
    return [results[r][1] for r in range(world_size)]
