#!/usr/bin/env bash
# Launch `mcore-rl sft` with torchrun on this node; run it once per node for a multi-node job.
# See usage() below, or run it without arguments.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
    cat <<EOF
usage: [VAR=value ...] bash launch/torchrun.sh RECIPE.yaml [key.path=value ...]

Runs on this node:
  torchrun --nnodes \$NNODES --node-rank \$NODE_RANK --nproc-per-node \$NPROC \\
           --rdzv-backend c10d --rdzv-endpoint \$MASTER_ADDR:\$MASTER_PORT --rdzv-id \$RDZV_ID \\
           -m mcore_rl.cli sft RECIPE.yaml [key.path=value ...]
Start it on every node with the same NNODES, MASTER_ADDR, MASTER_PORT and RDZV_ID; the nodes meet
at MASTER_ADDR:MASTER_PORT (the first node, which hosts the c10d store). With the c10d rendezvous
torchrun numbers the nodes in the order they join and ignores --node-rank (it says so on nodes > 0),
so global rank 0 is not necessarily on MASTER_ADDR.

environment (default):
  NNODES        number of nodes                          (1)
  NODE_RANK     this node's index, 0..NNODES-1            (\$SLURM_NODEID, else 0)
  NPROC         processes (ranks) on this node            (GPUs shown by nvidia-smi, else 1)
  MASTER_ADDR   rendezvous host: the first node           (127.0.0.1)
  MASTER_PORT   rendezvous port, free on MASTER_ADDR      (29500)
  RDZV_ID       job id shared by all nodes                (\$SLURM_JOB_ID, else mcore_rl)
  PYTHON        interpreter with mcore_rl installed       (repo .venv/bin/python if present, else python3)
  TORCHRUN_ARGS extra torchrun flags, e.g. "--max-restarts 3"   (none)
  PREFLIGHT     0 skips checking the config for the world size NNODES*NPROC first   (1)

The config is validated for world size NNODES*NPROC before torchrun starts, so a typo in a key or
an impossible parallel layout fails in a second on the launching node.

examples:
  NPROC=2 bash launch/torchrun.sh configs/sft_demo.yaml parallel.tensor_model_parallel_size=2
  # two nodes of 8 GPUs; on node 0 and node 1 respectively:
  NNODES=2 NODE_RANK=0 NPROC=8 MASTER_ADDR=node0 bash launch/torchrun.sh configs/sft_demo.yaml
  NNODES=2 NODE_RANK=1 NPROC=8 MASTER_ADDR=node0 bash launch/torchrun.sh configs/sft_demo.yaml
EOF
}

if [[ $# -eq 0 ]]; then
    usage >&2
    exit 2
fi
case "$1" in
    -h|--help) usage; exit 0 ;;
    -*) echo "torchrun.sh: unknown option $1 (the first argument is the recipe)" >&2; usage >&2; exit 2 ;;
esac

RECIPE="$1"
shift
if [[ ! -f "$RECIPE" ]]; then
    echo "torchrun.sh: recipe not found: $RECIPE" >&2
    exit 2
fi

default_nproc() {
    local n=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        n="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
    fi
    if [[ "$n" -gt 0 ]]; then echo "$n"; else echo 1; fi
}

NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"
NPROC="${NPROC:-$(default_nproc)}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
RDZV_ID="${RDZV_ID:-${SLURM_JOB_ID:-mcore_rl}}"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
PREFLIGHT="${PREFLIGHT:-1}"

for var in NNODES NODE_RANK NPROC MASTER_PORT; do
    if ! [[ "${!var}" =~ ^[0-9]+$ ]]; then
        echo "torchrun.sh: $var must be a non-negative integer, got '${!var}'" >&2
        exit 2
    fi
done
if (( NNODES < 1 || NPROC < 1 || NODE_RANK >= NNODES )); then
    echo "torchrun.sh: need NNODES >= 1, NPROC >= 1 and 0 <= NODE_RANK < NNODES" \
         "(got NNODES=$NNODES NODE_RANK=$NODE_RANK NPROC=$NPROC)" >&2
    exit 2
fi

# Workers import mcore_rl from this checkout unless it is installed.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

if [[ "$PREFLIGHT" != 0 ]]; then
    "$PYTHON" - "$((NNODES * NPROC))" "$RECIPE" "$@" <<'PY'
import sys

from mcore_rl.config import ConfigError, SFTConfig, load_config, validate_sft_config

world, recipe, overrides = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
try:
    validate_sft_config(load_config(SFTConfig, recipe, overrides), world)
except (ConfigError, FileNotFoundError) as err:
    print(f"torchrun.sh: config check for world size {world} failed: {err}", file=sys.stderr)
    sys.exit(2)
PY
fi

echo "torchrun.sh: node $NODE_RANK/$NNODES, $NPROC proc(s), rendezvous $MASTER_ADDR:$MASTER_PORT" \
     "(id $RDZV_ID), $PYTHON" >&2
# `torchrun` is `python -m torch.distributed.run`; going through $PYTHON keeps the launcher and the
# workers in the same environment.
# shellcheck disable=SC2086  # TORCHRUN_ARGS is split on purpose
exec "$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" \
    --node-rank "$NODE_RANK" \
    --nproc-per-node "$NPROC" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
    --rdzv-id "$RDZV_ID" \
    ${TORCHRUN_ARGS:-} \
    -m mcore_rl.cli sft "$RECIPE" "$@"
