#!/usr/bin/env bash
# Set up, then run the test suite: lint (ruff), types (mypy) and the main suite in .venv, and the real-engine
# tier (tests/engine) in .venv-engine. Fails if any fails or a tier collects nothing.
# With both tiers (the default, what CI runs), .venv-engine is set up first, then the engine tier (the longer
# one) runs in the background while .venv is set up and the main tier runs (the two venvs never build at
# once). Most of either tier's time is waiting on other processes (engine starts, timeouts, peers), so
# together they take little more than the longer one. The main tier prints as it runs; the engine tier's
# output follows, from its start, once the main tier is done.
# Usage: scripts/test.sh [--main|--engine] [pytest args]   (default: both tiers; args go to each run)
set -uo pipefail
cd "$(dirname "$0")/.."
# A native crash (segfault, abort) in any test's process -- trainer ranks, workers, engines -- prints that
# process's Python stack, so a rare crash in CI names its line.
export PYTHONFAULTHANDLER=1
tiers="main engine"
case "${1:-}" in --main) tiers=main; shift ;; --engine) tiers=engine; shift ;; esac

verdict() {  # verdict TIER PYTEST_EXIT: 0 if the tier passed
  local rc=$2
  if [ "$rc" -eq 5 ]; then echo "pytest collected no tests in the $1 tier: failing" >&2; rc=1; fi
  [ "$rc" -eq 0 ] || echo "the $1 tier failed (pytest exit $rc)" >&2
  [ "$rc" -eq 0 ]
}

status=0
if [ "$tiers" != main ]; then
  scripts/setup.sh engine || exit 1
  if [ "$tiers" = engine ]; then
    .venv-engine/bin/python -m pytest tests/engine "$@"; verdict engine $? || status=1
    exit "$status"
  fi
  engine_log=$(mktemp)
  .venv-engine/bin/python -m pytest tests/engine "$@" > "$engine_log" 2>&1 &
  engine_pid=$!
  trap 'kill "$engine_pid" 2>/dev/null; rm -f "$engine_log"' EXIT
fi
scripts/setup.sh main || exit 1
.venv/bin/ruff check src tests benchmarks examples scripts || { echo "ruff failed" >&2; status=1; }
.venv/bin/mypy || { echo "mypy failed" >&2; status=1; }
.venv/bin/python -m pytest --ignore=tests/engine "$@"
verdict main $? || status=1
if [ "$tiers" = "main engine" ]; then
  echo "--- the engine tier (tests/engine), run alongside the main tier ---"
  tail --pid="$engine_pid" -n +1 -f "$engine_log"
  wait "$engine_pid"; verdict engine $? || status=1
fi
exit "$status"
