#!/usr/bin/env bash
# The main job: set up, then train a tiny transformer on 2 CPU ranks (torchrun, gloo) with
# asynchronous checkpoints on local disk and Prometheus metrics; kill it with SIGKILL midway,
# start it again and watch it resume by itself; finally list and verify the checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== 0. setting up .venv (log: runs/setup.log)"
mkdir -p runs
bash scripts/setup.sh > runs/setup.log 2>&1 || { tail -30 runs/setup.log; exit 1; }
PY=.venv/bin/python
RUN=${RUN_DIR:-runs/demo}
STEPS=${STEPS:-120}
rm -rf "$RUN" && mkdir -p "$RUN"
train() {
  .venv/bin/torchrun --standalone --nproc-per-node 2 -m trainer --config configs/tiny.toml \
    --training.steps="$STEPS" --checkpoint.root="$RUN/ckpt" --checkpoint.interval=20 \
    --metrics.port="${METRICS_PORT:-9109}" --metrics.host=127.0.0.1 \
    --metrics.jsonl_path="$RUN/events.jsonl" "$@"
}

echo "== 1. training; it will be killed (SIGKILL) once two checkpoints are committed"
train > "$RUN/run1.log" 2>&1 &
pid=$!
for _ in $(seq 600); do
  n=$( (ls -d "$RUN"/ckpt/step_*/manifest.json 2>/dev/null || true) | wc -l)
  [ "$n" -ge 2 ] && break
  kill -0 $pid 2>/dev/null || break
  sleep 0.2
done
# torchrun starts its workers in sessions of their own: kill the whole tree, by pid.
descendants() { local c; for c in $(pgrep -P "$1" 2>/dev/null); do echo "$c"; descendants "$c"; done; }
kill -9 $(descendants "$pid") "$pid" 2>/dev/null || true
wait $pid 2>/dev/null || true
grep -E "step +[0-9]+ \|" "$RUN/run1.log" | tail -3 || true
echo "   killed. checkpoints left behind:"
$PY -m ckpt list "$RUN/ckpt"

echo "== 2. the same command again: it resumes from the newest valid checkpoint"
train 2>&1 | grep -E "resumed|took over|step +[0-9]+ \||no checkpoint" | grep -v "^W"

echo "== 3. the checkpoints, verified (full crc32c pass), and exported"
$PY -m ckpt list "$RUN/ckpt"
$PY -m ckpt verify "$RUN/ckpt"
$PY -m ckpt export "$RUN/ckpt" --out "$RUN/final.safetensors"
echo "metrics were served on http://127.0.0.1:${METRICS_PORT:-9109}/metrics; events in $RUN/events.jsonl"
