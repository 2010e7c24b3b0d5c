#!/usr/bin/env bash
# Create .venv and install the project with its test and ft (torchft) extras. Idempotent.
# torch is installed first and pinned, so that no multi-GB CUDA build is pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,ft]"
