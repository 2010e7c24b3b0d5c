"""Cooperative loads: each byte range a load needs is read from storage by one rank only.

When several ranks of a load need the same item of a data file (a replicated value under
DDP, the shard every ``dp_replicate`` replica of HSDP holds, a chunk that straddles two
ranks' shards after a reshard, the objects every rank loads), one of them reads it and the
others receive it over the load's gloo group, as raw bytes (``isend``/``irecv`` of uint8
tensors; nothing is pickled). The reader verifies what it reads, as every read is verified
(:mod:`ckpt.dcp.reader`); each receiver checks the item's CRC32C, from its own manifest or
part, on the bytes it received before it uses them.

Protocol (inside DCP's load, :class:`ckpt.dcp.reader.CkptReader`), every step on every rank
unless said:

=============  =============================================================================
step           what
=============  =============================================================================
local plan     the rank's distinct item locations (:class:`Wanted`), with its DCP plan
global plan    the coordinator's :func:`assign`: a reader per location two ranks need, each
               rank's share (:class:`Exchange`); None when no location is shared (then
               nothing below happens: each rank reads its own, as without a group)
allocate       the rank's arena (what it reads for others) and receive buffers, then one
               all-reduce: could every rank? (else the load fails; nothing was sent)
transfer       every receive posted (:func:`post_receives`); the shared items read and
               verified batch by batch (:data:`BATCH_BYTES`), each batch sent once read
               (:func:`post_send`); then the items the rank reads alone. A thread checks
               each received item's CRC32C against the rank's own record as it arrives
agree          one all-reduce: did every read and every check succeed?
=============  =============================================================================

A rank whose read fails stops reading but still sends every message its receivers wait for
(its bytes are never used): the second all-reduce fails the load on every rank, and DCP's
gather of every rank's outcome then raises the reader's own error everywhere, so the load
stays all or nothing (``ckpt.dcp.api.load``).

Layout of the bytes: a reader's arena holds the shared items it reads in its *slot* order
(by file, then offset), each at a multiple of :data:`ALIGN_BYTES`, and each slot belongs to
a *batch* (:func:`batches_of`). A rank receives from each sender the items it needs in slot
order; a *run* of consecutive slots of one batch is one contiguous range of the sender's
arena, sent as is (in pieces of at most ``ckpt.ranks.CHUNK_BYTES``), and lands in the
receiver's buffer at an aligned offset with the same layout inside. Both sides compute runs
and pieces from the plan alone (:func:`send_layout`, :func:`receive_layout`), so every send
matches one receive of the same size, in the same order.

Balance: the locations with the same holders are cut, in file order, into one stretch per
holder, so that the holders' loads (what each reads alone included) come out as equal as
whole items allow: no rank reads more than its share plus about one item, and each reads
side by side items of the files, in few requests.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ckpt.ranks import CHUNK_BYTES

__all__ = ["ALIGN_BYTES", "BATCH_BYTES", "TRANSFER_TAG", "Wanted", "Exchange", "assign",
           "slot_offsets", "batches_of", "runs", "receive_layout", "send_layout", "pieces",
           "post_receives", "post_send"]

ALIGN_BYTES = 64
"""Where items start in an arena or a receive buffer: above every dtype's alignment (16 for
complex128), so each received item is a view, never a copy."""

BATCH_BYTES = 4 << 20
"""A reader sends what it read batch by batch (each batch about this many bytes of its
arena), so that the transfer of one batch overlaps the reading of the next."""

TRANSFER_TAG = 83
_OFFSET_BITS = 44  # a location's file and offset as one sort key (files under 16 TiB)


def aligned(nbytes: np.ndarray | int) -> Any:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN_BYTES`."""
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


@dataclasses.dataclass
class Wanted:
    """One rank's distinct item locations, sent with its local plan: ``files`` names the
    files, ``table`` holds one row per location, ``[file index, offset, length]``
    (int64). Rows are in the rank's own order; every index below refers to it."""

    files: list[str]
    table: np.ndarray


@dataclasses.dataclass
class Exchange:
    """One rank's share of a cooperative load, from :func:`assign` (group ranks).

    ``read``: the rank's own location indices it reads for others too, in slot order
    (slot ``i`` of its arena is ``read[i]``); ``batches``: each slot's batch
    (:func:`batches_of`). ``send``: ``{rank: slots}``, ascending, that ``rank`` receives
    from it. ``recv``: ``{rank: (own indices, that rank's slots, their batches)}``,
    ascending by slot. A location in none of these is read by this rank alone."""

    read: np.ndarray
    batches: np.ndarray
    send: dict[int, np.ndarray]
    recv: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]


def assign(wanted: Sequence[Wanted | None]) -> list[Exchange] | None:
    """The coordinator's plan: a reader for every location two or more ranks want.

    ``wanted[r]``: rank ``r``'s locations (None: it wants none). Returns one
    :class:`Exchange` per rank, or None when no location is wanted twice (nothing to
    share: every rank reads its own). A location is its file, offset and length. Linear in
    the rows after one sort: no pass per rank or per pair of ranks.
    """
    names: dict[str, int] = {}
    rows = []
    limit = 1 << _OFFSET_BITS
    for rank, w in enumerate(wanted):
        if w is None or not len(w.table):
            continue
        ids = np.array([names.setdefault(f, len(names)) for f in w.files], dtype=np.int64)
        t = np.asarray(w.table, dtype=np.int64).reshape(-1, 3)
        if len(t) and (t[:, 1].max() >= limit or t[:, 1].min() < 0):
            return None  # beyond the key's range (16 TiB files): each rank reads its own
        n = len(t)
        rows.append(np.stack([ids[t[:, 0]], t[:, 1], t[:, 2], np.full(n, rank),
                              np.arange(n)], axis=1))
    if not rows:
        return None
    if len(names) >= 1 << (63 - _OFFSET_BITS):
        return None  # beyond the key's range (half a million files): each reads its own
    table = np.concatenate(rows)  # file id, offset, length, rank, index
    # One sort by (file, offset, length, rank): a location's rows side by side, its
    # holders in order (an empty item and the next one share an offset, not a length).
    where = table[:, 0] << _OFFSET_BITS | table[:, 1]
    order = np.lexsort((table[:, 3], table[:, 2], where))
    st, where = table[order], where[order]
    new = np.r_[True, (where[1:] != where[:-1]) | (st[1:, 2] != st[:-1, 2])]
    if new.all():
        return None  # nothing wanted twice: the common case of a sharded load, cheaply
    starts = np.flatnonzero(new)
    count = np.diff(np.r_[starts, len(st)])
    loc = np.empty(len(table), dtype=np.int64)
    loc[order] = np.cumsum(new) - 1
    shared_loc = count > 1
    shared = shared_loc[loc]
    world = len(wanted)
    load = np.bincount(table[~shared, 3], weights=table[~shared, 2],
                       minlength=world).astype(np.float64)
    reader = _readers(st, starts, count, shared_loc, load, world)
    # Slots: each reader's shared locations by file, then offset.
    who = reader[loc]
    mine = shared & (who == table[:, 3])  # the reader's own row of each shared location
    rrows = np.flatnonzero(mine)
    rrows = rrows[np.lexsort((table[rrows, 1], table[rrows, 0], who[rrows]))]
    slot_of = np.full(len(count), -1, dtype=np.int64)
    batch_of = np.full(len(count), -1, dtype=np.int64)
    out = [Exchange(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), {}, {})
           for _ in range(world)]
    for r, of_r in _split(rrows, who[rrows]):
        slot_of[loc[of_r]] = np.arange(len(of_r))
        out[r].read = table[of_r, 4]
        out[r].batches = batches_of(table[of_r, 2])
        batch_of[loc[of_r]] = out[r].batches
    # Receivers: every other holder, in slot order per sender.
    xrows = np.flatnonzero(shared & ~mine)
    xrows = xrows[np.lexsort((slot_of[loc[xrows]], who[xrows], table[xrows, 3]))]
    for dst, of_dst in _split(xrows, table[xrows, 3]):
        for src, pair in _split(of_dst, who[of_dst]):
            slots = slot_of[loc[pair]]
            out[dst].recv[src] = (table[pair, 4], slots, batch_of[loc[pair]])
            out[src].send[dst] = slots
    return out


def _split(rows: np.ndarray, keys: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``rows`` cut where ``keys`` (sorted alike) changes: ``[(key, rows with it)]``."""
    if not len(rows):
        return []
    cut = np.flatnonzero(keys[1:] != keys[:-1]) + 1
    edges = np.r_[0, cut, len(rows)]
    return [(int(keys[a]), rows[a:b]) for a, b in zip(edges[:-1], edges[1:])]


def _readers(st: np.ndarray, starts: np.ndarray, count: np.ndarray, shared_loc: np.ndarray,
             load: np.ndarray, world: int) -> np.ndarray:
    """The reader of each location (-1 where not shared). ``st``: the rows sorted by
    (file, offset, length, rank), location ``k``'s from ``starts[k]`` on, ``count[k]`` of them;
    ``load``: bytes each rank reads alone (updated). Locations with the same holders are
    taken together, the largest such set first, in file order, and cut into one contiguous
    stretch per holder (in rank order) so that every holder ends up as near the set's mean
    load as whole items allow: a reader's items lie side by side in the files, so its reads
    stay few and read no bytes between them that it does not need."""
    # Locations grouped by holder set: a random 64-bit value per rank, summed per location,
    # names the set; each group is then checked to hold exactly its first location's ranks.
    weights = np.random.default_rng(0x5EED).integers(1, 1 << 62, size=world, dtype=np.int64)
    ranks = st[:, 3]
    with np.errstate(over="ignore"):
        names = np.add.reduceat(weights[ranks], starts)
    locs = np.flatnonzero(shared_loc)
    reader = np.full(len(starts), -1, dtype=np.int64)
    sets = []
    for name in np.unique(names[locs]).tolist():
        members = locs[names[locs] == name]
        first = int(members[0])
        holders = ranks[starts[first]:starts[first] + count[first]]
        n = len(holders)
        rows = starts[members][:, None] + np.arange(n)
        if not ((count[members] == n).all() and (ranks[rows] == holders).all()):
            raise AssertionError("two holder sets share a name")  # 2**-62: never
        sets.append((holders, members))
    sets.sort(key=lambda hm: -int(st[starts[hm[1]], 2].sum()))
    for holders, members in sets:  # already in file order: ``st`` is sorted so
        lengths = st[starts[members], 2].astype(np.float64)
        have = load[holders]
        mean = (lengths.sum() + have.sum()) / len(holders)
        quota = np.maximum(0.0, mean - have)
        if quota.sum() > 0:
            quota *= lengths.sum() / quota.sum()
        # Item k goes to the holder whose stretch holds its middle byte.
        middles = np.cumsum(lengths) - lengths / 2
        which = np.minimum(np.searchsorted(np.cumsum(quota), middles, side="right"),
                           len(holders) - 1)
        chosen = holders[which]
        reader[members] = chosen
        load += np.bincount(chosen, weights=lengths, minlength=world)
    return reader


def slot_offsets(lengths: np.ndarray) -> tuple[np.ndarray, int]:
    """Each item's offset in an arena holding ``lengths`` in order, and the arena's size."""
    lengths = np.asarray(lengths, dtype=np.int64)
    sizes = aligned(lengths)
    ends = np.cumsum(sizes)
    return ends - sizes, int(ends[-1]) if len(ends) else 0


def batches_of(lengths: np.ndarray) -> np.ndarray:
    """The batch of each slot of an arena holding ``lengths``: the ``BATCH_BYTES`` stretch
    its first byte lies in (an item larger than a batch is a batch of its own)."""
    offsets, _ = slot_offsets(lengths)
    return offsets // BATCH_BYTES


def runs(slots: np.ndarray, batches: np.ndarray) -> list[tuple[int, int]]:
    """``[a, b)`` index ranges of ``slots`` (ascending) whose slots are consecutive and in
    one batch (``batches``: each slot's batch): each is one range of the sender's arena."""
    if not len(slots):
        return []
    cut = np.flatnonzero((np.diff(slots) != 1) | (np.diff(batches) != 0)) + 1
    edges = np.r_[0, cut, len(slots)]
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


def receive_layout(lengths: np.ndarray, slots: np.ndarray, batches: np.ndarray
                   ) -> tuple[list[tuple[int, int, int, int]], np.ndarray, int]:
    """A buffer for the items of ``lengths`` a sender holds at ``slots`` (ascending, in
    ``batches``): ``(start, bytes, a, b)`` of each run (:func:`runs`) in order (where it
    lies in the buffer, and its items ``[a, b)``), each item's offset in the buffer, and
    the buffer's size. A run's bytes are the sender's arena from its first item's slot to
    the end of its last item; it starts aligned."""
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.empty(len(lengths), dtype=np.int64)
    layout, base = [], 0
    for a, b in runs(slots, batches):
        rel, _ = slot_offsets(lengths[a:b])
        offsets[a:b] = base + rel
        nbytes = int(rel[-1] + lengths[b - 1])
        layout.append((base, nbytes, a, b))
        base += int(aligned(nbytes))
    return layout, offsets, base


def send_layout(share: Exchange, lengths: np.ndarray
                ) -> tuple[np.ndarray, int, dict[int, list[tuple[int, int, int]]]]:
    """The sender's side of :func:`receive_layout`: each slot's offset in its arena, the
    arena's size, and per batch the ``(rank, start, bytes)`` of every run it sends, in the
    order each receiver expects them. ``lengths``: the rank's item lengths, by own index."""
    own = np.asarray(lengths, dtype=np.int64)[share.read]
    offsets, size = slot_offsets(own)
    out: dict[int, list[tuple[int, int, int]]] = {}
    for dst in sorted(share.send):
        slots = share.send[dst]
        for a, b in runs(slots, share.batches[slots]):
            first, last = int(slots[a]), int(slots[b - 1])
            start = int(offsets[first])
            out.setdefault(int(share.batches[first]), []).append(
                (dst, start, int(offsets[last] + own[last]) - start))
    return offsets, size, out


def pieces(buffer: torch.Tensor, start: int, nbytes: int) -> list[torch.Tensor]:
    """``buffer[start:start + nbytes]`` as messages of at most ``CHUNK_BYTES`` each."""
    return [buffer[o:min(o + CHUNK_BYTES, start + nbytes)]
            for o in range(start, start + nbytes, CHUNK_BYTES)]


def post_receives(group: Any, incoming: dict[int, list[torch.Tensor]]) -> list[Any]:
    """Post a receive from each group rank into each of its buffers, in list order."""
    works = []
    for src in sorted(incoming):
        peer = dist.get_global_rank(group, src)
        for buf in incoming[src]:
            works.append(dist.irecv(buf, src=peer, group=group, tag=TRANSFER_TAG))
    return works


def post_send(group: Any, dst: int, messages: list[torch.Tensor]) -> list[Any]:
    """Post the sends of ``messages`` to group rank ``dst``, in order."""
    peer = dist.get_global_rank(group, dst)
    return [dist.isend(buf, dst=peer, group=group, tag=TRANSFER_TAG) for buf in messages]
