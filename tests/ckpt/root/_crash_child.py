"""A saving process for tests/ckpt/root/test_crash.py, meant to be killed.

Run as ``python -m tests.ckpt.root._crash_child ROOT``. With ``WORLD_SIZE`` > 1 it joins a gloo
group (``RANK``, ``MASTER_PORT`` from the environment). It saves step 1, prints
``SAVED 1 <seconds>``, prints ``SAVING 2``, saves step 2 and prints ``SAVED 2``.

``CRASH_AT`` makes the process SIGKILL itself at a precise point of the step-2 save (on the
rank named by ``CRASH_RANK``, default every rank):

- ``before_commit``: right before the manifest is created;
- ``mid_write``: half-way through writing its second data file (the first half is on disk);
- ``after_commit``: after the manifest exists, before the attempt's marker is removed.

``CRASH_AFTER_FRACTION=f`` SIGKILLs the process (every rank) ``f`` times step 1's save
duration after step 2's save starts: a kill at a random point, timed inside the child so
that the test process's own scheduling delays do not skew it.

``CRASH_SLOW_SECONDS`` stretches every save (a pause before and after each data file and
before the commit), so that a kill after a random delay lands in every phase of a save.

The state saved at each step is a pure function of the step, so the test can rebuild it.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

NUM_SHARED = 6
NUM_OWN = 3
NUMEL = 1 << 15  # 128 KiB of float32 per tensor


def _tensor(step: int, key: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(step * 1000 + key))


def state_for(step: int, ranks) -> dict:
    """The state saved at ``step``: shared tensors, each rank's own tensors, a counter.

    ``ranks``: the ranks whose own tensors to include (one rank in a child, all of them when
    the test process loads the whole checkpoint).
    """
    state = {"shared": {f"w{i}": _tensor(step, i) for i in range(NUM_SHARED)},
             "meta": {"step": step, "note": f"state of step {step}"}}
    for r in ranks:
        state[f"r{r}"] = {f"v{i}": _tensor(step, 100 * (r + 1) + i) for i in range(NUM_OWN)}
    return state


def empty_state(ranks) -> dict:
    """A state of the same structure with zeros, to load into."""
    state = state_for(0, ranks)
    for key, value in state.items():
        if key != "meta":
            for t in value.values():
                t.zero_()
    state["meta"] = {"step": -1, "note": ""}
    return state


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _install_crash(point: str) -> None:
    from ckpt.storage import Storage

    if point == "before_commit":
        original_create = Storage.create_exclusive

        def create_exclusive(self, rel, data):
            if rel.endswith("/manifest.json"):
                _die()
            return original_create(self, rel, data)
        Storage.create_exclusive = create_exclusive
    elif point == "mid_write":
        original_write = Storage.write_buffers
        num_data_files = [0]

        def write_buffers(self, rel, buffers, **kwargs):
            if rel.endswith(".bin"):
                num_data_files[0] += 1
                if num_data_files[0] == 2:
                    data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
                    original_write(self, rel, [data[: len(data) // 2]], **kwargs)
                    _die()
            return original_write(self, rel, buffers, **kwargs)
        Storage.write_buffers = write_buffers
    elif point == "after_commit":
        original_delete = Storage.delete

        def delete(self, rel, recursive=False):
            if "/pending-" in rel:
                _die()
            return original_delete(self, rel, recursive)
        Storage.delete = delete
    elif point:
        raise ValueError(f"unknown CRASH_AT {point!r}")


def _slow_down(seconds: float) -> None:
    from ckpt.storage import Storage

    original_write, original_create = Storage.write_buffers, Storage.create_exclusive

    def write_buffers(self, rel, buffers, **kwargs):
        if rel.endswith(".bin"):
            time.sleep(seconds)
        original_write(self, rel, buffers, **kwargs)
        if rel.endswith(".bin"):
            time.sleep(seconds)

    def create_exclusive(self, rel, data):
        if rel.endswith("/manifest.json"):
            time.sleep(seconds)
        return original_create(self, rel, data)
    Storage.write_buffers, Storage.create_exclusive = write_buffers, create_exclusive


def main(root: str) -> None:
    import torch.distributed as dist

    import ckpt

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        from datetime import timedelta

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                                rank=rank, world_size=world, timeout=timedelta(seconds=60))
    if os.environ.get("CRASH_SLOW_SECONDS"):
        _slow_down(float(os.environ["CRASH_SLOW_SECONDS"]))
    t0 = time.perf_counter()
    ckpt.save(state_for(1, [rank]), root, 1)
    save1_seconds = time.perf_counter() - t0
    print(f"SAVED 1 {save1_seconds:.4f}", flush=True)
    crash_rank = os.environ.get("CRASH_RANK")
    if crash_rank is None or int(crash_rank) == rank:
        _install_crash(os.environ.get("CRASH_AT", ""))
    if world > 1:
        dist.barrier()
    print("SAVING 2", flush=True)
    if os.environ.get("CRASH_AFTER_FRACTION"):
        import threading

        delay = float(os.environ["CRASH_AFTER_FRACTION"]) * save1_seconds
        threading.Timer(delay, _die).start()
    ckpt.save(state_for(2, [rank]), root, 2)
    print("SAVED 2", flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    if os.environ.get("CRASH_AFTER_FRACTION"):
        time.sleep(60)  # wait for the kill: the test expects every run to end by SIGKILL
    os._exit(0)  # see PLATFORM.md: no interpreter finalisation after gloo


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
