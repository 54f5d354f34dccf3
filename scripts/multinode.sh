#!/usr/bin/env bash
# Train one run over several machines with torchrun's rendezvous (docs/distributed.md). Run the same command on every
# node, each with this node's GPUs; the run folder (out_dir) must be on a file system all nodes share, since every
# process writes its shard of each checkpoint there.
#   NNODES=2 NPROC=8 MASTER=node0.example:29500 JOB=lm1 bash scripts/multinode.sh configs/wikitext103.yaml \
#       train.system.parallel=fsdp out_dir=/shared/runs/lm1
#   ... --resume /shared/runs/lm1 (any NNODES x NPROC: sharded checkpoints reshard on load)
set -euo pipefail
: "${NNODES:?set NNODES, the number of machines}" "${MASTER:?set MASTER=host:port of the rendezvous (any one node)}"
NPROC=${NPROC:-$(nvidia-smi --list-gpus 2>/dev/null | wc -l)}
[ "$NPROC" -ge 1 ] || { echo "set NPROC, the processes per machine (no GPU found)" >&2; exit 2; }
PY=${PYTHON:-.venv/bin/python}
exec "$PY" -m torch.distributed.run --nnodes="$NNODES" --nproc_per_node="$NPROC" --rdzv_backend=c10d \
  --rdzv_endpoint="$MASTER" --rdzv_id="${JOB:-loopformer}" -m loopformer.cli train "$@"
