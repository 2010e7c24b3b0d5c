"""Whether the chunks of a tensor tile it: inside it, no overlap, and (when asked) every
element covered. Linear in the chunks of one tensor for the layouts DTensor and
ShardedTensor produce; DCP's own check (``_validate_global_plan``) compares chunks pairwise
when they are split along a dimension other than the one it sweeps, which is quadratic.

Most layouts are a *grid*: along each dimension the chunks' ``[offset, offset + size)``
intervals take a few distinct values that partition the dimension, and every chunk is one
cell of their product (FSDP over TP, uneven shards, a tensor saved whole). Then the chunks
tile the tensor exactly when the cells they name are distinct and as many as the grid has:
a sort per dimension and a set, O(n log n). Anything else (a layout that is no grid, or a
broken one) is checked by a sweep along the dimension with the most distinct offsets,
exact in every case.
"""

from __future__ import annotations

import math
from bisect import bisect_right, insort
from typing import Sequence

__all__ = ["chunk_problems"]

_MAX_PROBLEMS = 10  # per tensor: the first few overlaps say enough


def chunk_problems(key: str, size: Sequence[int], chunks: Sequence, *,
                   need_cover: bool = True) -> list[str]:
    """What is wrong with ``chunks`` (objects with ``offsets`` and ``sizes``) of a tensor of
    shape ``size``: one message per problem (empty when they tile it). ``need_cover``: the
    chunks must cover every element (False: a part of the tensor may be missing)."""
    if len(size) == 0:
        return []  # a 0-d tensor is its one chunk
    problems = []
    boxes = []
    for c in chunks:
        offs, lens = tuple(c.offsets), tuple(c.sizes)
        if len(offs) != len(size) or len(lens) != len(size) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(offs, lens, size)):
            problems.append(f"key:{key} has out of bounds chunk: tensor-size:{list(size)} "
                            f"chunk: offsets {list(offs)} sizes {list(lens)}")
            continue
        if all(lens):  # an empty chunk covers and overlaps nothing
            boxes.append((offs, lens))
    if problems:
        return problems
    verdict = _grid_verdict(size, boxes)
    if verdict is None:
        problems.extend(_sweep(key, boxes))
    elif verdict == "overlap":
        problems.append(f"key:{key} has overlapping chunks (two chunks at the same offsets)")
    if need_cover and not problems:
        covered = sum(math.prod(lens) for _, lens in boxes)
        if covered != math.prod(size):
            problems.append(f"key:{key} invalid fill tensor-volume: {math.prod(size)} "
                            f"chunks-volume: {covered}")
    return problems


def _grid_verdict(size: Sequence[int], boxes: list) -> str | None:
    """"ok" (no overlap), "overlap", or None (not a grid: the sweep decides)."""
    if len(boxes) <= 1:
        return "ok"
    for d, extent in enumerate(size):
        spans: dict[int, int] = {}
        for offs, lens in boxes:
            if spans.setdefault(offs[d], lens[d]) != lens[d]:
                return None  # two extents from one offset: no partition of this dimension
        end = 0
        for start in sorted(spans):
            if start != end:
                return None  # a gap or an overlap along this dimension
            end = start + spans[start]
        if end != extent:
            return None
    distinct = len({offs for offs, _ in boxes})
    # Each box is a cell of the grid; distinct offsets are distinct cells.
    return "ok" if distinct == len(boxes) else "overlap"


def _sweep(key: str, boxes: list) -> list[str]:
    """Pairwise overlaps found by a sweep along the dimension with the most distinct
    offsets (chunks that end before the next one starts leave the active set)."""
    dims = len(boxes[0][0])
    dim = max(range(dims), key=lambda d: len({offs[d] for offs, _ in boxes}))
    order = sorted(range(len(boxes)), key=lambda i: (boxes[i][0][dim], boxes[i][0]))
    active: list[tuple[int, int]] = []  # (end along dim, box index), sorted
    problems = []
    for i in order:
        offs, lens = boxes[i]
        start = offs[dim]
        del active[:bisect_right(active, (start, len(boxes)))]
        for _, j in active:
            o2, l2 = boxes[j]
            if all(a < b + m and b < a + n for a, n, b, m in zip(offs, lens, o2, l2)):
                problems.append(f"key:{key} has overlapping chunks: offsets {list(offs)} "
                                f"sizes {list(lens)} and offsets {list(o2)} sizes {list(l2)}")
                if len(problems) >= _MAX_PROBLEMS:
                    return problems
        insort(active, (start + lens[dim], i))
    return problems
