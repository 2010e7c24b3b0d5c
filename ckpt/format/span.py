"""A version's span: the share of a job-wide checkpoint it holds (docs/format.md, "Span").

A two-tier job of several nodes writes its local tier as one version per node, each written
by that node's ranks only (:mod:`ckpt.job.tiers`). Such a version is that node's *share* of
the job's step: the shards its ranks hold (of a tensor sharded across nodes, only those),
their per-rank values and one copy of replicated ones. Its manifest says so:
``manifest["span"] = {"node": n, "nodes": N, "ranks": [job ranks], "world_size": W}``
(OPTIONAL: a version without one holds a whole checkpoint). Rank ``i`` of the version (its
part ``part-r{i:05d}_...``) is rank ``ranks[i]`` of a job of ``W`` ranks.

What the span changes: a sharded tensor's chunks MAY leave part of it uncovered (the other
nodes' shares; :func:`ckpt.format.coverage.coverage_problem` with ``partial``), a version with
a span loads only on the layout that wrote it (:meth:`Span.matches`) and only where
it holds every chunk a loading rank needs, and it is never exported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ckpt.errors import CorruptCheckpointError

__all__ = ["Span", "parse_span", "ranks_text"]

_MAX_RANK = (1 << 31) - 1


@dataclass(frozen=True)
class Span:
    """Whose share of a job-wide checkpoint a version holds: node ``node`` of ``nodes``,
    written by the job's ranks ``ranks`` (rank ``i`` of the version is ``ranks[i]``) of a
    job of ``world_size`` ranks."""

    node: int
    nodes: int
    ranks: tuple[int, ...]
    world_size: int

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "nodes": self.nodes, "ranks": list(self.ranks),
                "world_size": self.world_size}

    def describe(self) -> str:
        """In words: ``node 1's share of a job of 2 nodes (ranks 2-3 of 4)``."""
        return (f"node {self.node}'s share of a job of {self.nodes} nodes (ranks "
                f"{ranks_text(self.ranks)} of {self.world_size})")

    def matches(self, ranks: Sequence[int], world_size: int) -> bool:
        """Is a group of the job ranks ``ranks`` (in the group's order) of a job of
        ``world_size`` ranks this span's layout: the only one a version with it loads on?"""
        return tuple(int(r) for r in ranks) == self.ranks and int(world_size) == self.world_size


def ranks_text(ranks: Sequence[int]) -> str:
    """Ranks for a message: ``2-3`` when consecutive, else the first few and how many."""
    ranks = [int(r) for r in ranks]
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}-{ranks[-1]}"
    shown = ", ".join(map(str, ranks[:8]))
    return shown if len(ranks) <= 8 else f"{shown} and {len(ranks) - 8} more"


def parse_span(raw: Any, source: str, world_size: int) -> Span | None:
    """A ``span`` member, checked (None when absent): ``node`` an int in [0, 2**31),
    ``nodes`` and ``world_size`` ints in [1, 2**31), ``ranks`` a list of ``world_size`` (the
    manifest's: one per rank of the version) distinct ints in [0, span's ``world_size``).
    Raises ``CorruptCheckpointError`` naming ``source`` and the field."""
    if raw is None:
        return None

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{source}: span{what}; the manifest is damaged, load "
                                      f"an earlier step", path=source)

    def is_int(v: Any, low: int) -> bool:
        return type(v) is int and low <= v <= _MAX_RANK

    if type(raw) is not dict:
        raise bad(" must be an object")
    node, nodes, ranks, job = (raw.get("node"), raw.get("nodes"), raw.get("ranks"),
                               raw.get("world_size"))
    if not is_int(node, 0):
        raise bad(".node must be an int in [0, 2**31)")
    if not is_int(nodes, 1):
        raise bad(".nodes must be an int in [1, 2**31)")
    if not is_int(job, 1):
        raise bad(".world_size must be an int in [1, 2**31)")
    if type(ranks) is not list or len(ranks) != world_size \
            or not all(is_int(r, 0) and r < job for r in ranks) \
            or len(set(ranks)) != len(ranks):
        raise bad(f".ranks must list {world_size} distinct ranks (the manifest's world_size) "
                  f"in [0, span.world_size={job})")
    return Span(node, nodes, tuple(ranks), job)
