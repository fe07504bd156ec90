#!/usr/bin/env bash
# The inference servers of one engine node (launch/slurm.sbatch starts it with srun, one task per
# engine node): one server per entry of ENGINE_PORTS, each on the GPUs of the matching entry of
# ENGINE_GPUS, and on the first engine node sglang-router in front of all of them when ROUTER is
# sglang-router. SGLang's `python -m sglang.launch_server` where sglang is installed, else the
# project's `mcore-rl serve` (one GPU each: set ENGINES_PER_NODE to the GPUs per node).
#
# environment (set by slurm.sbatch from the plan): ENGINE_PORTS ("30000 30001"), ENGINE_GPUS
# ("0,1,2,3 4,5,6,7"), ENGINE_MODEL (HF checkpoint), ENGINE_URLS (all servers, for the router),
# ROUTER ("sglang-router" or "mcore-rl"), ROUTER_PORT, ENGINE_ARGS (extra server flags), PYTHON,
# ENGINE_SPEC_ARGS (speculative decoding: SGLang's --speculative-* flags of the recipe's
# rollout.speculative_* keys, written by the plan, mcore_rl/config/speculative.py; `mcore-rl serve`
# takes the same names and refuses EAGLE / EAGLE3, which only SGLang drafts).
set -euo pipefail

PYTHON="${PYTHON:-python3}"
read -ra ports <<<"${ENGINE_PORTS:?ENGINE_PORTS is not set (launch/slurm.sbatch sets it)}"
read -ra gpus <<<"${ENGINE_GPUS:?ENGINE_GPUS is not set}"
: "${ENGINE_MODEL:?ENGINE_MODEL: the HF checkpoint the servers start from}"
host="$(hostname)"
if "$PYTHON" -c "import sglang" 2>/dev/null; then
    server=("$PYTHON" -m sglang.launch_server)
else
    server=("$PYTHON" -m mcore_rl.cli serve)
fi
pids=()
for i in "${!ports[@]}"; do
    tp=$(($(tr -cd , <<<"${gpus[$i]}" | wc -c) + 1))
    flags=(--model-path "$ENGINE_MODEL" --host 0.0.0.0 --port "${ports[$i]}")
    if [[ "${server[*]}" == *sglang* ]]; then flags+=(--tp-size "$tp"); fi
    # shellcheck disable=SC2206  # the plan quotes ENGINE_SPEC_ARGS for the shell (a draft path may hold spaces)
    eval "spec=(${ENGINE_SPEC_ARGS:-})"
    flags+=("${spec[@]}")
    echo "engines.sh: $host: ${server[*]} ${flags[*]} ${ENGINE_ARGS:-} (GPUs ${gpus[$i]})" >&2
    # shellcheck disable=SC2086  # ENGINE_ARGS is split on purpose
    CUDA_VISIBLE_DEVICES="${gpus[$i]}" "${server[@]}" "${flags[@]}" ${ENGINE_ARGS:-} &
    pids+=($!)
done
if [[ "${ROUTER:-}" == sglang-router && "${SLURM_NODEID:-0}" == 0 ]]; then
    # shellcheck disable=SC2086  # the URLs are split on purpose
    "$PYTHON" -m sglang_router.launch_router --worker-urls $ENGINE_URLS --host 0.0.0.0 --port "$ROUTER_PORT" &
    pids+=($!)
fi
trap 'kill -TERM "${pids[@]}" 2>/dev/null || true' TERM INT
wait
