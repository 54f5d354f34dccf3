#!/usr/bin/env bash
# The depth study (studies/depth/README.md): tasks whose answer needs a set number of sequential steps, the looped model's
# accuracy against its loop count r, and looped vs timestep-modulated looped models where depth is needed. Each
# stage is a `loopformer sweep`, so re-running this script completes an interrupted study (finished runs are
# skipped, interrupted ones resume). Runs go to $STUDY (default sweeps/depth, ignored by git); `collect` copies the
# compact results (tables, every run's results.json and dynamics records; the records are not committed) into
# studies/depth/.
#
#   bash studies/depth/depth_study.sh schedule        # the fixed circuit (one layer repeated K = 32 times): looped and
#                                               #   TMLT at r = 4, 16, 32, seeds 0-2 (18 runs, ~3 min each at r = 32)
#   bash studies/depth/depth_study.sh schedule-curve  # ... looped at r = 2 and 8, seed 0 (the rest of the depth curve)
#   bash studies/depth/depth_study.sh pointer         # pointer chasing (16 symbols, 12 hops): looped and TMLT at r = 4, 16,
#                                               #   32, seeds 0-2 (18 runs of 4,000 steps, ~15 min each at r = 32)
#   bash studies/depth/depth_study.sh pointer-curve   # ... looped at r = 2 and 8, seed 0
#   bash studies/depth/depth_study.sh word            # the word problem (S3, 16 elements): looped at r = 4, 16, 32, seed 0
#   bash studies/depth/depth_study.sh distinct        # the circuit with 8 distinct layers (a block must act as different
#                                               #   layers at different loops): looped vs TMLT at r = 8 and 16, seeds 0-2
#   bash studies/depth/depth_study.sh no-targets      # the answer alone in every loop's loss (no per-loop targets), seed 0
#   bash studies/depth/depth_study.sh paper           # the TMLT with the paper's parametrisation (adaLN-Zero gates, one lr)
#   bash studies/depth/depth_study.sh standard        # standard transformers with as many layers as the looped r = 4 / 8
#   bash studies/depth/depth_study.sh icl             # in-context linear regression: looped vs TMLT, r = 4, seeds 0-2
#   bash studies/depth/depth_study.sh ablations       # the TMLTs with the loop index removed / without modulation
#   bash studies/depth/depth_study.sh collect         # tables and compact results into studies/depth/
# Cost on 2 CPU cores (two runs at a time, one thread each): see each stage; the whole study is about 3 hours.
set -euo pipefail
cd "$(dirname "$0")/../.."
STUDY=${STUDY:-sweeps/depth}
. scripts/study_lib.sh

# the loop curriculum the pointer-chasing runs were made with (16 loops, +2 every 100 steps); the config's default
# now starts at 12 and adds 2 every 200 steps (studies/stability/README.md)
POINTER_AS_RUN=(train.loops_start=16 train.loops_every=100)
# the circuit's runs were made with its plain 2,000-step recipe: SCHEDULE_AS_RUN (scripts/study_lib.sh)
as_run() {   # as_run TASK: the overrides its runs were made with, unquoted
  case "$1" in pointer) echo "${POINTER_AS_RUN[@]}" ;; schedule) echo "${SCHEDULE_AS_RUN[@]}" ;; esac
}

# looped and TMLT at r = 4, 16, 32 over seeds 0-2 (paired by seed): depth CONFIG OUT [override ...]
depth() {
  "$LF" sweep "configs/cpu/$1.yaml" eval.max_loops=64 "${@:3}" \
    --grid seed=0,1,2 model.loops=4,16,32 model.timestep=false,true --out "$STUDY/$2" "${SW[@]}"
}
# the looped model at r = 2 and 8, seed 0: curve CONFIG OUT [override ...]
curve() {
  "$LF" sweep "configs/cpu/$1.yaml" eval.max_loops=64 "${@:3}" --grid model.loops=2,8 --out "$STUDY/$2" "${SW[@]}"
}

stage() {
  case "$1" in
    schedule)       depth schedule schedule "${SCHEDULE_AS_RUN[@]}" ;;
    schedule-curve) curve schedule schedule-curve "${SCHEDULE_AS_RUN[@]}" ;;
    pointer)        depth pointer pointer "${POINTER_AS_RUN[@]}" ;;
    pointer-curve)  curve pointer pointer-curve "${POINTER_AS_RUN[@]}" ;;
    word)
      "$LF" sweep configs/cpu/word.yaml eval.max_loops=64 --grid model.loops=4,16,32 --out "$STUDY/word" "${SW[@]}" ;;
    distinct)
      "$LF" sweep configs/cpu/schedule.yaml "${SCHEDULE_AS_RUN[@]}" task.options.layers=8 task.options.period=0 \
        eval.max_loops=32 \
        --grid seed=0,1,2 model.loops=8,16 model.timestep=false,true --out "$STUDY/distinct" "${SW[@]}" ;;
    no-targets)
      for t in schedule pointer; do
        # shellcheck disable=SC2046
        "$LF" sweep "configs/cpu/$t.yaml" task.loop_targets=false eval.max_loops=64 $(as_run "$t") \
          --grid model.loops=4,32 --out "$STUDY/$t-no-targets" "${SW[@]}"
      done ;;
    paper)
      for t in schedule pointer; do
        # shellcheck disable=SC2046
        "$LF" sweep "configs/cpu/$t.yaml" $(as_run "$t") model.timestep=true "${PAPER[@]}" eval.max_loops=64 \
          --grid model.loops=16 --out "$STUDY/$t-paper" "${SW[@]}"
      done ;;
    standard)
      for t in schedule pointer; do
        # shellcheck disable=SC2046
        "$LF" sweep "configs/cpu/$t.yaml" $([ "$t" != schedule ] || as_run "$t") model.loops=1 eval.max_loops=1 \
          --grid model.n_layers=4,8 --out "$STUDY/$t-standard" "${SW[@]}"
      done ;;
    icl)
      "$LF" sweep configs/cpu/icl-linear.yaml --grid seed=0,1,2 model.timestep=false,true \
        --out "$STUDY/icl-linear" "${SW[@]}" ;;
    ablations)
      ablate studies/depth schedule pointer distinct icl-linear ;;
    collect)
      collect studies/depth ;;
    *) echo "unknown stage: $1" >&2; exit 2 ;;
  esac
}

[ $# -gt 0 ] || { sed -n '2,23p' "$0"; exit 2; }
for s in "$@"; do stage "$s"; done
