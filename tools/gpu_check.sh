#!/usr/bin/env bash
# A user's first check on a GPU node (tools/gpu_check.py says what it checks): PASS or FAIL per check
# and a summary to attach to a bug report; exit code 1 when a check fails.
#
#   tools/gpu_check.sh                   # after AREAL_DEVICE=cuda tools/setup.sh
#   tools/gpu_check.sh --trainer-only    # no vLLM needed
#
# Python: the repository's .venv when there is one, else the active environment, else python3 (a
# machine without network: the machine's own PyTorch and megatron-core, this checkout on PYTHONPATH).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x "$repo/.venv/bin/python" ]; then
  py="$repo/.venv/bin/python"
elif [ -n "${VIRTUAL_ENV:-}" ]; then
  py="$VIRTUAL_ENV/bin/python"
else
  py=python3
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$py" "$repo/tools/gpu_check.py" "$@"
