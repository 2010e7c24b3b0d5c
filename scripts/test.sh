#!/usr/bin/env bash
# Set up everything from nothing and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# The monitoring tests run the shipped rules in a real Prometheus (promtool and prometheus,
# Debian's 'prometheus'); as root with apt-get, install it when missing. Otherwise say at
# once which tests skip and what installs it.
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null \
           && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; }; } \
      || true
  fi
  if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
    echo "note: prometheus is not installed, so the real-Prometheus tests skip (fail with" \
      "CI set): promtool's in tests/monitoring/test_rules.py, test_prometheus.py," \
      "test_alerts_e2e.py; to run them: sudo apt-get install prometheus" >&2
  fi
fi
bash scripts/setup.sh
# tests/e2e/test_slurm.py starts a one-node Slurm of its own (munged, slurmctld, slurmd); on
# Debian, as root, install the packages when missing. Elsewhere those tests skip, saying why.
slurm_pkgs=(slurm-wlm munge)
if ! PATH="$PATH:/usr/sbin:/sbin" command -v slurmctld >/dev/null 2>&1 && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null 2>&1; then
  { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${slurm_pkgs[@]}" >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends "${slurm_pkgs[@]}" >/dev/null; }; } \
    || echo "warning: could not install Slurm; the Slurm tests will skip" >&2
fi
# Test files run in parallel, each whole on one worker (its module fixtures run once), the
# slowest files first (tests/conftest.py; --no-loadscope-reorder keeps that order, where xdist
# would hand out the files with the most tests first). Most tests wait on processes they
# started, so 3 workers keep 2 cores busy. TEST_WORKERS=0 runs them in this process.
exec .venv/bin/python -m pytest -n "${TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder "$@"
