#!/usr/bin/env bash
# Create .venv and install weightsync with vLLM (CPU use), the test and benchmark extras.
# Idempotent: re-installs only when pyproject.toml changed. Usage: scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "weightsync needs Python >= 3.11" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.weightsync-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e '.[vllm,test,bench]'
  echo "$want" > "$stamp"
fi
