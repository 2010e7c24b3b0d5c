#!/usr/bin/env bash
# The body of the Slurm recipes (train.sbatch, train_multinode.sbatch): run the trainer as one
# srun step, one task per rank, and decide what the job does when the step ends. From the batch
# script, in the repository root:
#
#   exec bash scripts/slurm/launch.sh GRACE_SECONDS COMMAND [ARGS...]
#
# GRACE_SECONDS is the N of the batch script's `#SBATCH --signal=B:USR1@N`; the trainer gets it
# as --fault.preemption_grace_seconds (it warns when a save takes longer).
#
# Signals. Slurm sends the time limit's warning (USR1, N seconds ahead) to this batch shell only
# (the B: of --signal); `scancel --signal=TERM JOB` and a preemption's TERM reach the ranks (a
# preemption this shell too). This shell forwards what it gets to the ranks with
# `scancel --signal` (never `kill` to srun: srun answers TERM by killing its tasks). The ranks
# agree at the step boundary, save that step (blocking) and exit 75.
#
# When the step ends (srun's exit status: the highest of the ranks'):
#   0        finished: the job ends with 0
#   75       saved on a signal: requeue (scontrol requeue; the next run resumes from that step)
#   3, 124   final save not committed, hang watchdog: requeue (resume from the newest checkpoint)
#   other    after a signal reached this shell (cut short before it could save): requeue;
#            else the job fails with that status (1 training failed, 2 bad config, 4 another
#            job holds the checkpoint root)
# Requeued at most MAX_REQUEUES times (default 20; SLURM_RESTART_COUNT counts them).
#
# Metrics (optional): METRICS_PORT: every rank serves Prometheus metrics on METRICS_PORT + its
# local rank. METRICS_SD_DIR: a folder Prometheus reads file_sd targets from; while a run lasts
# it holds slurm-<job id>.json, this run's targets labelled slurm_job_id and slurm_restart_count.
set -uo pipefail
if [ $# -lt 2 ] || ! [[ $1 =~ ^[0-9]+([.][0-9]+)?$ ]]; then
  echo "usage: launch.sh GRACE_SECONDS COMMAND [ARGS...] (GRACE_SECONDS: the N of --signal=B:USR1@N)" >&2
  exit 2
fi
: "${SLURM_JOB_ID:?launch.sh runs inside a Slurm batch job (sbatch scripts/slurm/train.sbatch)}"
grace=$1
shift
restart=${SLURM_RESTART_COUNT:-0}
max_requeues=${MAX_REQUEUES:-20}
targets_file=""
signaled=""

say() { echo "launch: $*"; }

forward() {
  signaled=$1
  say "$1 received: forwarding it to the ranks (they save and exit 75)"
  scancel --signal="$1" "$SLURM_JOB_ID" || say "scancel --signal=$1 failed"
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

write_targets() {
  [ -n "${METRICS_PORT:-}" ] && [ -n "${METRICS_SD_DIR:-}" ] || return 0
  local hosts counts=() parts part h r j targets=""
  mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  IFS=, read -ra parts <<< "${SLURM_TASKS_PER_NODE:-1}"
  for part in "${parts[@]}"; do  # "8(x2),4": 8 tasks on each of 2 nodes, then 4
    if [[ $part =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
      for ((j = 0; j < BASH_REMATCH[2]; j++)); do counts+=("${BASH_REMATCH[1]}"); done
    else
      counts+=("$part")
    fi
  done
  for h in "${!hosts[@]}"; do
    for ((r = 0; r < ${counts[h]:-1}; r++)); do
      targets+="${targets:+, }\"${hosts[h]}:$((METRICS_PORT + r))\""
    done
  done
  targets_file="$METRICS_SD_DIR/slurm-$SLURM_JOB_ID.json"
  printf '[{"targets": [%s], "labels": {"slurm_job_id": "%s", "slurm_restart_count": "%s"}}]\n' \
    "$targets" "$SLURM_JOB_ID" "$restart" > "$targets_file.tmp" && mv "$targets_file.tmp" "$targets_file"
}

extra=(--fault.preemption_grace_seconds="$grace")
[ -n "${METRICS_PORT:-}" ] && extra+=(--metrics.port="$METRICS_PORT")
say "job $SLURM_JOB_ID run $((restart + 1)) on ${SLURM_JOB_NODELIST:-?}: ${SLURM_NTASKS:-?} ranks; warned ${grace}s before the time limit"
write_targets
srun "$@" "${extra[@]}" &
step=$!

# `wait` returns early when a trapped signal arrives: wait again while the step runs. Bash keeps
# a finished step's status, so the last `wait` reads it however the loop ended.
while kill -0 "$step" 2>/dev/null; do wait "$step"; done
wait "$step"
rc=$?
[ -n "$targets_file" ] && rm -f "$targets_file"

requeue() {
  local state
  state=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep -o 'JobState=[A-Z_]*')
  if [ "$state" != JobState=RUNNING ]; then
    # Slurm is ending the job: `scancel JOB` (the user's word wins), the hard time limit, or a
    # preemption, after which Slurm requeues a --requeue job itself where the cluster says so.
    say "$1, but Slurm is ending the job ($state): not requeued here"
    exit "$rc"
  fi
  if [ "$restart" -ge "$max_requeues" ]; then
    say "$1; not requeued: this job was requeued $restart times already (MAX_REQUEUES=$max_requeues)" >&2
    exit "$rc"
  fi
  say "$1: requeueing job $SLURM_JOB_ID; its next run resumes from the newest checkpoint"
  if ! scontrol requeue "$SLURM_JOB_ID"; then
    say "scontrol requeue failed (was the job submitted with --requeue?); submit it again to resume" >&2
    exit "$rc"
  fi
  exit 0
}

case $rc in
  0) say "finished"; exit 0 ;;
  75) requeue "the ranks saved on ${signaled:-a signal} and exited 75" ;;
  3) requeue "the final checkpoint did not commit (exit 3)" ;;
  124) requeue "the hang watchdog stopped the ranks (exit 124)" ;;
esac
if [ -n "$signaled" ] && [ "$rc" != 2 ] && [ "$rc" != 4 ]; then
  requeue "the step ended with $rc after $signaled"
fi
say "the step failed with $rc; not requeued" >&2
exit "$rc"
