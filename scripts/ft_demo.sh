#!/usr/bin/env bash
# Fault-tolerant replica groups in one command, on this machine (loopback, gloo, a few
# minutes): a torchft lighthouse (listening on 127.0.0.1 only) and 2 replica groups of the
# tiny config; the worker of the group that does not hold the checkpoint lease is SIGKILLed
# mid-run, the other trains on, the killed one rejoins with the live state; at the end both
# replicas are compared and the durable root verified (`ckpt verify`). The last line is one
# JSON object (recovery_seconds, healthy_steps_during_outage, replicas_identical,
# durable_verified, ...).
#
#   bash scripts/ft_demo.sh OUTDIR            # sets up .venv (with the 'ft' extra) first
#   PYTHON=/path/to/python bash scripts/ft_demo.sh OUTDIR   # that interpreter, no set-up
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash scripts/ft_demo.sh OUTDIR}
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
else
  mkdir -p runs
  echo "== 0. setting up .venv (log: runs/setup.log)"
  bash scripts/setup.sh > runs/setup.log 2>&1 || { tail -30 runs/setup.log; exit 1; }
  PY=.venv/bin/python
fi
exec "$PY" scripts/ft_demo.py "$OUT" "${@:2}"
