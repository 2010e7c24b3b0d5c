"""Do a tensor's chunks tile it exactly? In time linear in the chunks (and the grid cells).

The one definition of the coverage rule of docs/format.md (*Validation rules*, 6): the
chunks of a tensor cover every element exactly once, or, in a version that holds one node's
share of a checkpoint (its ``span``: :mod:`ckpt.format.span`), at most once. Readers check
it on every manifest and part they trust; a planner may check a global save plan with it
instead of a pairwise comparison of chunks (quadratic in the chunks of one tensor).

The distinct chunk boundaries of each dimension cut the tensor into a grid of cells; every
chunk is a box of whole cells. The check counts elements (one sum), then paints one flag
per cell (not per element): a chunk of one cell is painted by a vectorised index, a larger
one by a slice. The grid is bounded by ``MAX_GRID_CELLS`` (any layout of DTensor shards has
one cell per chunk), so neither time nor memory depends on the elements.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

__all__ = ["coverage_problem", "MAX_GRID_CELLS"]

MAX_GRID_CELLS = 1 << 24

Box = tuple[Sequence[int], Sequence[int]]


def coverage_problem(shape: Sequence[int], boxes: Sequence[Box], *, where: str = "tensor",
                     name: Callable[[int], str] | None = None,
                     partial: bool = False) -> str | None:
    """None when ``boxes`` (``(offsets, sizes)`` pairs) tile ``shape`` exactly; else what is
    wrong, as a sentence that starts with ``where`` and names the first offending chunk by
    ``name(i)`` (default ``chunks[i]``, ``i`` its index in ``boxes``). ``partial``: the
    boxes may leave elements uncovered (one node's share), but still never overlap.

    The caller has checked each box alone: one offset and size per dimension, ints >= 0,
    inside ``shape``. Missing (unless ``partial``), duplicated and overlapping chunks are
    all found; a grid of more than ``MAX_GRID_CELLS`` cells is refused before anything is
    allocated.
    """
    name = name or (lambda i: f"chunks[{i}]")
    shape = list(shape)
    if not shape:  # a scalar: exactly one chunk (partial: at most one)
        if len(boxes) != 1 and not (partial and not boxes):
            return f"{where} is a scalar and needs exactly one chunk, has {len(boxes)}"
        return None
    numel = math.prod(shape)
    if numel == 0:
        return None
    if len(boxes) == 1 and not partial:  # the common case (a whole tensor): no arrays needed
        offs, sizes = boxes[0]
        if any(offs) or list(sizes) != shape:
            held = math.prod(sizes)
            return (f"{where}: chunks hold {held} elements, the shape {shape} has {numel} "
                    f"(chunks are missing, duplicated or overlap)")
        return None
    ndim = len(shape)
    n = len(boxes)
    if n <= 1 and partial:  # no chunk, or one inside the shape: nothing can overlap
        return None
    if n == 0:
        return (f"{where}: chunks hold 0 elements, the shape {shape} has {numel} "
                f"(chunks are missing, duplicated or overlap)")
    offs = np.array([b[0] for b in boxes], dtype=np.int64).reshape(n, ndim)
    sizes = np.array([b[1] for b in boxes], dtype=np.int64).reshape(n, ndim)
    # Each chunk lies inside the shape, so its element count fits an int64; their sum may
    # not, so it is taken in Python ints.
    held = np.prod(sizes, axis=1)
    covered = sum(held.tolist())
    if covered != numel and not (partial and covered < numel):
        return (f"{where}: chunks hold {covered} elements, the shape {shape} has {numel} "
                f"(chunks are missing, duplicated or overlap)")
    keep = np.nonzero(held > 0)[0]  # an empty chunk covers nothing
    offs, sizes = offs[keep], sizes[keep]
    ends = offs + sizes
    cuts = [np.unique(np.concatenate(([0, dim], offs[:, d], ends[:, d])))
            for d, dim in enumerate(shape)]
    grid_shape = [len(c) - 1 for c in cuts]
    num_cells = math.prod(grid_shape)
    if num_cells > MAX_GRID_CELLS:
        return (f"{where}: {len(keep)} chunks cut the tensor into a grid of {num_cells} cells, "
                f"more than the {MAX_GRID_CELLS} a reader checks")
    lo = np.stack([np.searchsorted(cuts[d], offs[:, d]) for d in range(ndim)], axis=1)
    hi = np.stack([np.searchsorted(cuts[d], ends[:, d]) for d in range(ndim)], axis=1)
    cells = np.prod(hi - lo, axis=1)
    grid = np.zeros(num_cells, dtype=np.bool_)

    def overlap(k: int) -> str:
        i = int(keep[k])
        return (f"{where}.{name(i)} (offsets {list(boxes[i][0])}, sizes {list(boxes[i][1])}) "
                f"overlaps another chunk")

    single = np.nonzero(cells == 1)[0]
    if len(single):
        lin = np.ravel_multi_index(tuple(lo[single].T), grid_shape)
        order = np.argsort(lin, kind="stable")
        ordered = lin[order]
        dup = np.nonzero(ordered[1:] == ordered[:-1])[0]
        if len(dup):
            return overlap(int(single[order[dup[0] + 1]]))
        grid[lin] = True
    view = grid.reshape(grid_shape)
    for k in np.nonzero(cells != 1)[0].tolist():
        cell_box = view[tuple(slice(int(a), int(b)) for a, b in zip(lo[k], hi[k]))]
        if cell_box.any():
            return overlap(k)
        cell_box[...] = True
    if not partial and not grid.all():
        return f"{where}: chunks leave part of the tensor uncovered"
    return None
