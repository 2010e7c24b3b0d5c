"""The (pp, dp, tp) DeviceMesh of a parallel layout.

The layout itself is :class:`trainer.config.ParallelConfig` (the ``[parallel]`` config
section): its rules run when a config is built and resolved, or when a
library caller runs ``ParallelConfig.check``; this module only turns a resolved layout into
the one ``DeviceMesh`` every other part of ``trainer/`` uses.

Rank order: ranks are laid out row-major over ``(pp, dp, tp)``, so tp neighbours are
adjacent ranks (on GPUs: the same node, where the all-reduces of TP are cheapest) and pp is
the outermost axis (its point-to-point traffic is the lightest).

HSDP (``par.hsdp``): the dp axis is split row-major into ``(dp_replicate, dp_shard)``, so the
mesh has the axes :data:`HSDP_MESH_AXES`, and :func:`dp_mesh` is the two flattened back into
one (dp rank = replicate rank * dp_shard + shard rank, the same rank order as without the
split). A shard group is ``dp_shard * tp`` adjacent ranks: a node, when that is its size.
Everything that needs "the data-parallel group" (data slices, loss means, DDP) uses
:func:`dp_mesh` on every layout; only FSDP uses ``mesh["dp_replicate", "dp_shard"]``.

Expert parallelism (``par.ep > 1``): the mesh has the axes :data:`EP_MESH_AXES`, dp_shard
split row-major into ``(dp_shard_mod_ep, ep)`` (torchtitan's names), so an ep group is
``ep`` dp ranks ``tp`` apart and the dp rank order is again the one without the split.
:func:`dp_mesh` flattens all three dp axes; FSDP shards the dense parameters over
:func:`fsdp_mesh` (all of dp_shard) and the experts over :func:`expert_fsdp_mesh`
(dp_shard_mod_ep); the experts themselves are split over ``mesh["ep"]``.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.config import ParallelConfig

__all__ = ["build_mesh", "dp_mesh", "fsdp_mesh", "expert_fsdp_mesh", "MESH_AXES",
           "HSDP_MESH_AXES", "EP_MESH_AXES"]

MESH_AXES = ("pp", "dp", "tp")
HSDP_MESH_AXES = ("pp", "dp_replicate", "dp_shard", "tp")
EP_MESH_AXES = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "tp")


def build_mesh(par: ParallelConfig, device_type: str = "cpu"):
    """Create the ``DeviceMesh`` with axes ``("pp", "dp", "tp")`` over the whole world; under
    HSDP with axes ``("pp", "dp_replicate", "dp_shard", "tp")``; with expert parallelism
    with :data:`EP_MESH_AXES` (take the dp axis with :func:`dp_mesh`, on any).

    Contract: every rank of an initialised default process group calls this once, with the
    same arguments, in the same order relative to other collectives (``init_device_mesh``
    creates sub-groups). ``par`` must be resolved (``dp != -1``) and already checked
    (``Config.resolved`` or ``par.check``); here only the world size is compared, because
    that is the one fact a config cannot know.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if world_size != par.world_size:
        raise ValueError(
            f"parallel.dp: world size {world_size} != parallel.pp * parallel.dp * parallel.tp = "
            f"{par.pp} * {par.dp} * {par.tp} = {par.world_size}; change the degrees or the "
            "number of processes so they match"
        )
    if par.ep > 1:
        mesh = init_device_mesh(device_type, (par.pp, par.dp_replicate, par.dp_shard_mod_ep,
                                              par.ep, par.tp), mesh_dim_names=EP_MESH_AXES)
        dp_mesh(mesh)  # the flattened groups, now, while every rank is here
        fsdp_mesh(mesh, par)
        return mesh
    if not par.hsdp:
        return init_device_mesh(device_type, (par.pp, par.dp, par.tp), mesh_dim_names=MESH_AXES)
    mesh = init_device_mesh(device_type, (par.pp, par.dp_replicate, par.dp_shard, par.tp),
                            mesh_dim_names=HSDP_MESH_AXES)
    dp_mesh(mesh)  # creates the flattened dp group now, while every rank is here
    return mesh


def dp_mesh(mesh):
    """The 1-D data-parallel sub-mesh of a :func:`build_mesh` mesh: its ``"dp"`` axis, or
    under HSDP ``dp_replicate x dp_shard`` flattened (made once, then cached by the mesh).

    Collective the first time on an HSDP mesh (it creates a process group): :func:`build_mesh`
    calls it, so later calls on any rank are local.
    """
    names = mesh.mesh_dim_names or ()
    if "dp" in names:
        return mesh["dp"]
    # torch 2.13 keeps flattening private (torchtitan builds its dp axes the same way);
    # slicing "dp" from the root mesh instead is deprecated, so the flattened mesh is
    # always reached through this call.
    if "ep" in names:
        return mesh["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("dp")
    return mesh["dp_replicate", "dp_shard"]._flatten("dp")


def fsdp_mesh(mesh, par: ParallelConfig):
    """The mesh FSDP2 shards the dense parameters over: the dp axis, or under HSDP the 2-D
    ``(dp_replicate, dp_shard)`` (with expert parallelism dp_shard is its two axes
    flattened). Collective the first time on an ep mesh (:func:`build_mesh` calls it)."""
    if par.ep > 1:
        shard = mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        # Slicing a flattened axis from the root is deprecated: join the two sub-meshes.
        return DeviceMesh._concatenate([mesh["dp_replicate"], shard]) if par.hsdp else shard
    return mesh["dp_replicate", "dp_shard"] if par.hsdp else mesh["dp"]


def expert_fsdp_mesh(mesh, par: ParallelConfig):
    """The mesh FSDP2 shards the routed experts over when ``par.ep > 1``: dp_shard_mod_ep,
    under HSDP with dp_replicate in front (the experts are already split over ep)."""
    return mesh["dp_replicate", "dp_shard_mod_ep"] if par.hsdp else mesh["dp_shard_mod_ep"]
