"""The parallel layout: its config, its validation, and the (pp, dp, tp) DeviceMesh.

``validate_layout`` is pure (no process group, no tensors): the config loader, a layout
planner and tests can call it anywhere. ``build_mesh`` validates and then creates the one
``DeviceMesh`` every other part of ``trainer/`` uses; all ranks must call it, in the same
order relative to other collectives, because ``init_device_mesh`` creates sub-groups.

Rank order: ranks are laid out row-major over ``(pp, dp, tp)``, so tp neighbours are
adjacent ranks (on GPUs: the same node, where the all-reduces of TP are cheapest) and pp is
the outermost axis (its point-to-point traffic is the lightest).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from trainer.model import ModelConfig

__all__ = [
    "ParallelConfig",
    "SCHEDULES",
    "DP_MODES",
    "validate_layout",
    "build_mesh",
    "MESH_AXES",
]

MESH_AXES = ("pp", "dp", "tp")
SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")
DP_MODES = ("fsdp", "ddp")
PARAM_DTYPES = ("float32", "bfloat16")


@dataclass
class ParallelConfig:
    """How the model is spread over ranks. World size must equal ``pp * dp * tp``."""

    pp: int = 1
    """Pipeline-parallel degree (number of pipeline ranks)."""
    dp: int = 1
    """Data-parallel degree; each dp rank trains on ``global_batch / dp`` samples."""
    tp: int = 1
    """Tensor-parallel degree; must divide n_heads, dim and the MLP hidden size."""
    dp_mode: str = "fsdp"
    """``"fsdp"`` (FSDP2 ``fully_shard``, composes with TP) or ``"ddp"`` (needs tp == 1)."""
    schedule: str = "1f1b"
    """Pipeline schedule when pp > 1: ``"gpipe"``, ``"1f1b"`` or ``"interleaved1f1b"``."""
    n_microbatches: int = 1
    """Micro-batches per step; the local batch must divide by it (also used when pp == 1)."""
    stages_per_rank: int = 1
    """Virtual pipeline stages per pp rank; > 1 only with ``interleaved1f1b``."""
    sequence_parallel: bool = False
    """Shard norms/activations along the sequence on the tp axis (saves activation memory)."""
    param_dtype: str = "float32"
    """Compute dtype: ``"bfloat16"`` for mixed precision (grads reduced in fp32)."""

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "n_microbatches", "stages_per_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{name} must be an integer >= 1, got {value!r}")
        self.schedule = self.schedule.lower()
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"parallel.schedule must be one of {SCHEDULES}, got {self.schedule!r}"
            )
        if self.dp_mode not in DP_MODES:
            raise ValueError(f"parallel.dp_mode must be one of {DP_MODES}, got {self.dp_mode!r}")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(
                f"parallel.param_dtype must be one of {PARAM_DTYPES}, got {self.param_dtype!r}"
            )

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def num_stages(self) -> int:
        """Total pipeline stages (``pp * stages_per_rank``)."""
        return self.pp * self.stages_per_rank


def validate_layout(
    model_cfg: ModelConfig,
    par: ParallelConfig,
    world_size: int,
    global_batch_size: int,
    seq_len: Optional[int] = None,
) -> None:
    """Raise ``ValueError`` naming the offending field and the fix if the layout cannot work.

    Pure: needs no process group, so it can run before ``init_process_group`` (config
    loading, planning) and in tests.
    """
    if world_size != par.world_size:
        raise ValueError(
            f"world size {world_size} != parallel.pp * parallel.dp * parallel.tp = "
            f"{par.pp} * {par.dp} * {par.tp} = {par.world_size}; change the degrees or the "
            "number of processes so they match"
        )
    for what, size in (
        ("model.n_heads", model_cfg.n_heads),
        ("model.dim", model_cfg.dim),
        ("the MLP hidden size (model.ffn_dim)", model_cfg.hidden_ffn_dim),
    ):
        if size % par.tp:
            raise ValueError(
                f"parallel.tp = {par.tp} must divide {what} = {size}; "
                f"pick a tp that divides it"
            )
    if par.stages_per_rank > 1 and par.schedule != "interleaved1f1b":
        raise ValueError(
            f"parallel.stages_per_rank = {par.stages_per_rank} needs "
            f"parallel.schedule = 'interleaved1f1b' (got {par.schedule!r}); "
            "set stages_per_rank = 1 or change the schedule"
        )
    if par.num_stages > model_cfg.n_layers:
        raise ValueError(
            f"parallel.pp * parallel.stages_per_rank = {par.num_stages} pipeline stages "
            f"but model.n_layers = {model_cfg.n_layers}; every stage needs at least one layer: "
            "lower parallel.pp or parallel.stages_per_rank"
        )
    if par.dp_mode == "ddp" and par.tp > 1:
        raise ValueError(
            "parallel.dp_mode = 'ddp' does not compose with tensor parallelism "
            f"(parallel.tp = {par.tp}); use dp_mode = 'fsdp' or tp = 1"
        )
    if global_batch_size < 1 or global_batch_size % par.dp:
        raise ValueError(
            f"global batch size {global_batch_size} must be a positive multiple of "
            f"parallel.dp = {par.dp}; change the batch size or dp"
        )
    local_batch = global_batch_size // par.dp
    if local_batch % par.n_microbatches:
        raise ValueError(
            f"parallel.n_microbatches = {par.n_microbatches} must divide the per-dp-rank batch "
            f"{global_batch_size} / {par.dp} = {local_batch}; change n_microbatches or the "
            "batch size"
        )
    if par.pp > 1 and par.schedule == "1f1b" and par.n_microbatches < par.num_stages:
        raise ValueError(
            f"parallel.n_microbatches = {par.n_microbatches} < {par.num_stages} pipeline stages; "
            "1F1B needs at least one micro-batch per stage: raise n_microbatches"
        )
    if par.pp > 1 and par.schedule == "interleaved1f1b":
        rounds = max(1, par.n_microbatches // par.pp)
        if par.n_microbatches % rounds:
            raise ValueError(
                f"parallel.n_microbatches = {par.n_microbatches} must be a multiple of "
                f"max(1, n_microbatches // pp) = {rounds} for interleaved 1F1B; use a multiple "
                f"of parallel.pp = {par.pp}"
            )
    if seq_len is not None:
        if seq_len > model_cfg.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} > model.max_seq_len = {model_cfg.max_seq_len}; "
                "shorten the sequences or raise max_seq_len"
            )
        if par.sequence_parallel and seq_len % par.tp:
            raise ValueError(
                f"parallel.sequence_parallel shards the sequence over tp = {par.tp}, which must "
                f"divide the sequence length {seq_len}; change tp or the sequence length"
            )


def build_mesh(
    par: ParallelConfig,
    device_type: str = "cpu",
    model_cfg: Optional[ModelConfig] = None,
    global_batch_size: Optional[int] = None,
    seq_len: Optional[int] = None,
):
    """Create the ``DeviceMesh`` with axes ``("pp", "dp", "tp")`` over the whole world.

    Contract: every rank of an initialised default process group calls this once, with the
    same arguments. When ``model_cfg`` and ``global_batch_size`` are given the full layout is
    validated first (``validate_layout``); otherwise only the world size is checked.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if model_cfg is not None and global_batch_size is not None:
        validate_layout(model_cfg, par, world_size, global_batch_size, seq_len)
    elif world_size != par.world_size:
        raise ValueError(
            f"world size {world_size} != parallel.pp * parallel.dp * parallel.tp = "
            f"{par.world_size}; change the degrees or the number of processes"
        )
    return init_device_mesh(device_type, (par.pp, par.dp, par.tp), mesh_dim_names=MESH_AXES)
