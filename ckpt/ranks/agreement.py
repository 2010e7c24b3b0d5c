"""Rank agreement: the one way ranks of a checkpointing job decide something together.

Decisions that could differ between ranks (a time-based cadence, whether the previous save
is in flight, whether a checkpoint verified) are agreed with a tiny collective on CPU tensors,
on a process group that only one thread uses and that has a CPU backend: a gloo group of the
store (``ckpt.ranks.groups``), never the default group, which under NCCL has none. Without a
default process group (one process), every answer is the local one.

Contract: every rank of ``group`` calls the same methods in the same order, from the one
thread that owns this ``Agreement`` (the manager's control group: the training thread; its
background group: the persist thread). Never the training loop's own group from a
background thread.

Values that are not numbers (``broadcast``, ``all_gather``) travel as JSON text in uint8
tensors, never pickled: what a peer sent is parsed as JSON and nothing else (a payload
that is not JSON is refused, naming the rank that sent it). They are JSON's values: str,
int, float, bool, None, lists and dicts with str keys; a tuple arrives as a list.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["Agreement"]


class Agreement:
    """Agree on values across the ranks of ``group``, a group with a CPU backend (e.g. from
    ``ckpt.ranks.groups.cpu_group``). None only in one process, without a default group: the
    default group is never used in its place."""

    def __init__(self, group=None):
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed and group is None:
            raise ValueError("Agreement needs a process group with a CPU backend when a "
                             "default group exists (ckpt.ranks.groups.cpu_group), never the "
                             "default group itself")
        self._closed = False

    def close(self) -> None:
        """Drop the group (its owner destroyed it); any later use is an error, never a
        silent fall back to the world group."""
        self.group, self._closed = None, True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Agreement used after close(): its process group is gone")

    def max(self, *values: int) -> list[int]:
        """Element-wise MAX of ``values`` over all ranks."""
        self._check_open()
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def min(self, *values: int) -> list[int]:
        """Element-wise MIN of ``values`` over all ranks (one all-reduce)."""
        return self.any_and_min((), values)[1]

    def any_and_min(self, flags: Sequence[bool], values: Sequence[int]
                    ) -> tuple[list[bool], list[int]]:
        """In one all-reduce: for each of ``flags``, whether some rank raised it; for each
        of ``values``, the smallest any rank proposed. (A minimum is the MAX of the
        negated values, so one MAX all-reduce carries both.)"""
        out = self.max(*(int(bool(f)) for f in flags), *(-int(v) for v in values))
        return [bool(f) for f in out[:len(flags)]], [-v for v in out[len(flags):]]

    def all(self, ok: bool) -> bool:
        """True only if every rank says ``ok``."""
        return not self.max(int(not ok))[0]

    def any(self, flag: bool) -> bool:
        """True if some rank says ``flag``."""
        return bool(self.max(int(flag))[0])

    @property
    def is_first(self) -> bool:
        """Is this the group's first rank (whose value ``broadcast`` hands out)?"""
        return not self.distributed or dist.get_rank(self.group) == 0

    def broadcast(self, value: Any) -> Any:
        """The group's first rank's ``value`` (JSON: see the module docstring), on every
        rank; the others' ``value`` is ignored. Two broadcasts: the length, the text."""
        self._check_open()
        if not self.distributed:
            return _decode(_encode(value), 0)  # the same values as on several ranks
        src = dist.get_global_rank(self.group, 0)
        if self.is_first:
            data = _encode(value)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=src, group=self.group)
        if not self.is_first:
            data = torch.empty(int(size[0]), dtype=torch.uint8)
        dist.broadcast(data, src=src, group=self.group)
        return _decode(data, 0)

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (JSON: see the module docstring), in the group's rank
        order, on every rank. Two all-gathers: the lengths, the texts (padded to the
        longest)."""
        self._check_open()
        if not self.distributed:
            return [_decode(_encode(value), 0)]
        world = dist.get_world_size(self.group)
        data = _encode(value)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64),
                        group=self.group)
        longest = max(int(t[0]) for t in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:data.numel()] = data
        texts = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(texts, padded, group=self.group)
        return [_decode(t[:int(n[0])], rank) for rank, (t, n) in enumerate(zip(texts, sizes))]


def _check_keys(value: Any) -> None:
    """Refuse dict keys JSON would turn into strings (an int key would come back a str)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"Agreement values are JSON: dict key {k!r} is not a str "
                                f"(convert the keys, e.g. {{str(k): v}})")
            _check_keys(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_keys(v)


def _encode(value: Any) -> torch.Tensor:
    _check_keys(value)
    try:
        text = json.dumps(value, separators=(",", ":"))
    except TypeError as exc:
        raise TypeError(f"Agreement values are JSON (str, int, float, bool, None, lists, "
                        f"dicts with str keys): {exc}") from None
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else \
        torch.empty(0, dtype=torch.uint8)


def _decode(data: torch.Tensor, rank: int) -> Any:
    """A peer's text parsed as JSON, nothing else (``rank``: the group rank that sent it)."""
    try:
        return json.loads(bytes(data.numpy()).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"rank {rank} of the agreement group sent {data.numel()} bytes that "
                         f"are not JSON ({exc}); every rank must call the same Agreement "
                         f"methods in the same order") from None
