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
"""

from __future__ import annotations

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
        """The group's first rank's ``value``, on every rank (JSON-like values only)."""
        self._check_open()
        if not self.distributed:
            return value
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        holder = [value]
        dist.broadcast_object_list(holder, src=src, group=self.group)
        return holder[0]
