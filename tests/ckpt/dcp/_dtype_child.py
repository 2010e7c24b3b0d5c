"""Save and load one item of every format dtype at many byte offsets; run as a child.

``python -m tests.ckpt.dcp._dtype_child KIND ROOT [OPTIONS_JSON]`` with KIND one of ``local``
(same-layout local load), ``memory`` (save and load in this process), ``s3`` (OPTIONS_JSON
holds the storage options) or ``reshard`` (ROOT was saved by :func:`save_sharded` on 2
ranks; load it here on 1). Prints ``OK <num items> <num misaligned>`` or raises. A
segfault kills only this process; the test sees its exit status.

The state is a sequence of ``(pad, item)`` pairs saved into one data file per rank
(``num_threads=1``): each pad is a uint8 tensor sized so that the next item starts at a
chosen offset modulo 16 (1, 3, 8 and 0), so items of every size land at odd, 8-aligned
and 16-aligned offsets.
"""

from __future__ import annotations

import json
import sys

import torch

from ckpt.format import dtype_name


def _format_dtypes() -> list[torch.dtype]:
    """Every torch dtype the checkpoint format accepts (``dtype_name`` is its gate)."""
    out = []
    for value in vars(torch).values():
        if isinstance(value, torch.dtype) and value not in out:
            try:
                dtype_name(value)
            except ValueError:
                continue
            out.append(value)
    return out


FORMAT_DTYPES = _format_dtypes()

RESIDUES = (1, 3, 8, 0)
NUMEL = 5  # rows
COLS = 4  # columns; the sharded save splits them in two (the load reads strided slices)


def _values(dtype: torch.dtype, rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (rows, COLS)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.itemsize == 1 and dtype.is_floating_point:
        # float8 and float4 (packed): every bit pattern, NaN encodings included, from
        # random bytes (torch converts nothing to float4).
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dtype)
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def cases() -> list[tuple[str, torch.dtype, int]]:
    return [(f"c{i:03d}", dtype, r) for i, (dtype, r) in
            enumerate((d, r) for d in FORMAT_DTYPES for r in RESIDUES)]


def plain_state(numel: int, fill: bool = True, rank_keys: tuple[int, ...] = (),
                saved_fraction: int = 1) -> dict:
    """The whole state: pads and items in order, pads sized for a one-file save of
    ``1 / saved_fraction`` of each item."""
    state, offset = {}, 0
    for index, (key, dtype, residue) in enumerate(cases()):
        pad = (residue - offset) % 16 or 16
        pads = [f"{key}_pad_r{r}" for r in rank_keys] or [f"{key}_pad"]
        for name in pads:
            state[name] = torch.arange(pad, dtype=torch.uint8) if fill else \
                torch.zeros(pad, dtype=torch.uint8)
        offset += pad
        item = _values(dtype, numel, seed=index)
        state[f"{key}_t"] = item if fill else torch.zeros_like(item)
        offset += item.numel() * item.element_size() // saved_fraction
    return state


def save_sharded(rank: int, world: int, root: str) -> None:
    """Rank ``rank`` of 2 saves its half of every item's columns (a DTensor) after its own
    pad; loading whole tensors then reads each half into a strided slice."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import ckpt

    mesh = init_device_mesh("cpu", (world,))
    full = plain_state(NUMEL, rank_keys=(rank,), saved_fraction=world)
    state = {}
    for name, value in full.items():
        if "_pad" in name:
            state[name] = value
        else:
            local = value.chunk(world, dim=1)[rank].clone()
            state[name] = DTensor.from_local(local, mesh, [Shard(1)], run_check=False)
    ckpt.save(state, root, 1, num_threads=1)


def _check(root: str, options, state: dict, expected: dict) -> str:
    import ckpt
    from ckpt.root import CheckpointStore

    manifest = CheckpointStore(root, storage_options=options).read_manifest(1, complete=True) \
        if options is not None else CheckpointStore(root).read_manifest(1, complete=True)
    misaligned = 0
    for key, dtype, _ in cases():
        for chunk in manifest.tensors[f"{key}_t"]["chunks"]:
            size = torch.empty(0, dtype=dtype).element_size()
            misaligned += chunk["location"].offset % size != 0
    ckpt.load(state, root, 1, storage_options=options)
    for name, value in expected.items():
        got = state[name]
        a = value.reshape(-1).view(torch.uint8)
        b = got.reshape(-1).view(torch.uint8)
        if not torch.equal(a, b):
            raise AssertionError(f"{name} ({value.dtype}): loaded {got} != saved {value}")
    return f"OK {len(expected)} {misaligned}"


def main(argv: list[str]) -> None:
    import ckpt

    kind, root = argv[0], argv[1]
    options = json.loads(argv[2]) if len(argv) > 2 else None
    if kind == "reshard":
        expected = plain_state(NUMEL, rank_keys=(0, 1), saved_fraction=2)
        target = plain_state(NUMEL, fill=False, rank_keys=(0, 1), saved_fraction=2)
    else:
        expected = plain_state(NUMEL)
        target = plain_state(NUMEL, fill=False)
        ckpt.save(expected, root, 1, num_threads=1, storage_options=options)
    print(_check(root, options, target, expected), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])


def load_into_shards(rank: int, world: int, root: str) -> str:
    """Rank ``rank`` of 2 loads a whole-tensor save into DTensors split by rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    expected = plain_state(NUMEL)
    # No collectives: gloo cannot move some of these dtypes (each rank shards locally).
    target = {name: torch.zeros_like(value) if "_pad" in name else
              distribute_tensor(torch.zeros_like(value), mesh, [Shard(0)], src_data_rank=None)
              for name, value in expected.items()}
    import ckpt

    ckpt.load(target, root, 1)
    for name, value in expected.items():
        want = value if "_pad" in name else value.chunk(world, dim=0)[rank].contiguous()
        got = target[name] if "_pad" in name else target[name].to_local()
        if not torch.equal(want.reshape(-1).view(torch.uint8), got.reshape(-1).view(torch.uint8)):
            raise AssertionError(f"rank {rank}: {name} ({value.dtype}) differs after loading")
    return "OK"
