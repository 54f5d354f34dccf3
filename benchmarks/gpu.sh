#!/usr/bin/env bash
# The training step on a CUDA GPU, side by side in one run per config: eager fp32, eager bf16 autocast, compiled
# bf16, and compiled bf16 with CUDA graphs of the whole step (compile_mode=reduce-overhead) — on the study configs
# (edit distance d = 64, r = 16, every loop's loss; its TMLT; pointer chasing r = 32) and the language model; then
# generation with per-token exits at 4 prompts against fixed depth, eager and with the depth-wise tick compiled.
#   bash benchmarks/gpu.sh [--against COMMIT]       # e.g. --against HEAD~5 adds that commit as the first source
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
CASES=(--case eager-fp32=train.system.compile=false,train.system.precision=fp32
       --case eager-bf16=train.system.compile=false,train.system.precision=bf16
       --case compiled-bf16=train.system.compile=true,train.system.precision=bf16
       --case graphs-bf16=train.system.compile=true,train.system.precision=bf16,train.system.compile_mode=reduce-overhead)
run() { "$PY" benchmarks/bench_step.py "$@" --device cuda --reps 5 --chunk 20 --warmup 10 "${CASES[@]}"; echo; }
run configs/cpu/ed.yaml model.loops=16 "$@"
run configs/cpu/ed.yaml model.loops=16 model.timestep=true "$@"
run configs/cpu/pointer.yaml model.loops=32 train.loops.start=0 "$@"
[ -d data/shakespeare ] || "$PY" -m loopformer.cli text prepare plays --out data/shakespeare --tokenizer bpe \
  --vocab-size 1024
run configs/cpu/shakespeare.yaml "$@"
for d in 128 512; do "$PY" benchmarks/bench_halting.py --device cuda --reps 7 --compile --d-model "$d" --heads 8; done
