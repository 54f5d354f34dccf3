#!/usr/bin/env bash
# The stability study (docs/stability.md): do deep loops train on every seed and settle past r? Each stage is a
# `loopformer sweep` of the shipped depth configs, so re-running this script completes an interrupted study
# (finished runs are skipped, interrupted ones resume). Runs go to $STUDY (default sweeps/stability, ignored by
# git); `collect` copies the compact results (tables, every run's results.json and dynamics records) into
# docs/stability/. Every run is evaluated after every loop up to 4r (eval.max_loops), so accuracy at r, 2r and 4r
# and the drift past r come from the same run.
#
#   bash scripts/stability_study.sh baseline-schedule  # the circuit (K = 32) at r = 32 with the shipped recipe:
#                                                      #   looped and TMLT, seeds 0-4 (10 runs of 2,000 steps)
#   bash scripts/stability_study.sh baseline-pointer   # pointer chasing (16 symbols, 12 hops) at r = 32 with the
#                                                      #   shipped recipe: looped and TMLT, seeds 0-4 (10 runs of
#                                                      #   4,000 steps, ~15 min each on one core)
#   bash scripts/stability_study.sh collect            # tables and compact results into docs/stability/
# Cost on 2 CPU cores: two runs at a time ($JOBS), one thread each.
set -euo pipefail
cd "$(dirname "$0")/.."
STUDY=${STUDY:-sweeps/stability}
. scripts/study_lib.sh
SEEDS=${SEEDS:-0,1,2,3,4}

# the shipped recipe of CONFIG at r = 32, looped and TMLT over $SEEDS (paired by seed): baseline CONFIG OUT [override ...]
baseline() {
  "$LF" sweep "configs/cpu/$1.yaml" model.loops=32 eval.max_loops=128 "${@:3}" \
    --grid seed="$SEEDS" model.timestep=false,true --out "$STUDY/$2" "${SW[@]}"
}

stage() {
  case "$1" in
    baseline-schedule) baseline schedule baseline-schedule ;;
    baseline-pointer)  baseline pointer baseline-pointer ;;
    collect)           collect docs/stability ;;
    *) echo "unknown stage: $1" >&2; exit 2 ;;
  esac
}

[ $# -gt 0 ] || { sed -n '2,16p' "$0"; exit 2; }
for s in "$@"; do stage "$s"; done
