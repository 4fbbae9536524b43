#!/usr/bin/env bash
# The test suite: the lint gate (ruff lint + format), then pytest over every marker.
#   tools/test.sh                 # everything (what CI runs)
#   tools/test.sh -m "not slurm"  # extra arguments go to pytest
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x .venv/bin/python ]; then
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi
echo "[test] ruff check"
ruff check .
echo "[test] ruff format --check"
ruff format --check .
echo "[test] pytest"
exec python -m pytest "$@"
