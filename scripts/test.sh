#!/usr/bin/env bash
# Set up everything from nothing and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Test files run in parallel, each whole on one worker (its module fixtures run once), the
# slowest files first (tests/conftest.py; --no-loadscope-reorder keeps that order, where xdist
# would hand out the files with the most tests first). Most tests wait on processes they
# started, so 3 workers keep 2 cores busy. TEST_WORKERS=0 runs them in this process.
exec .venv/bin/python -m pytest -n "${TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder "$@"
