#!/usr/bin/env bash
# Launch `mcore-rl sft` or `mcore-rl train` with torchrun on this node; run it once per node for a
# multi-node job. Pre-emption signals (checkpoint.preempt_signals: SIGTERM, SIGUSR1) sent to this
# script reach the trainer, which checkpoints and exits 75; so does this script (docs/launch.md).
# See usage() below, or run it without arguments.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() {
    cat <<EOF
usage: [VAR=value ...] bash launch/torchrun.sh [sft|train] RECIPE.yaml [key.path=value ...]

Runs on this node (MODE is sft when the first argument is the recipe):
  torchrun --nnodes \$NNODES --node-rank \$NODE_RANK --nproc-per-node \$NPROC \\
           --rdzv-backend c10d --rdzv-endpoint \$MASTER_ADDR:\$MASTER_PORT --rdzv-id \$RDZV_ID \\
           --signals-to-handle ...,SIGUSR1 --shutdown-timeout \$MCORE_RL_SHUTDOWN_TIMEOUT \\
           -m mcore_rl.cli MODE RECIPE.yaml [key.path=value ...]
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
  DRY_RUN       1 prints the plan (ranks, process groups, rendezvous) and starts nothing  (0)
  MCORE_RL_SHUTDOWN_TIMEOUT  seconds torchrun waits for a signalled trainer to save   (600)

The config is validated for world size NNODES*NPROC before torchrun starts ("mcore-rl launch", the
plan of the dry run), so a typo in a key or an impossible parallel layout fails in a second on the
launching node. SIGTERM or SIGUSR1 to this script: the trainer finishes its step, checkpoints, and
this script exits 75 (resumable; resume with checkpoint.load_dir).

examples:
  NPROC=2 bash launch/torchrun.sh configs/sft_demo.yaml parallel.tensor_model_parallel_size=2
  NPROC=2 bash launch/torchrun.sh train configs/demo.yaml checkpoint.save_dir=runs/ckpt
  DRY_RUN=1 NNODES=2 NPROC=8 bash launch/torchrun.sh train configs/demo.yaml parallel.tensor_model_parallel_size=2
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

MODE=sft
if [[ "$1" == sft || "$1" == train ]]; then
    MODE="$1"
    shift
    if [[ $# -eq 0 ]]; then echo "torchrun.sh: no recipe after '$MODE'" >&2; usage >&2; exit 2; fi
fi
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

# The plan (`mcore-rl launch`): the config checked for world size NNODES*NPROC (and against the SLURM
# allocation, inside one); from it this script takes the run directory and the signals to pass on.
PLAN_ARGS=(--nnodes "$NNODES" --nproc-per-node "$NPROC" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
if [[ "${DRY_RUN:-0}" != 0 ]]; then
    exec "$PYTHON" -m mcore_rl.parallel.launch_plan --dry-run "${PLAN_ARGS[@]}" "$MODE" "$RECIPE" "$@"
fi
RUN_DIR="" PREEMPT_SIGNALS="SIGTERM SIGUSR1" TORCHRUN_SIGNAL_FLAGS=()
if [[ "$PREFLIGHT" != 0 ]]; then
    errors="$(mktemp)"
    if ! plan="$("$PYTHON" -m mcore_rl.parallel.launch_plan --emit shell "${PLAN_ARGS[@]}" "$MODE" "$RECIPE" "$@" \
                 2>"$errors")"; then
        echo "torchrun.sh: config check for world size $((NNODES * NPROC)) failed:" \
             "$(sed 's/^mcore-rl launch: //' "$errors")" >&2
        rm -f "$errors"
        exit 2
    fi
    cat "$errors" >&2  # warnings
    rm -f "$errors"
    eval "$(grep -E '^(RUN_DIR|PREEMPT_SIGNALS|TORCHRUN_SIGNAL_FLAGS)=' <<<"$plan")"
fi
if [[ ${#TORCHRUN_SIGNAL_FLAGS[@]} -eq 0 && -n "$PREEMPT_SIGNALS" ]]; then
    TORCHRUN_SIGNAL_FLAGS=(--signals-to-handle "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
                           --shutdown-timeout "${MCORE_RL_SHUTDOWN_TIMEOUT:-600}")
fi

echo "torchrun.sh: node $NODE_RANK/$NNODES, $NPROC proc(s), rendezvous $MASTER_ADDR:$MASTER_PORT" \
     "(id $RDZV_ID), mcore-rl $MODE, $PYTHON" >&2
started="$(date +%s)"
# `torchrun` is `python -m torch.distributed.run`; going through $PYTHON keeps the launcher and the
# workers in the same environment. It runs in the background so that this shell can pass signals on.
# shellcheck disable=SC2086  # TORCHRUN_ARGS is split on purpose
"$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" \
    --node-rank "$NODE_RANK" \
    --nproc-per-node "$NPROC" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
    --rdzv-id "$RDZV_ID" \
    "${TORCHRUN_SIGNAL_FLAGS[@]}" \
    ${TORCHRUN_ARGS:-} \
    -m mcore_rl.cli "$MODE" "$RECIPE" "$@" &
child=$!
# The first signal goes on to torchrun, which passes it to the ranks; later ones would make torchrun
# give up on its ranks while they save, so they are only reported.
forwarded=""
forward() {
    if [[ -n "$forwarded" ]]; then
        echo "torchrun.sh: got $1 again while the trainer stops ($forwarded passed on): ignored" >&2
        return 0  # (a bare return in a trap gives the status of the interrupted `wait`: set -e would exit)
    fi
    forwarded="$1"
    echo "torchrun.sh: got $1, passing it on to torchrun" >&2
    kill -s "${1#SIG}" "$child" 2>/dev/null || true
}
for sig in $PREEMPT_SIGNALS; do
    # shellcheck disable=SC2064  # expanded now, on purpose
    trap "forward $sig" "${sig#SIG}"
done
while kill -0 "$child" 2>/dev/null; do
    wait "$child" || true  # returns early when a trapped signal arrives
done
rc=0
wait "$child" || rc=$?  # the exit code bash kept for it
# torchrun reports a pre-empted worker as failed (1): the trainer's marker says it saved and stopped.
if [[ $rc -ne 0 && -n "$RUN_DIR" ]] && "$PYTHON" - "$RUN_DIR" "$started" <<'PY'
import sys

from mcore_rl.parallel.preemption import read_marker

sys.exit(0 if read_marker(sys.argv[1], float(sys.argv[2])) is not None else 1)
PY
then
    echo "torchrun.sh: the trainer was pre-empted and saved a checkpoint; exiting 75" >&2
    exit 75
fi
exit "$rc"
