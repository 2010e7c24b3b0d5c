#!/usr/bin/env bash
# GPU check: a bf16 FSDP2 job killed and resumed bit for bit under torchrun on 1 GPU (and
# its process groups' backends); staged FSDP2 and TP DTensors equal to the live shards, on the
# host, holding no GPU memory (1 GPU, and 2 where present); on 2 GPUs, rank 1's save (with
# and without prepare(), and through a writer process that must see no GPU) leaving no CUDA
# context and no memory of its process on GPU 0 (skipped on one GPU, and said so); the staging stall against a pinned copy and DCP's
# pinned async_save, and the training stream's wait; every rank's GPU metrics (NVML's
# temperature, power, utilization, memory; the allocator's; on 2 GPUs the collectives)
# known and non-zero (bash scripts/gpu_check.sh --only metrics; needs pip install 'ckpt[nvml]').
# Under 8 minutes on one GPU; prints that it skipped and exits 0 where there is no CUDA.
# Only the 2-GPU check: bash scripts/gpu_check.sh --only devices
# Results: bench/results/gpu_check.{json,md}. Arguments go to bench/gpu_check.py (--help).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" bench/gpu_check.py "$@"
