#!/usr/bin/env bash
# Set up, then run the main job: FSDP2 trainer ranks -> vLLM TP ranks on CPU, every transport, verified.
# Extra arguments go to `weightsync demo` (e.g. --transport weightsync_nccl --trainers 2 --tp 2).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh main
exec .venv/bin/weightsync demo "$@"
