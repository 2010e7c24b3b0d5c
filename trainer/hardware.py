"""Accelerator presets and per-parameter byte costs used by the layout planner.

Figures are vendor datasheet numbers for the SXM parts (dense, i.e. without 2:4 sparsity);
docs/layout-planner.md names the datasheets. ``memory_bytes`` is the capacity the driver
reports (nvidia-smi "Total"), which is what a process can actually allocate from, minus the
CUDA context.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

__all__ = [
    "GpuSpec",
    "GPU_PRESETS",
    "get_gpu",
    "PrecisionCost",
    "PRECISIONS",
    "OPTIMIZER_STATES",
    "GIB",
]

GIB = 1 << 30
_MIB = 1 << 20


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator model. Bandwidths in bytes/s, compute in dense bf16 TFLOP/s."""

    name: str
    memory_bytes: int
    hbm_bandwidth_bytes_per_s: float
    bf16_dense_tflops: float
    nvlink_bytes_per_s: float
    source: str


GPU_PRESETS: dict[str, GpuSpec] = {
    "h100": GpuSpec("H100 SXM5 80GB", 81559 * _MIB, 3.35e12, 989.0, 900e9,
                    "NVIDIA H100 Tensor Core GPU Datasheet (SXM5 column)"),
    "h100-pcie": GpuSpec("H100 PCIe 80GB", 81559 * _MIB, 2.0e12, 756.0, 600e9,
                         "NVIDIA H100 Tensor Core GPU Datasheet (PCIe column; NVLink bridge)"),
    "h200": GpuSpec("H200 SXM 141GB", 143771 * _MIB, 4.8e12, 989.0, 900e9,
                    "NVIDIA H200 Tensor Core GPU Datasheet (SXM column)"),
    "a100-80gb": GpuSpec("A100 SXM4 80GB", 81920 * _MIB, 2.039e12, 312.0, 600e9,
                         "NVIDIA A100 Tensor Core GPU Datasheet (80GB SXM column)"),
    "a100-40gb": GpuSpec("A100 SXM4 40GB", 40960 * _MIB, 1.555e12, 312.0, 600e9,
                         "NVIDIA A100 Tensor Core GPU Datasheet (40GB SXM column)"),
}


def get_gpu(name: str) -> GpuSpec:
    """The preset called ``name`` (case-insensitive; 'h100-80gb' works too)."""
    key = name.lower().replace("_", "-")
    key = {"h100-80gb": "h100", "h100-sxm": "h100", "h200-141gb": "h200", "a100": "a100-80gb"
           }.get(key, key)
    if key not in GPU_PRESETS:
        hint = difflib.get_close_matches(key, GPU_PRESETS, n=1)
        raise ValueError(f"--gpu: unknown preset {name!r}"
                         + (f" (did you mean {hint[0]!r}?)" if hint else "")
                         + f"; choose one of {', '.join(GPU_PRESETS)} or pass --gpu-memory GiB")
    return GPU_PRESETS[key]


@dataclass(frozen=True)
class PrecisionCost:
    """Bytes per parameter for one precision recipe.

    ``weight_bytes``/``grad_bytes``: the model copy used for compute and its gradients.
    ``master_bytes``: an fp32 master copy kept by the optimizer (0 when the weights are it).
    ``state_bytes``: bytes of each optimizer state element (Adam's m and v).
    ``activation_bytes``: bytes per activation element (the Korthikanti formula assumes 2).
    """

    weight_bytes: int
    grad_bytes: int
    master_bytes: int
    state_bytes: int
    activation_bytes: int
    description: str


PRECISIONS: dict[str, PrecisionCost] = {
    "fp32": PrecisionCost(4, 4, 0, 4, 4, "fp32 weights, grads and optimizer state"),
    # ZeRO paper accounting (Rajbhandari et al. 2020): 2 + 2 + K with K = 12 for Adam.
    "bf16-mixed": PrecisionCost(2, 2, 4, 4, 2,
                                "bf16 weights/grads, fp32 master weights and optimizer state"),
    "bf16": PrecisionCost(2, 2, 0, 2, 2, "bf16 everything (no fp32 master copy)"),
}

OPTIMIZER_STATES: dict[str, float] = {
    "adamw": 2.0,  # exp_avg, exp_avg_sq
    "adam": 2.0,
    "sgd": 1.0,  # momentum buffer
    "adafactor": 0.0,  # factored second moment (rows + cols), no momentum: ~0 per param
}
"""Optimizer state elements per parameter (each costs ``PrecisionCost.state_bytes``)."""
