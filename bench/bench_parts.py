"""Parts (format version 2): how a part is encoded, and loads of tensors in many chunks.

``--encodings`` (default): one rank's part of a model at a world size (70B over
dp x tp=8 by default, every layer, as ``bench/bench_scale.py`` lays the shards out),
encoded four ways: one JSON object per chunk (the baseline: what a version 1 manifest
holds), one array per chunk with the file's name and a hex CRC, one array with a file
index and an int CRC (what ``Part.to_json_bytes`` writes), and a binary table (fixed-width
rows read by numpy, a JSON header for keys and files). Bytes, strict parse time
(``ckpt.format.jsonio.loads``) and, for ours, parse plus every check
(``Part.from_json_bytes``), as ratios against the baseline measured in the same run.

``--load``: one process loads a float32 tensor saved in N one-element chunks (100k and
300k by default), from 8 parts (format version 2) and from one version 1 manifest, and the
same tensor saved as one chunk (the baseline); CPU seconds of ``ckpt.load`` (manifest
read included) and wall seconds.

    python3 bench/bench_parts.py                      # encodings at 1024 and 4096 ranks
    python3 bench/bench_parts.py --load --chunks 100000,300000
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.bench_scale import MODELS, _chunk  # noqa: E402
from ckpt.format import (  # noqa: E402
    FileRecord,
    ItemLocation,
    Manifest,
    Part,
    PartRecord,
    data_file_name,
    jsonio,
    part_name,
    part_sha256,
)

_SAVE_ID = "0123456789ab"
_FILES = 4


def _best(fn, repeats: int) -> float:
    """The fastest of ``repeats`` runs of ``fn`` (CPU seconds of this process)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def _rank_part(model_name: str, world: int, tp: int, rank: int) -> tuple[Part, Manifest]:
    """Rank ``rank``'s part and a root that lists its keys and files."""
    model = MODELS[model_name]
    dp = world // tp
    d, t = divmod(rank, tp)
    files = [data_file_name(rank, _SAVE_ID, k) for k in range(_FILES)]
    offsets = [0] * _FILES
    part, tensors = Part(rank), {}
    k = 0
    for name, shape, style in model.params():
        offs, sizes = _chunk(shape, style, d, dp, t, tp)
        for fqn in (f"app.model.{name}", f"app.optim.state.{name}.exp_avg",
                    f"app.optim.state.{name}.exp_avg_sq"):
            f = k % _FILES
            length = int(np.prod(sizes)) * 4
            part.chunks[fqn] = [{"offsets": list(offs), "sizes": list(sizes),
                                 "location": ItemLocation(files[f], offsets[f], length,
                                                          (k * 2654435761) & 0xFFFFFFFF)}]
            tensors[fqn] = {"dtype": "float32", "shape": list(shape), "chunks": [],
                            "sharded": True}
            offsets[f] += length
            k += 1
    data = part.to_json_bytes(1, _SAVE_ID)
    name = part_name(rank, _SAVE_ID)
    records = {n: FileRecord(size, 0, rank) for n, size in zip(files, offsets)}
    records[name] = FileRecord(len(data), 0, rank)
    root = Manifest(step=1, save_id=_SAVE_ID, created_unix=1.0, tensors=tensors, objects={},
                    files=records, world_size=world, parts={name: PartRecord(
                        rank, part_sha256(data))}, complete=False)
    return part, root


def _binary(part: Part) -> tuple[bytes, np.dtype]:
    keys = sorted(part.chunks)
    files = sorted({c["location"].file for cs in part.chunks.values() for c in cs})
    row = np.dtype([("key", "<u4"), ("file", "<u2"), ("ndim", "u1"), ("pad", "u1"),
                    ("offset", "<u8"), ("length", "<u8"), ("crc", "<u4"), ("pad2", "<u4"),
                    ("offs", "<u8", (2,)), ("sizes", "<u8", (2,))])
    rows = [(i, files.index(c["location"].file), len(c["offsets"]), 0, c["location"].offset,
             c["location"].length, c["location"].crc32c, 0, (c["offsets"] + [0, 0])[:2],
             (c["sizes"] + [0, 0])[:2]) for i, key in enumerate(keys) for c in part.chunks[key]]
    head = jsonio.dumps({"keys": keys, "files": files, "rows": len(rows)})
    return head + b"\n" + np.array(rows, dtype=row).tobytes(), row


def run_encodings(args) -> None:
    print(f"One rank's part, {args.model} (every layer), dp x tp={args.tp}; CPU seconds, "
          f"best of {args.repeats}; ratios against one JSON object per chunk.\n")
    print("| ranks | encoding | chunks | bytes | parse | parse + every check (ours) | "
          "bytes / baseline | parse / baseline |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for world in [int(r) for r in args.ranks.split(",")]:
        part, root = _rank_part(args.model, world, args.tp, rank=5 % world)
        num = sum(len(cs) for cs in part.chunks.values())
        dicts = jsonio.dumps({"chunks": {k: [{"offsets": c["offsets"], "sizes": c["sizes"],
                                              **c["location"].to_json()} for c in cs]
                                         for k, cs in part.chunks.items()}})
        named = jsonio.dumps({"chunks": {k: [[c["offsets"], c["sizes"], c["location"].file,
                                              c["location"].offset, c["location"].length,
                                              f"{c['location'].crc32c:08x}"] for c in cs]
                                         for k, cs in part.chunks.items()}})
        ours = part.to_json_bytes(1, _SAVE_ID)
        blob, row = _binary(part)

        def parse_binary():
            head, _, rest = blob.partition(b"\n")
            jsonio.loads(head, "bench")
            a = np.frombuffer(rest, dtype=row)
            return [a[f].tolist() for f in ("offs", "sizes", "offset", "length", "crc", "key")]

        base = _best(lambda: jsonio.loads(dicts, "bench"), args.repeats)
        name = part_name(5 % world, _SAVE_ID)
        rows = [("one object per chunk (baseline)", len(dicts), base, None),
                ("arrays, file name, hex crc", len(named),
                 _best(lambda: jsonio.loads(named, "bench"), args.repeats), None),
                ("arrays, file index, int crc (ours)", len(ours),
                 _best(lambda: jsonio.loads(ours, "bench"), args.repeats),
                 _best(lambda: Part.from_json_bytes(ours, "bench", root, name), args.repeats)),
                ("binary table (numpy rows)", len(blob), _best(parse_binary, args.repeats), None)]
        for label, size, parse, checked in rows:
            print(f"| {world} | {label} | {num:,} | {size / 1e3:.0f} kB | {parse * 1e3:.2f} ms | "
                  f"{'' if checked is None else f'{checked * 1e3:.2f} ms'} | "
                  f"{size / len(dicts):.2f} | {parse / base:.2f} |", flush=True)


def run_load(args) -> None:
    import ckpt
    from tests.ckpt._parts import craft_chunked

    print("One process loads a float32 tensor of N elements saved in N one-element chunks "
          "(from 8 parts, and from a version 1 manifest) and saved whole (baseline); CPU and "
          "wall seconds of ckpt.load, manifest read included.\n")
    print("| chunks | saved as | CPU s | wall s | CPU / baseline |")
    print("|---:|---|---:|---:|---:|")
    work = tempfile.mkdtemp(prefix="bench-parts-")
    try:
        for n in [int(c) for c in args.chunks.split(",")]:
            whole = os.path.join(work, "whole")
            ckpt.save({"t": torch.arange(n, dtype=torch.float32)}, whole, 1, use_lease=False)
            cases = [("one chunk (baseline)", whole)]
            for version, parts in ((2, 8), (1, 1)):
                root = os.path.join(work, f"v{version}")
                craft_chunked(root, 1, n, num_parts=parts, version=version)
                cases.append((f"version {version}, {parts} part(s)" if version == 2 else
                              "version 1 manifest", root))
            base = None
            for label, root in cases:
                state = {"t": torch.zeros(n)}
                c0, w0 = time.process_time(), time.perf_counter()
                ckpt.load(state, root, 1)
                cpu, wall = time.process_time() - c0, time.perf_counter() - w0
                assert torch.equal(state["t"], torch.arange(n, dtype=torch.float32))
                base = base or cpu
                print(f"| {n:,} | {label} | {cpu:.2f} | {wall:.2f} | {cpu / base:.0f}x |",
                      flush=True)
                shutil.rmtree(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", action="store_true", help="time loads instead of encodings")
    ap.add_argument("--model", default="70b", choices=sorted(MODELS))
    ap.add_argument("--ranks", default="1024,4096")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunks", default="100000,300000")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    total = 0
    for i in range(10 ** 7):
        total += i
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} CPUs; "
          f"a 10M-iteration Python loop took {time.perf_counter() - t0:.2f} s here "
          f"(about 0.45 s on an idle 3 GHz core)\n")
    (run_load if args.load else run_encodings)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
