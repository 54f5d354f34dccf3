#!/usr/bin/env bash
# Set up, lint, then run the default (fast) test suite. Slow tests: .venv/bin/pytest -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/ruff check --quiet loopformer tests benchmarks scripts   # lint (pyproject.toml: [tool.ruff])
exec .venv/bin/python -m pytest -q -n 2 "$@"
