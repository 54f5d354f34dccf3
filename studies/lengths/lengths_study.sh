#!/usr/bin/env bash
# The length-generalisation study (studies/lengths/README.md): trained on sizes 1..12, does a looped block run
# T(n) = n times stay right at 2n and 4n where standard transformers do not? Each stage is a `loopformer sweep` of
# the shipped configs/cpu/length-*.yaml, so re-running this script completes an interrupted study (finished runs
# are skipped, interrupted ones resume). Every run is evaluated at lengths 6, 12, 24 and 48 (eval.lengths) with
# the read-out after every loop up to 2·T(n). Runs go to $STUDY (default sweeps/lengths, ignored by git); `collect`
# copies the compact results (tables, every run's results.json) into studies/lengths/.
#
#   bash studies/lengths/lengths_study.sh screen    # every arm on every task, seed 0 (TASKS, ARMS below)
#   bash studies/lengths/lengths_study.sh main      # every arm on every task, seeds 0-2 ($SEEDS)
#   bash studies/lengths/lengths_study.sh collect   # tables and compact results into studies/lengths/
#   TASKS="parity addition" ONLY="looped-tn standard-depth" ...: some of them; EXTRA="train.steps=6000": overrides
#   for every run, TAG=-long: a suffix of the sweeps' names
# Cost on 2 CPU cores: two runs at a time ($JOBS), one thread each.
set -euo pipefail
cd "$(dirname "$0")/../.."
STUDY=${STUDY:-sweeps/lengths}
. scripts/study_lib.sh
TASKS=${TASKS:-"parity addition copy binary-sum"}

# the arms: name and overrides of the config (a looped block run T(n) = n times; parity's config adds a window of two
# and the jitter below); the standard transformers read every position (no window) in one pass
STD="model.loop_rule=fixed model.loops=1 model.attn_window=0 train.loop_jitter=0 eval.max_loops=1"
ARMS=(
  "looped:"                                                            # the config as shipped
  "looped-tn:train.loop_jitter=0"                                      # T(n) = n loops per row
  "looped-jitter:train.loop_jitter=6"                                  # T(n) + U{0..6} loops in training
  "standard-params:$STD"                                               # one layer, once: the same parameters
  "standard-depth:$STD model.n_layers=12"                              # 12 layers: the depth at n = 12
)

# arms SEEDS: every arm on every task as its own sweep over SEEDS
arms() {
  local task entry name
  for task in $TASKS; do
    for entry in "${ARMS[@]}"; do
      name=${entry%%:*}
      [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $name "* ]] || continue
      # shellcheck disable=SC2086
      "$LF" sweep "configs/cpu/length-$task.yaml" ${entry#*:} ${EXTRA:-} --grid seed="$1" \
        --out "$STUDY/$task-$name${TAG:-}" "${SW[@]}"
    done
  done
}

stage() {
  case "$1" in
    screen)  arms 0 ;;
    main)    arms "${SEEDS:-0,1,2}" ;;
    collect) collect studies/lengths && "${PYTHON:-.venv/bin/python}" studies/lengths/lengths_summary.py studies/lengths \
               > studies/lengths/summary.md ;;
    *) echo "unknown stage: $1" >&2; exit 2 ;;
  esac
}

[ $# -gt 0 ] || { sed -n '2,16p' "$0"; exit 2; }
for s in "$@"; do stage "$s"; done
