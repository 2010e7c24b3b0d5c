"""Where a tiered job's local checkpoints live: one per node, each holding that node's share.

Every rank of the job learns every rank's node (one all-gather on the tier logic's gloo group,
never the default group: ``ckpt.ranks.groups``) and joins its node's group. On a job of
several nodes each node's local versions hold its ranks' share of the job's checkpoint (a
tensor sharded across nodes only in part), and say so in their ``span``
(:func:`node_span`, :mod:`ckpt.format.span`): such a version loads only on that layout. With
``local_copies=2`` each node also keeps the copies of its predecessor's local checkpoints
(nodes in a ring by index) in ``peer-{node}`` under its own local root (:func:`peer_root`),
a root of its own. The versions a resume may combine across nodes and copies come from one
run (:func:`runs_of_steps`, :func:`mixed_steps`; ``ckpt.root.lineage``). Used by
:class:`ckpt.job.tiers.TieredCheckpointManager`.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ckpt.format import Span
from ckpt.ranks import Agreement
from ckpt.storage import Storage

__all__ = ["same_root", "node_groups", "node_span", "peer_root", "ring_neighbours",
           "runs_of_steps", "mixed_steps", "UNREADABLE"]

PEER_ROOT = "peer-{node}"
"""The folder, under a node's local root, holding the copies of node ``{node}``'s local
checkpoints (docs/format.md, *Layout of a root*)."""


def peer_root(local: Storage, node: int) -> Storage:
    """The root, under ``local`` (a node's own local root), of the copies of node ``node``'s
    local checkpoints: created when absent, and never through a link (``Storage.child``: a
    link planted there, to another root say, is refused naming it, now or later)."""
    return local.child(PEER_ROOT.format(node=int(node)))


def ring_neighbours(node: int, nodes: list[int]) -> tuple[int, int]:
    """(predecessor, successor) of ``node`` in the ring of ``nodes`` ordered by index: a
    node's checkpoints are copied to its successor, and it holds its predecessor's."""
    ring = sorted(nodes)
    i = ring.index(node)
    return ring[(i - 1) % len(ring)], ring[(i + 1) % len(ring)]


def same_root(a: str, b: str) -> bool:
    """Do the roots ``a`` and ``b`` name the same folder?"""
    return Storage.location(a) == Storage.location(b)


def node_groups(node_rank: int, world_group) -> tuple[Any, int, list[int]]:
    """(this node's gloo group, number of nodes, the node of each rank). Collective over
    the world: every rank calls it at once. ``world_group``: a group over the whole world
    with a CPU backend (the tier logic's), which the all-gather runs on. The node group is
    None when the job has one node (the local tier then spans every rank, like the durable
    one) or is not distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, 1, []
    node_of_rank = [int(n) for n in Agreement(world_group).all_gather(int(node_rank))]
    by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(node_of_rank):
        by_node.setdefault(node, []).append(rank)
    if len(by_node) == 1:
        return None, 1, node_of_rank
    group, _ = dist.new_subgroups_by_enumeration(
        [ranks for _, ranks in sorted(by_node.items())], backend="gloo")
    return group, len(by_node), node_of_rank


def node_span(node: int, node_of_rank: list[int]) -> Span | None:
    """The share of the job's checkpoint that node ``node``'s local versions hold (the same
    on every rank of the node): its ranks, in the node group's order (ascending, as
    :func:`node_groups` makes it), of the job's. None on a job of one node (the local tier
    then holds whole checkpoints, like the durable one)."""
    nodes = sorted(set(node_of_rank))
    if len(nodes) <= 1:
        return None
    ranks = tuple(r for r, n in enumerate(node_of_rank) if n == node)
    return Span(node=int(node), nodes=len(nodes), ranks=ranks, world_size=len(node_of_rank))


UNREADABLE = "!"
"""The run of a version whose manifest cannot be read (in :func:`runs_of_steps`)."""


def runs_of_steps(store) -> list[tuple[int, str | None]]:
    """``(step, run)`` for each committed step of ``store`` (``run``: None for a version
    written before lineage existed, ``"!"`` when its manifest cannot be read: the walk
    refuses it on its own, with its reason)."""
    out: list[tuple[int, str | None]] = []
    for step in store.committed_steps():
        try:
            lineage = store.read_manifest(step).lineage
        except Exception:  # noqa: BLE001 - damaged, fenced, gone: judged by the walk
            out.append((int(step), UNREADABLE))
            continue
        out.append((int(step), lineage.run if lineage is not None else None))
    return out


def mixed_steps(listings: list[list[tuple[int, str | None]]]) -> dict[int, list]:
    """The steps whose versions across ``listings`` (each node's, each copy's) come from
    more than one run, with those runs (an unreadable one does not count here)."""
    runs: dict[int, set] = {}
    for listing in listings:
        for step, run in listing:
            if run != UNREADABLE:
                runs.setdefault(int(step), set()).add(run)
    return {s: sorted(r, key=str) for s, r in runs.items() if len(r) > 1}
