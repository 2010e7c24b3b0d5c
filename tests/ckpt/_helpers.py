"""Shared helpers for the multi-process checkpoint tests: snapshots and exact comparison."""

from __future__ import annotations

import copy
import gc
import time
from typing import Any, Callable

import torch

__all__ = ["snapshot", "assert_same", "flip_byte", "to_local", "pack", "unpack",
           "least_cpu_seconds"]


def to_local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def snapshot(obj: Any) -> Any:
    """A deep copy in which every tensor is a detached clone of its local shard."""
    if isinstance(obj, torch.Tensor):
        return to_local(obj).detach().clone()
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return copy.deepcopy(obj)


def assert_same(expected: Any, actual: Any, where: str = "state") -> None:
    """Bit equality of nested structures (tensors compared by dtype, shape and bytes)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {type(actual)}"
        actual = to_local(actual).detach()
        assert expected.dtype == actual.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert expected.shape == actual.shape, f"{where}: shape {actual.shape} != {expected.shape}"
        # Compare raw bytes: torch.equal would call NaN != NaN and -0.0 == 0.0.
        a = expected.contiguous().reshape(-1).view(torch.uint8) if expected.numel() else expected
        b = actual.contiguous().reshape(-1).view(torch.uint8) if actual.numel() else actual
        assert torch.equal(a, b), f"{where}: values differ"
        return
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: expected a dict, got {type(actual)}"
        assert set(expected) == set(actual), \
            f"{where}: keys {sorted(map(str, actual))} != {sorted(map(str, expected))}"
        for k in expected:
            assert_same(expected[k], actual[k], f"{where}.{k}")
        return
    if isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), \
            f"{where}: {actual!r} != {expected!r}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same(e, a, f"{where}[{i}]")
        return
    assert expected == actual and type(expected) is type(actual), \
        f"{where}: {actual!r} ({type(actual).__name__}) != {expected!r} ({type(expected).__name__})"


def flip_byte(path: str, offset: int = 0) -> None:
    """Invert every bit of one byte of a file, in place (same size)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def pack(obj: Any) -> bytes:
    """Serialise a nested structure of tensors for the trip between rank and parent.

    Tensors put on a multiprocessing queue travel as shared-memory handles that the receiver
    fetches from the sender, which fails once the sender has exited; bytes always arrive.
    """
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(data: bytes) -> Any:
    import io

    return torch.load(io.BytesIO(data), weights_only=True)


def least_cpu_seconds(fn: Callable[[], Any], repeats: int = 3) -> float:
    """The least CPU time of ``repeats`` calls of ``fn``, none of them paying for a
    garbage collection (one inside a call would be charged to its input's size)."""
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        try:
            t0 = time.process_time()
            fn()
            best = min(best, time.process_time() - t0)
        finally:
            gc.enable()
    return best
