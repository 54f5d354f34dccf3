#!/usr/bin/env bash
# The elastic-depth study (docs/elastic-depth.md): one model trained for a range of loop budgets (train.loops_sample)
# under three conditionings — none (the plain looped block), the loop index t (TMLT, the paper's), the normalised
# time t / R with the step 1 / R (model.timestep_time=normalized) — next to models trained at a fixed r, each run
# with the budgets of eval.budgets. Each stage is a `loopformer sweep` (re-running completes an interrupted stage);
# runs go to $STUDY (default sweeps/elastic, ignored by git); `collect` copies the compact results into
# studies/elastic/.
#
#   demo-fixed          LCS (the demo's task and recipe): looped r = 4 and 8, seeds 0-2
#   demo-none | demo-index | demo-normalized
#                       ... one model per seed (0-2) for budgets drawn uniformly from 2..16 (mean 9 loops), r = 8
#   demo-consistency    ... with the consistency loss (train.consistency=1), none and normalized, seed 0
#   demo-fixedpoint     ... with the fixed-point loss (train.fixed_point=0.1, 4 loops past R), none, seeds 0-2
#   pointer-fixed8      pointer chasing (12 hops): looped r = 8, seeds 1-2 (seed 0: studies/depth/pointer-curve; r = 16
#                       and 32: studies/depth/pointer)
#   pointer-none | pointer-index | pointer-normalized
#                       ... budgets drawn uniformly from 8..24 (mean 16 loops, the cost of r = 16), seeds 0-2
#   pointer-fixedpoint  ... with the fixed-point loss (train.fixed_point=0.1, 8 loops past R), none, seed 0
#   collect             tables and compact results into studies/elastic/ (summary.md: studies/elastic/elastic_summary.py)
# Cost on 2 CPU cores, one thread per run: a demo run 2-4 min, a pointer run about 10 min.
set -euo pipefail
cd "$(dirname "$0")/../.."
STUDY=${STUDY:-sweeps/elastic}
. scripts/study_lib.sh

DEMO=(configs/cpu/demo.yaml model.loops=8 "eval.budgets=[1,2,4,8,16,32]" eval.max_loops=32)
DEMO_SAMPLE=(train.loops_sample=uniform train.loops_min=2 train.loops_max=16)
POINTER=(configs/cpu/pointer.yaml "eval.budgets=[4,8,12,16,24,32,64]" eval.max_loops=64)
POINTER_SAMPLE=(model.loops=16 train.loops_start=0 train.loops_sample=uniform train.loops_min=8 train.loops_max=24)
NONE=()
INDEX=(model.timestep=true)
NORMALIZED=(model.timestep=true model.timestep_time=normalized)

stage() {
  case "$1" in
    demo-fixed)       "$LF" sweep "${DEMO[@]}" --grid seed=0,1,2 model.loops=4,8 --out "$STUDY/demo-fixed" "${SW[@]}" ;;
    demo-none)        "$LF" sweep "${DEMO[@]}" "${DEMO_SAMPLE[@]}" ${NONE[@]+"${NONE[@]}"} --grid seed=0,1,2 \
                        --out "$STUDY/demo-none" "${SW[@]}" ;;
    demo-index)       "$LF" sweep "${DEMO[@]}" "${DEMO_SAMPLE[@]}" "${INDEX[@]}" --grid seed=0,1,2 \
                        --out "$STUDY/demo-index" "${SW[@]}" ;;
    demo-normalized)  "$LF" sweep "${DEMO[@]}" "${DEMO_SAMPLE[@]}" "${NORMALIZED[@]}" --grid seed=0,1,2 \
                        --out "$STUDY/demo-normalized" "${SW[@]}" ;;
    demo-consistency) "$LF" sweep "${DEMO[@]}" "${DEMO_SAMPLE[@]}" train.consistency=1 \
                        --grid seed=0 --out "$STUDY/demo-consistency-none" "${SW[@]}"
                      "$LF" sweep "${DEMO[@]}" "${DEMO_SAMPLE[@]}" "${NORMALIZED[@]}" train.consistency=1 \
                        --grid seed=0 --out "$STUDY/demo-consistency-normalized" "${SW[@]}" ;;
    pointer-fixed8)   "$LF" sweep "${POINTER[@]}" model.loops=8 --grid seed=1,2 --out "$STUDY/pointer-fixed8" "${SW[@]}" ;;
    pointer-none)     "$LF" sweep "${POINTER[@]}" "${POINTER_SAMPLE[@]}" --grid seed=0,1,2 \
                        --out "$STUDY/pointer-none" "${SW[@]}" ;;
    pointer-index)    "$LF" sweep "${POINTER[@]}" "${POINTER_SAMPLE[@]}" "${INDEX[@]}" --grid seed=0,1,2 \
                        --out "$STUDY/pointer-index" "${SW[@]}" ;;
    pointer-normalized) "$LF" sweep "${POINTER[@]}" "${POINTER_SAMPLE[@]}" "${NORMALIZED[@]}" --grid seed=0,1,2 \
                        --out "$STUDY/pointer-normalized" "${SW[@]}" ;;
    demo-fixedpoint)  "$LF" sweep "${DEMO[@]}" "${DEMO_SAMPLE[@]}" train.fixed_point=0.1 train.fixed_point_loops=4 \
                        --grid seed=0,1,2 --out "$STUDY/demo-fixedpoint-none" "${SW[@]}" ;;
    pointer-fixedpoint) "$LF" sweep "${POINTER[@]}" "${POINTER_SAMPLE[@]}" train.fixed_point=0.1 \
                        train.fixed_point_loops=8 --grid seed=0 --out "$STUDY/pointer-fixedpoint-none" "${SW[@]}" ;;
    collect)          # each sweep's report (budgets.md / .png) and every run's results.json and dynamics records
                      # (the dynamics records are not committed: .gitignore)
      for d in "$STUDY"/*/; do
        name=$(basename "$d")
        "$LF" report "$d" --out "studies/elastic/$name" >/dev/null
        rm -f "studies/elastic/$name/loops.png"
        for run in "$d"/runs/*/; do
          [ -f "$run/results.json" ] || continue
          dest="studies/elastic/$name/runs/$(basename "$run")"
          mkdir -p "$dest" && cp "$run/results.json" "$dest/"
          grep '"split": "dynamics"' "$run/metrics.jsonl" > "$dest/dynamics.jsonl" || rm -f "$dest/dynamics.jsonl"
        done
      done
      python3 studies/elastic/elastic_summary.py > studies/elastic/summary.md ;;
    *) echo "unknown stage $1" >&2; exit 2 ;;
  esac
}

for s in "$@"; do
  stage "$s"
done
