#!/usr/bin/env bash
# Set up, then run the test suite: lint (ruff) and types (mypy) and the main suite in .venv, then the
# real-engine tier (tests/engine) in .venv-engine. Fails if any fails or a tier collects nothing. With both tiers, .venv-engine is set up
# in the background while the main tier runs (after .venv's install: the two never build at once).
# Usage: scripts/test.sh [--main|--engine] [pytest args]   (default: both tiers; args go to each run)
set -uo pipefail
cd "$(dirname "$0")/.."
tiers="main engine"
case "${1:-}" in --main) tiers=main; shift ;; --engine) tiers=engine; shift ;; esac
status=0
early=""
for tier in $tiers; do
  if [ "$tier" = engine ] && [ -n "$early" ]; then
    wait "$engine_setup"; rc=$?
    cat "$early" >&2; rm -f "$early"
    [ "$rc" -eq 0 ] || exit 1
  else
    scripts/setup.sh "$tier" || exit 1
  fi
  if [ "$tiers" = "main engine" ] && [ "$tier" = main ]; then
    early=$(mktemp)
    scripts/setup.sh engine > "$early" 2>&1 &
    engine_setup=$!
    trap 'kill "$engine_setup" 2>/dev/null' EXIT
  fi
  if [ "$tier" = main ]; then
    .venv/bin/ruff check src tests benchmarks examples scripts || { echo "ruff failed" >&2; status=1; }
    .venv/bin/mypy || { echo "mypy failed" >&2; status=1; }
    .venv/bin/python -m pytest --ignore=tests/engine "$@"
  else
    .venv-engine/bin/python -m pytest tests/engine "$@"
  fi
  rc=$?
  if [ "$rc" -eq 5 ]; then echo "pytest collected no tests in the $tier tier: failing" >&2; rc=1; fi
  [ "$rc" -eq 0 ] || { echo "the $tier tier failed (pytest exit $rc)" >&2; status=1; }
done
exit "$status"
