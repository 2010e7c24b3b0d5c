"""Same-layout local load time: ``ckpt.load`` against reading and checksumming the same files.

    python bench/bench_load.py [--mib 256] [--tensors 64] [--repeats 5] [--dir DIR] [--staging]

One process saves a model-like state once, then each round loads it (page cache warm) with
``ckpt.load`` (verify='full' and 'size'; with ``--staging`` also reading into reused
staging buffers, as ``CheckpointManager.load_latest`` does) and with the floor: every data file read into a
preallocated buffer and checksummed (crc32c), 4 files at once, which is the least any
verified load must do. Contenders are interleaved per round (bench/_common.py); the table
gives median seconds, GiB/s and the median per-round ratio to the floor. docs/performance.md
("Transactional loads") records the figures before and after loads became transactional.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import (  # noqa: E402
    Contender,
    GiB,
    MiB,
    interleave,
    make_state,
    median,
    paired_ratio,
    rmtree,
    state_nbytes,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="state size in MiB")
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default=None, help="work folder (default: a temp folder)")
    p.add_argument("--staging", action="store_true",
                   help="also load into reused staging buffers (a CheckpointManager's path)")
    args = p.parse_args(argv)

    import torch

    import ckpt
    from ckpt.format import crc32c_of

    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="bench-load-", dir=args.dir)
    root = os.path.join(work, "root")
    try:
        state = make_state(args.mib * MiB, args.tensors)
        nbytes = state_nbytes(state)
        manifest = ckpt.save(state, root, 1)
        step_dir = os.path.join(root, "step_000000001")
        files = [(os.path.join(step_dir, name), rec.size) for name, rec in manifest.files.items()]
        buffers = {path: bytearray(size) for path, size in files}

        def floor() -> float:
            t0 = time.perf_counter()

            def one(item):
                path, size = item
                view = memoryview(buffers[path])
                with open(path, "rb", buffering=0) as f:
                    got = 0
                    while got < size:
                        got += f.readinto(view[got:])
                return crc32c_of([view])

            with ThreadPoolExecutor(4) as pool:
                list(pool.map(one, files))
            return time.perf_counter() - t0

        staging = None
        if args.staging:
            from ckpt.dcp import StagingBuffers

            staging = StagingBuffers()
            staging.prepare(state)

        def load(verify: str, scratch=None):
            def run() -> float:
                t0 = time.perf_counter()
                if scratch is None:
                    ckpt.load(state, root, 1, verify=verify)
                else:
                    ckpt.load(state, root, 1, verify=verify, scratch=scratch)
                return time.perf_counter() - t0
            return run

        contenders = [Contender("floor: read+crc", floor),
                      Contender("ckpt.load full", load("full")),
                      Contender("ckpt.load size", load("size"))]
        if staging is not None:
            contenders += [Contender("ckpt.load full, staging", load("full", staging)),
                           Contender("ckpt.load size, staging", load("size", staging))]
        samples = interleave(contenders, args.repeats)
        print(f"\nstate {nbytes / MiB:.0f} MiB in {args.tensors} tensors, "
              f"{len(files)} data files, {args.repeats} rounds (page cache warm)\n")
        print("| contender | median s | GiB/s | x floor |")
        print("|---|---|---|---|")
        base = samples["floor: read+crc"]
        for c in contenders:
            s = samples.get(c.name, [])
            m = median(s)
            ratio = paired_ratio(s, base)
            print(f"| {c.name} | {m:.3f} | {nbytes / GiB / m:.2f} | {ratio:.2f} |")
    finally:
        rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
