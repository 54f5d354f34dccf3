#!/usr/bin/env bash
# The dials study: targets whose moduli of continuity are set by a dial, the error of a looped model, a TMLT, the
# η(t) model (free per-loop scales, Theorem 4.2) and a standard transformer against r at each dial setting
# (studies/dials/README.md states the predictions). Three families (the map with two dials), each a shipped config
# with its dial changed:
#
#   labels        configs/cpu/dial-labels.yaml: label sequences of largest jump J (Lemma 4.1's ε), read loop by
#                 loop; K = r labels (one per loop); 1,024 keys, d = 16          settings j1 j4 j15
#   map-token     configs/cpu/dial-map.yaml: the token modulus α at β = 1        settings a0.5 a2 a8
#   map-context   ... the contextual modulus β at α = 1                          settings b0.5 b2 b8
#   period        configs/cpu/dial-period.yaml: the circuit with p distinct layers cycled, read loop by loop;
#                 K = r layers                                                   settings p1 p2 pall (p = K)
#
# A cell is (family, setting, r); each arm of a cell is one `loopformer sweep` over $SEEDS into
# $STUDY/<family>/<setting>-r<r>/<arm> (the map's standard transformer, which has no r, into <setting>-std/standard):
#
#   looped      model.timestep=false
#   tmlt        model.timestep=true
#   eta         model.extensions.loop_scales={}  (r·D parameters more than the looped model)
#   standard    model.n_layers=2 model.loops=1   (two distinct layers: parameters between the looped model's and
#                                                 the TMLT's)
#
#   bash studies/dials/dial_study.sh run labels          # one family (or: all)
#   ONLY="j1 j15" RS="2 4" SEEDS=0 ARMS="looped eta" bash studies/dials/dial_study.sh run labels
#   STEPS=200 ...                                        # every run's train.steps (a smoke run)
#   bash studies/dials/dial_study.sh collect             # studies/dials/results.json, summary.md
#
# Runs go to $STUDY (default sweeps/dials, ignored by git); re-running a stage completes it (finished runs are
# skipped, interrupted ones resumed). RS: the loop counts (default 2 4 8 16), SEEDS: model seeds (default 0,1,2),
# ARMS: the arms (default all four), ONLY: setting names, STEPS: train.steps, EXTRA="key=value ...": overrides of
# every run, JOBS: parallel runs (default 2), SUMMARY: collect's output folder (default studies/dials).
set -euo pipefail
cd "$(dirname "$0")/../.."
STUDY=${STUDY:-sweeps/dials}
. scripts/study_lib.sh
SEEDS=${SEEDS:-0,1,2}
RS=${RS:-2 4 8 16}
ARMS=${ARMS:-looped tmlt eta standard}
ONLY=${ONLY:-}

# family|config|the option K follows r through (empty: none)|the family's overrides of its config
# labels: 1,024 keys and d = 16 (the config's 16 keys at d = 64 are learned without error at every J: README.md)
FAMILIES=(
  "labels|dial-labels|task.options.length|task.options.keys=1024 model.d_model=16 model.n_heads=2"
  "map-token|dial-map||"
  "map-context|dial-map||"
  "period|dial-period|task.options.layers|"
)
# family|setting|the dial's overrides
SETTINGS=(
  "labels|j1|task.options.jump=1"
  "labels|j4|task.options.jump=4"
  "labels|j15|task.options.jump=15"
  "map-token|a0.5|task.options.token_lipschitz=0.5 task.options.context_lipschitz=1"
  "map-token|a2|task.options.token_lipschitz=2 task.options.context_lipschitz=1"
  "map-token|a8|task.options.token_lipschitz=8 task.options.context_lipschitz=1"
  "map-context|b0.5|task.options.context_lipschitz=0.5 task.options.token_lipschitz=1"
  "map-context|b2|task.options.context_lipschitz=2 task.options.token_lipschitz=1"
  "map-context|b8|task.options.context_lipschitz=8 task.options.token_lipschitz=1"
  "period|p1|task.options.period=1"
  "period|p2|task.options.period=2"
  "period|pall|task.options.period=0"
)

arm_overrides() {   # arm_overrides ARM: the arm's overrides, one a line
  case "$1" in
    looped) echo "model.timestep=false" ;;
    tmlt) echo "model.timestep=true" ;;
    eta) printf '%s\n' "model.timestep=false" "model.extensions.loop_scales={}" ;;
    standard) printf '%s\n' "model.timestep=false" "model.n_layers=2" "model.loops=1" ;;
    *) echo "unknown arm: $1 (looped, tmlt, eta, standard)" >&2; exit 2 ;;
  esac
}

# sweep CONFIG OUT OVERRIDES...: one arm of one cell over $SEEDS
sweep() {
  local config=$1 out=$2
  shift 2
  # shellcheck disable=SC2086
  "$LF" sweep "configs/cpu/$config.yaml" "$@" ${STEPS:+train.steps=$STEPS} ${EXTRA:-} \
    --grid seed="$SEEDS" --out "$out" "${SW[@]}" >/dev/null
  echo "done: $out" >&2
}

# run FAMILY: every cell of the family
run_family() {
  local family=$1 spec fam config knob common setting dial r arm cell
  for spec in "${FAMILIES[@]}"; do
    IFS='|' read -r fam config knob common <<<"$spec"
    [ "$fam" = "$family" ] && break
  done
  [ "$fam" = "$family" ] || { echo "unknown family: $family (labels, map-token, map-context, period, all)" >&2; exit 2; }
  for spec in "${SETTINGS[@]}"; do
    IFS='|' read -r fam setting dial <<<"$spec"
    [ "$fam" = "$family" ] || continue
    [ -z "$ONLY" ] || [[ " $ONLY " == *" $setting "* ]] || continue
    for arm in $ARMS; do
      mapfile -t arm_ov < <(arm_overrides "$arm")
      if [ -z "$knob" ] && [ "$arm" = standard ]; then   # no r in the task: the standard transformer once
        # shellcheck disable=SC2086
        sweep "$config" "$STUDY/$family/$setting-std/$arm" $common $dial "${arm_ov[@]}"
        continue
      fi
      for r in $RS; do
        cell="$STUDY/$family/$setting-r$r/$arm"
        # shellcheck disable=SC2086
        sweep "$config" "$cell" $common $dial ${knob:+$knob=$r} "model.loops=$r" "${arm_ov[@]}"
      done
    done
  done
}

for arm in $ARMS; do arm_overrides "$arm" >/dev/null; done        # an unknown arm: one line, exit 2
for name in $ONLY; do
  printf '%s\n' "${SETTINGS[@]}" | cut -d'|' -f2 | grep -qxF -- "$name" ||
    { echo "ONLY: no setting named $name ($(printf '%s\n' "${SETTINGS[@]}" | cut -d'|' -f2 | tr '\n' ' '))" >&2; exit 2; }
done
for r in $RS; do
  [[ "$r" =~ ^[1-9][0-9]*$ ]] || { echo "RS: loop counts are positive integers (got $r)" >&2; exit 2; }
done

case "${1:-}" in
  run)
    case "${2:?family: labels, map-token, map-context, period or all}" in
      all) for spec in "${FAMILIES[@]}"; do run_family "${spec%%|*}"; done ;;
      *) run_family "$2" ;;
    esac ;;
  collect) .venv/bin/python studies/dials/dial_summary.py "$STUDY" "${SUMMARY:-studies/dials}" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
