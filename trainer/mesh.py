"""The (pp, dp, tp) DeviceMesh of a parallel layout.

The layout itself is :class:`trainer.config_schema.ParallelConfig` (the ``[parallel]`` config
section, re-exported here): its rules run when a config is built and resolved, or when a
library caller runs ``ParallelConfig.check``; this module only turns a resolved layout into
the one ``DeviceMesh`` every other part of ``trainer/`` uses.

Rank order: ranks are laid out row-major over ``(pp, dp, tp)``, so tp neighbours are
adjacent ranks (on GPUs: the same node, where the all-reduces of TP are cheapest) and pp is
the outermost axis (its point-to-point traffic is the lightest).
"""

from __future__ import annotations

from trainer.config_schema import ParallelConfig

__all__ = ["ParallelConfig", "build_mesh", "MESH_AXES"]

MESH_AXES = ("pp", "dp", "tp")


def build_mesh(par: ParallelConfig, device_type: str = "cpu"):
    """Create the ``DeviceMesh`` with axes ``("pp", "dp", "tp")`` over the whole world.

    Contract: every rank of an initialised default process group calls this once, with the
    same arguments, in the same order relative to other collectives (``init_device_mesh``
    creates sub-groups). ``par`` must be resolved (``dp != -1``) and already checked
    (``Config.resolved`` or ``par.check``); here only the world size is compared, because
    that is the one fact a config cannot know.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if world_size != par.world_size:
        raise ValueError(
            f"parallel.dp: world size {world_size} != parallel.pp * parallel.dp * parallel.tp = "
            f"{par.pp} * {par.dp} * {par.tp} = {par.world_size}; change the degrees or the "
            "number of processes so they match"
        )
    return init_device_mesh(device_type, (par.pp, par.dp, par.tp), mesh_dim_names=MESH_AXES)
