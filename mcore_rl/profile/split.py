"""RL: how many GPUs to give the trainer and how many the inference engines, for a rollout batch.

Decode is memory-bandwidth bound: one decode step of an engine (TP GPUs) reads its weights once
and the KV cache of every running sequence, so it costs `DecodeModel.step_s` of the asynchronous
runtime's simulator (`mcore_rl.runtime.simulation`) with the fixed part = weight bytes / (TP ·
HBM bandwidth) and the per-context-token part = KV bytes per token / (TP · bandwidth); the
running batch is capped by the KV cache that fits next to the weights. The train time of the
batch is the layout estimate (`timing.step_time`) for its tokens on the trainer's GPUs. For each
split the rollout and train times are combined as the runtime would: one after the other
(synchronous) or overlapped (asynchronous, the slower of the two); the best split is the fastest.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mcore_rl.config.schema import ModelConfig
from mcore_rl.models.flops import forward_flops_per_token
from mcore_rl.profile.cluster import ClusterSpec
from mcore_rl.profile.layouts import TrainShape
from mcore_rl.profile.memory import GiB, kv_cache_bytes_per_token, weight_bytes
from mcore_rl.runtime.simulation import DecodeModel


@dataclass(frozen=True)
class RolloutTarget:
    prompts_per_step: int  # rollout batch: prompts x samples per prompt = sequences
    samples_per_prompt: int
    prompt_length: int
    response_length: int
    asynchronous: bool = True


def decode_model(model: ModelConfig, cluster: ClusterSpec, inference_tp: int) -> DecodeModel:
    """The simulator's cost model of one engine with `inference_tp` GPUs (bf16 weights and KV)."""
    bandwidth = cluster.memory_bandwidth_gbps * 1e9 * inference_tp
    weights = weight_bytes(model, 2)
    free = cluster.gpu_memory_gb * GiB * inference_tp * 0.9 - weights
    kv_per_token = kv_cache_bytes_per_token(model, 1, 2)  # the whole engine's KV per token
    peak = cluster.peak_flops("bf16") * inference_tp * cluster.compute_efficiency
    # matmul work of one more token (active experts only), without the attention over its context,
    # which the per-context-token (KV read) term covers; prefill adds the causal attention
    fwd = forward_flops_per_token(model, 1)
    per_token = fwd.total - fwd.attention_scores
    per_token2 = forward_flops_per_token(model, 2).attention_scores - fwd.attention_scores  # d/ds of scores
    return DecodeModel(
        step_fixed_s=weights / bandwidth,
        step_per_seq_s=per_token / peak,
        step_per_ctx_token_s=kv_per_token / bandwidth,
        prefill_per_token_s=per_token / peak,
        prefill_per_token2_s=per_token2 / peak,
        slots=1024,
        kv_tokens=max(free, 0.0) / kv_per_token,
    )


def rollout_seconds(
    model: ModelConfig, cluster: ClusterSpec, gpus: int, inference_tp: int, target: RolloutTarget
) -> float | None:
    """Time for `gpus // inference_tp` engines to generate the batch; None if the weights do not fit."""
    dm = decode_model(model, cluster, inference_tp)
    engines = gpus // inference_tp
    if engines < 1 or dm.kv_tokens < target.prompt_length + target.response_length:
        return None
    sequences = target.prompts_per_step * target.samples_per_prompt
    per_engine = -(-sequences // engines)
    context = target.prompt_length + target.response_length
    running = int(min(per_engine, dm.slots, dm.kv_tokens // context))
    waves = -(-per_engine // running)
    mean_ctx = target.prompt_length + target.response_length / 2
    step = dm.step_s(running, running * mean_ctx)
    prefill = dm.prefill_s(running * target.prompt_length)
    return waves * (target.response_length * step + prefill)


@dataclass(frozen=True)
class Split:
    train_gpus: int
    inference_gpus: int
    inference_tp: int
    train_layout: str
    rollout_s: float
    train_s: float
    step_s: float


def recommend_split(
    model: ModelConfig,
    cluster: ClusterSpec,
    shape: TrainShape,
    target: RolloutTarget,
    best_layout_for,
    inference_tps: tuple[int, ...] = (1, 2, 4, 8),
) -> list[Split]:
    """Every split in whole nodes (or halves of the one node), fastest first. `best_layout_for(world,
    shape)` returns (layout name, train seconds) of the best layout on that many GPUs, or None."""
    world, gpn = cluster.world_size, cluster.gpus_per_node
    unit = gpn if cluster.nodes > 1 else max(1, gpn // 8)
    sequences = target.prompts_per_step * target.samples_per_prompt
    seq_len = target.prompt_length + target.response_length
    train_shape = dataclasses.replace(shape, global_batch_size=sequences, seq_length=seq_len)
    out = []
    for train_gpus in range(unit, world, unit):
        best = best_layout_for(train_gpus, train_shape)
        if best is None:
            continue
        name, train_s = best
        for itp in inference_tps:
            if itp > gpn:
                continue
            rollout = rollout_seconds(model, cluster, world - train_gpus, itp, target)
            if rollout is None:
                continue
            total = max(rollout, train_s) if target.asynchronous else rollout + train_s
            out.append(Split(train_gpus, world - train_gpus, itp, name, rollout, train_s, total))
    return sorted(out, key=lambda s: s.step_s)


def split_dict(s: Split) -> dict:
    return dataclasses.asdict(s)
