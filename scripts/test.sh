#!/usr/bin/env bash
# Set up, then run the test suite: the main suite in .venv, then the real-engine tier (tests/engine)
# in .venv-engine. Fails if either fails or collects nothing.
# Usage: scripts/test.sh [--main|--engine] [pytest args]   (default: both tiers; args go to each run)
set -uo pipefail
cd "$(dirname "$0")/.."
tiers="main engine"
case "${1:-}" in --main) tiers=main; shift ;; --engine) tiers=engine; shift ;; esac
status=0
for tier in $tiers; do
  scripts/setup.sh "$tier" || exit 1
  if [ "$tier" = main ]; then
    .venv/bin/python -m pytest --ignore=tests/engine "$@"
  else
    .venv-engine/bin/python -m pytest tests/engine "$@"
  fi
  rc=$?
  if [ "$rc" -eq 5 ]; then echo "pytest collected no tests in the $tier tier: failing" >&2; rc=1; fi
  [ "$rc" -eq 0 ] || { echo "the $tier tier failed (pytest exit $rc)" >&2; status=1; }
done
exit "$status"
