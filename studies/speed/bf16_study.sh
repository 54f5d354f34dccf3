#!/usr/bin/env bash
# bf16 autocast on a CPU against fp32 (studies/speed/README.md): the study config (edit distance, d = 64, r = 16, every loop's
# loss), eager (bf16 runs slower compiled), seeds 0-2 per precision, same data and initial weights per seed. Each
# stage is a `loopformer sweep`, so re-running completes an interrupted stage. Runs go to $STUDY (default
# sweeps/bf16, ignored by git); `collect` copies the compact results into studies/speed/.
#
#   bash studies/speed/bf16_study.sh looped      # the looped model (6 runs; fp32 ~7 min, bf16 ~18 min per run, one core)
#   bash studies/speed/bf16_study.sh tmlt        # the TMLT (6 runs)
#   bash studies/speed/bf16_study.sh collect     # tables and every run's results.json into studies/speed/bf16-*/
set -euo pipefail
cd "$(dirname "$0")/../.."
STUDY=${STUDY:-sweeps/bf16}
. scripts/study_lib.sh

precision() {   # precision OUT [override ...]
  "$LF" sweep configs/cpu/ed.yaml model.loops=16 eval.max_loops=16 train.compile=false "${@:2}" \
    --grid seed=0,1,2 train.precision=fp32,bf16 --out "$STUDY/$1" "${SW[@]}"
}

for s in "$@"; do
  case "$s" in
    looped) precision bf16-looped ;;
    tmlt) precision bf16-tmlt model.timestep=true ;;
    collect) collect studies/speed ;;
    *) echo "unknown stage $s (looped, tmlt, collect)" >&2; exit 2 ;;
  esac
done
