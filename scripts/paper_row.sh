#!/usr/bin/env bash
# One row of the paper's Tables 2-4 at paper scale, end to end on a GPU (docs/reproduce.md): make the row's data (if
# its folder is not there yet), then train every cell of the row (the standard baseline, looped and TMLT at each
# loop count; one seed) with `loopformer sweep`, which writes the row as a table. Rows and their GPU hours:
# `loopformer reproduce --paper-tables`.
#   bash scripts/paper_row.sh 3                 # LCS (60); sweeps/paper-row-3/table.md
#   JOBS=4 bash scripts/paper_row.sh 2 --jobs 4 # more cells at once on a large GPU (sweep options after N)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
ROW=${1:-}
if ! [[ "$ROW" =~ ^[0-9]+$ ]]; then
  echo "paper_row: give the row number first (loopformer reproduce --paper-tables lists them; got '$ROW')" >&2
  exit 2
fi
shift
OUT=${OUT:-sweeps/paper-row-$ROW}
LINES=$("$PY" -m loopformer.experiments.paper "$ROW" "$OUT") || exit $?    # a row out of range: its one line
mapfile -t CMDS <<< "$LINES"
DATA_DIR=$(printf '%s\n' "${CMDS[0]}" | sed -n 's/.*--out \([^ ]*\).*/\1/p')
if [ "${CMDS[0]}" != "-" ] && [ ! -d "$DATA_DIR" ]; then
  echo "paper_row: making the data: loopformer ${CMDS[0]}"
  eval "\"$PY\" -m loopformer.cli ${CMDS[0]}"
fi
echo "paper_row: loopformer ${CMDS[1]} $*"
eval "\"$PY\" -m loopformer.cli ${CMDS[1]} \"\$@\""
