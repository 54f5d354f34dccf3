#!/usr/bin/env bash
# Set up, then run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
LOOPFORMER_EXTRAS=${LOOPFORMER_EXTRAS-} bash scripts/setup.sh   # the demo needs no extras
exec .venv/bin/loopformer demo "$@"
