#!/usr/bin/env bash
# The transfer study: do the shipped deep recipes train on settings of their tasks that nobody tuned them on?
# A grid of task settings (table size, hops, circuit width, circuit seed, r = 32 and 48), each a `loopformer sweep`
# of the shipped config with only the task's options and the loop count changed, looped and TMLT over $SEEDS.
# Every run is evaluated after every loop up to 4r, so accuracy at r, 2r and 4r comes from one run. A recipe is
# judged by the share of cells (setting x variant x seed) at >= 95 % at r, and at 2r and 4r where it holds.
# The HELDOUT settings are kept out of every screen and run only for a final recipe.
#
#   bash studies/transfer/transfer_study.sh baseline circuit   # the shipped recipes on the screen settings
#   bash studies/transfer/transfer_study.sh baseline pointer
#   bash studies/transfer/transfer_study.sh heldout circuit    # ... on the held-out settings
#   TAG=state-norm EXTRA="model.extensions.state_norm={}" bash studies/transfer/transfer_study.sh screen circuit
#                                                              # a candidate recipe on the screen settings
#   ONLY=w10-cs1-r32 SEEDS=1 VARIANTS=true ...                 # ... on some settings, seeds and variants only
#   (the fixed-point mode's stage, `fixedpoint`, is in this script at the tag before-fixed-point-exit, where the
#    mode is still in the core: README.md, "The fixed-point mode with a normalised state")
#   bash studies/transfer/transfer_study.sh plateau            # pointer chasing, 32 symbols 10 hops, the loop count
#                                                              #   fixed: is the first hop ever learned? (probes)
#   bash studies/transfer/transfer_study.sh collect            # one record per finished cell into
#                                                              #   studies/transfer/results.json, summary.md
#
# Runs go to $STUDY/<stage>/<setting> (default sweeps/transfer, ignored by git); re-running a stage completes it.
# EXTRA="key=value ..." adds overrides to every run (a candidate recipe) and TAG names its stage (baseline-TAG).
# Cost on one core: about 15 (circuit, r = 32) to 50 (pointer, r = 48) minutes a run; $JOBS runs at a time.
set -euo pipefail
cd "$(dirname "$0")/../.."
STUDY=${STUDY:-sweeps/transfer}
. scripts/study_lib.sh
SEEDS=${SEEDS:-0,1}
VARIANTS=${VARIANTS:-false,true}   # model.timestep: looped, TMLT
ONLY=${ONLY:-}                     # setting names (space-separated): only these

# name|config|overrides (r is model.loops; the circuit's depth K is r: one layer per loop)
CIRCUIT=(
  "w10-cs1-r32|schedule|task.options.width=10 task.options.circuit_seed=1 task.options.layers=32 model.loops=32"
  "w14-cs2-r32|schedule|task.options.width=14 task.options.circuit_seed=2 task.options.layers=32 model.loops=32"
  "w12-cs3-r48|schedule|task.options.width=12 task.options.circuit_seed=3 task.options.layers=48 model.loops=48"
  "w8-cs4-r48|schedule|task.options.width=8 task.options.circuit_seed=4 task.options.layers=48 model.loops=48"
)
CIRCUIT_HELDOUT=(
  "w16-cs5-r32|schedule|task.options.width=16 task.options.circuit_seed=5 task.options.layers=32 model.loops=32"
  "w10-cs6-r48|schedule|task.options.width=10 task.options.circuit_seed=6 task.options.layers=48 model.loops=48"
)
POINTER=(
  "s20-h14-r32|pointer|task.options.symbols=20 task.options.hops=14 model.loops=32"
  "s12-h8-r32|pointer|task.options.symbols=12 task.options.hops=8 model.loops=32"
  "s24-h16-r48|pointer|task.options.symbols=24 task.options.hops=16 model.loops=48"
  "s32-h10-r48|pointer|task.options.symbols=32 task.options.hops=10 model.loops=48"
)
POINTER_HELDOUT=(
  "s28-h12-r32|pointer|task.options.symbols=28 task.options.hops=12 model.loops=32"
  "s22-h18-r48|pointer|task.options.symbols=22 task.options.hops=18 model.loops=48"   # (16 / 18: hops < symbols)
)

# run STAGE SETTING...: each setting's sweep, looped and TMLT over $SEEDS, evaluated after every loop up to 4r
run() {
  local stage=$1 spec name config overrides r
  shift
  for spec in "$@"; do
    IFS='|' read -r name config overrides <<<"$spec"
    [ -z "$ONLY" ] || [[ " $ONLY " == *" $name "* ]] || continue
    r=${overrides##*model.loops=}
    # shellcheck disable=SC2086
    "$LF" sweep "configs/cpu/$config.yaml" $overrides eval.max_loops=$((4 * r)) ${EXTRA:-} \
      --grid seed="$SEEDS" model.timestep="$VARIANTS" --out "$STUDY/$stage/$name" "${SW[@]}"
  done
}

settings() {   # settings SET TASK: the array's elements, one a line
  case "$1-$2" in
    screen-circuit) printf '%s\n' "${CIRCUIT[@]}" ;;
    screen-pointer) printf '%s\n' "${POINTER[@]}" ;;
    heldout-circuit) printf '%s\n' "${CIRCUIT_HELDOUT[@]}" ;;
    heldout-pointer) printf '%s\n' "${POINTER_HELDOUT[@]}" ;;
    *) echo "unknown task: $2 (circuit or pointer)" >&2; exit 2 ;;
  esac
}

stage=${1:-}
tag=${TAG:+-$TAG}
case "$stage" in
  baseline) mapfile -t specs < <(settings screen "${2:?task: circuit or pointer}"); run "baseline$tag" "${specs[@]}" ;;
  heldout) mapfile -t specs < <(settings heldout "${2:?task: circuit or pointer}"); run "heldout$tag" "${specs[@]}" ;;
  screen) [ -n "${TAG:-}" ] && [ -n "${EXTRA:-}" ] || { echo "screen needs TAG and EXTRA" >&2; exit 2; }
    mapfile -t specs < <(settings screen "${2:?task: circuit or pointer}"); run "screen$tag" "${specs[@]}" ;;
  plateau)    # the failing pointer cells never learn the first hop: the same setting (32 symbols, 10 hops) with the
              # loop count fixed (no curriculum, no draws), 2,000 steps, seed 0, one probe a line; finished ones kept
    PROBES=("base" "lr4e-3 train.optim.lr=4e-3" "state-norm model.extensions.state_norm={}"
            "tmlt model.timestep=true" "loops32 model.loops=32 eval.max_loops=32"
            "tmlt-lr4e-3 model.timestep=true train.optim.lr=4e-3"
            "tmlt-frozen model.timestep=true train.optim.freeze=[timestep,modulation]")
    for probe in "${PROBES[@]}"; do
      read -r name args <<<"$probe"
      out="$STUDY/probe-plateau/$name"
      [ -f "$out/results.json" ] && continue
      rm -rf "$out"
      # shellcheck disable=SC2086
      "$LF" train configs/cpu/pointer.yaml task.options.symbols=32 task.options.hops=10 model.loops=12 \
        train.loops.start=0 train.loops.hold=0 train.steps=2000 eval.max_loops=12 threads=1 $args "out_dir=$out" --quiet
    done ;;
  collect) python3 studies/transfer/transfer_summary.py "$STUDY" studies/transfer ;;   # results.json, summary.md
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
