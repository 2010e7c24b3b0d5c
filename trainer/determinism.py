"""Deterministic kernels: what a bit-exact resume needs on a GPU (``training.deterministic``).

A resumed run equals an uninterrupted one bit for bit only if every kernel gives the same
bits for the same inputs. On CPU the trainer's kernels already do. On CUDA they need:

* ``torch.use_deterministic_algorithms(True)``: deterministic variants where torch has them
  (``index_add``, ``scatter_add``, ...), and an error instead of a silent non-deterministic
  kernel where it has none;
* ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: cuBLAS is deterministic only with a fixed workspace
  per stream (its documentation, "Results reproducibility"); read when torch creates its
  first cuBLAS handle, so set before any CUDA work (``python -m trainer`` sets it before the
  process group, hence before CUDA starts). A value the user set is kept (``:16:8`` is
  deterministic too; torch refuses any other under the flag);
* ``torch.backends.cudnn.benchmark = False`` (and ``cudnn.deterministic``): no per-shape
  algorithm search, whose winner can differ between runs.

With the flag on, torch also fills memory it hands out uninitialised (``torch.empty``) with
a known value (``torch.utils.deterministic.fill_uninitialized_memory``): one write per such
allocation. Turned off, torch's defaults come back (the environment variable, once set,
stays: the process's cuBLAS may already use it; ``cudnn.benchmark`` stays off).
"""

from __future__ import annotations

import os

import torch

__all__ = ["CUBLAS_WORKSPACE_CONFIG", "apply_determinism"]

CUBLAS_WORKSPACE_CONFIG = ":4096:8"


def apply_determinism(enabled: bool) -> None:
    """Turn deterministic kernels on or off for this process (idempotent)."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
    if enabled:
        torch.backends.cudnn.benchmark = False
