#!/usr/bin/env bash
# The test suite: the lint gate (ruff lint + format), then pytest over every marker.
#   tools/test.sh                 # everything (what CI runs): the unit tier, then the rest in one process
#   tools/test.sh --fast          # the unit tier (no MPI world, no vLLM engine, no Slurm, nothing slow),
#                                 # spread over two workers (pytest-xdist)
#   tools/test.sh --cpu-time      # also each test file's wall time and the machine's busy CPU
#   tools/test.sh -m "not slurm"  # other arguments go to pytest
# It prints its own time last, pass or fail (the budget: README, Tests).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi
started_slurm=0
finish() {
  local code=$?
  [ "$started_slurm" = 1 ] && tools/local_slurm.sh stop >/dev/null
  echo "[test] took $((SECONDS / 60)) min $((SECONDS % 60)) s (exit $code)"
}
trap finish EXIT
fast=0
for arg in "$@"; do
  [ "$arg" = --fast ] && fast=1
done
echo "[test] ruff check"
ruff check .
echo "[test] ruff format --check"
ruff format --check .
if [ "$fast" = 0 ]; then
  # The slurm-marked tests run against the local test cluster: start it (unless it is already up) and
  # stop it when the tests end, whatever their outcome.
  if ! tools/local_slurm.sh status >/dev/null 2>&1; then
    echo "[test] starting the local Slurm cluster (tools/local_slurm.sh)"
    started_slurm=1
    tools/local_slurm.sh start >/dev/null || echo "[test] the local Slurm cluster did not start: the slurm tests will fail" >&2
  fi
  eval "$(tools/local_slurm.sh env)"
fi
# The unit tier over two workers (pytest-xdist); the rest in one process: its MPI worlds, engines and Slurm
# jobs use both cores each (two at once starve time-limited tests: docs/benchmarks.md).
tier() { # tier NAME PYTEST-ARGS...: pytest's exit code, 0 when the tier has no test among those selected
  echo "[test] pytest ${*:2} ($1)"
  local code=0
  python -m pytest "${@:2}" || code=$?
  [ "$code" = 5 ] && code=0 # no test of this tier selected (e.g. tools/test.sh tests/test_config.py)
  return "$code"
}
if [ "$fast" = 1 ]; then
  tier "the unit tier" -n 2 "$@"
else
  unit=0
  tier "the unit tier" -n 2 --fast "$@" || unit=$?
  tier "the rest" --heavy "$@"
  exit "$unit"
fi
