#!/usr/bin/env bash
# FSDP against DDP on this machine's GPUs (NCCL): per-GPU parameter, gradient and AdamW memory, the CUDA allocator's
# peak, the step time and FSDP's collectives per step, at 1 GPU and at all of them, on a language model large enough
# for the memory to matter (d = 1024, 16 heads, 8 loops of one block, 1,024-token windows, bf16), in one run.
#   bash benchmarks/gpu_distributed.sh [override ...]     # e.g. model.d_model=2048 model.n_layers=2
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
N=$(nvidia-smi --list-gpus | wc -l)
[ "$N" -ge 1 ] || { echo "no NVIDIA GPU found" >&2; exit 2; }
WORLDS=1; [ "$N" -gt 1 ] && WORLDS="1,$N"
"$PY" benchmarks/bench_distributed.py --worlds "$WORLDS" --threads 4 --warmup 3 --steps 10 --vocab 8192 \
  device=cuda train.system.precision=bf16 model.d_model=1024 model.n_heads=16 model.loops=8 task.block_size=1024 \
  train.batch_size=$((8 * N)) "$@"
