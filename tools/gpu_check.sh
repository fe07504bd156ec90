#!/usr/bin/env bash
# The prepared GPU check (tools/gpu_check.py): run once on a machine lent one NVIDIA GPU; it prints
# one table and stays under 8 minutes. It installs what it needs from the project's own files into
# the current Python (so a preinstalled CUDA torch stays): `pip install -e '.[dev]'`, then, best
# effort, the `gpu` extra (transformer-engine) and sglang. Every step fails soft: a failed install
# shows up as the affected rows' "skipped"/"error", never as a missing table.
#
#   bash tools/gpu_check.sh                  # install + check
#   bash tools/gpu_check.sh --no-install     # the check alone (what the CPU test runs)
#   PYTHON=/path/to/python bash tools/gpu_check.sh --only bf16
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-470}  # the whole check, installs included
start=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - start) )); }

install=1
if [ "${1:-}" = "--no-install" ]; then install=0; shift; fi
if [ "$install" = 1 ]; then
  timeout 150 "$PY" -m pip install -q -e '.[dev]' >&2 || echo "gpu_check: pip install -e '.[dev]' failed" >&2
  timeout 60 "$PY" -m pip install -q -e '.[gpu]' >&2 || echo "gpu_check: the gpu extra did not install" >&2
  timeout 60 "$PY" -m pip install -q sglang >&2 || echo "gpu_check: sglang did not install" >&2
fi
exec "$PY" tools/gpu_check.py --deadline-s "$(left)" "$@"
