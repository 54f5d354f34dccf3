#!/usr/bin/env bash
# Set up, lint, build the documentation site (broken links fail), then run the default (fast) test suite. Slow tests: .venv/bin/pytest -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/ruff check --quiet loopformer tests benchmarks scripts studies docs/hooks.py   # lint (pyproject.toml: [tool.ruff])
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"   # the docs site, links checked
exec .venv/bin/python -m pytest -q -n 2 "$@"
