#!/usr/bin/env bash
# Create .venv and install the project with its test and ft (torchft) extras. Idempotent.
# torch is installed first, pinned. From PyPI on Linux x86_64 torch==2.13.0 is the CUDA build
# (several GB with its nvidia-* and triton wheels; right for a GPU host). On a CPU-only host
# take the CPU build from PyTorch's index:
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
# (a local wheel cache or --find-links holding torch-2.13.0+cpu, as on the CI machines, gives
# the CPU build without it). The project's own "torch==2.13.0" accepts either build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  .venv/bin/python -m pip install -q "torch==2.13.0" --index-url "$TORCH_INDEX_URL"
else
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[test,ft]"
