"""Bytes through ``torch.distributed.checkpoint``: save, load, and what makes them ours.

DCP's planners understand DTensor, FSDP2 and tensor-parallel shards (which is what makes
resharding work); everything else is ours. ``api`` (:func:`save`, :func:`load`,
:func:`load_latest`): the collective save and the transactional load; a manager's saves
go through :func:`save_with` with a :class:`SaveRequest`. ``planners``: what
each rank saves and loads, pickle-free (``plancache``: a save's plan, reused while the
layout stays). ``writer`` and ``reader``: where the bytes go and how they come back
verified (``layout``: a data file's bytes; ``_shards``: which chunks go in a rank's part,
which it refers to, and whether the parts a loading rank read cover it; ``_coop``: a byte
several loading ranks need read by one of them and sent to the others). ``staging``: the
host copy that is a save's only stall (``_host_arena``: one pinned allocation, or a shared
one, whose blocks that killed processes left behind :func:`remove_stale_shared_blocks`
removes; ``_shm``: a
staged copy handed to a writer process, rebuilt there over the shared block:
:class:`SharedBlocks`, :func:`rebuild_staged`).
``stateful``: models, optimizers, RNG and per-rank state as state dicts (``optim_state``:
an optimizer's replicated values once per param group). ``attachments``: small files kept
with a checkpoint. ``savecost``: what one save costs in the background, by phase.
"""

from ckpt.dcp._host_arena import remove_stale_shared_blocks
from ckpt.dcp._shm import SharedBlocks, rebuild_staged
from ckpt.dcp.api import SaveRequest, load, load_latest, save
from ckpt.dcp.attachments import (
    check_attachments,
    list_attachments,
    read_attachment,
    read_from,
)
from ckpt.dcp.optim_state import (
    pack_optimizer_state,
    param_group_names,
    saved_groups,
    unpack_optimizer_state,
)
from ckpt.dcp.plancache import SavePlanCache
from ckpt.dcp.savecost import SaveCost
from ckpt.dcp.staging import StagingBuffers
from ckpt.dcp.stateful import ModelState, PerRankState, RNGState, init_optimizer_state, rank_key

__all__ = [
    "save", "SaveRequest", "load", "load_latest", "SavePlanCache", "StagingBuffers", "ModelState",
    "RNGState", "PerRankState", "rank_key", "init_optimizer_state", "pack_optimizer_state",
    "unpack_optimizer_state", "saved_groups", "param_group_names", "check_attachments",
    "read_attachment", "list_attachments", "read_from", "SaveCost", "SharedBlocks", "rebuild_staged",
    "remove_stale_shared_blocks",
]
