"""Cross-field rules of an SFT config that would otherwise fail late, inside megatron-core.

Each rule mirrors a megatron-core requirement (parallel_state's rank layout, TransformerConfig, the
MoE layer, the interleaved pipeline schedule). All violated rules are reported together in one
`ConfigError`, one line per rule, each naming the dotted key to change.
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from dataclasses import dataclass

from mcore_rl.config.errors import ConfigError
from mcore_rl.config.schema import SFTConfig


@dataclass(frozen=True)
class DerivedSizes:
    """Sizes that follow from the config and the world size; the trainer needs them anyway."""

    data_parallel_size: int
    expert_data_parallel_size: int
    num_microbatches: int


def validate_sft_config(cfg: SFTConfig, world_size: int) -> DerivedSizes:
    """Raise `ConfigError` listing every impossible combination; otherwise return derived sizes."""
    errors: list[str] = []

    def need(ok: bool, key: str, msg: str) -> bool:
        if not ok:
            errors.append(f"{key}: {msg}")
        return ok

    m, p, t, o = cfg.model, cfg.parallel, cfg.train, cfg.optimizer
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    ep, vpp = p.expert_model_parallel_size, p.virtual_pipeline_model_parallel_size
    etp = p.expert_tensor_parallel_size if p.expert_tensor_parallel_size is not None else tp

    # --- positive sizes (everything below divides by them) ---
    sizes_ok = need(world_size >= 1, "world_size", f"must be >= 1, got {world_size}")
    for key, value in [
        ("parallel.tensor_model_parallel_size", tp),
        ("parallel.pipeline_model_parallel_size", pp),
        ("parallel.context_parallel_size", cp),
        ("parallel.expert_model_parallel_size", ep),
        ("parallel.expert_tensor_parallel_size", etp),
        ("model.vocab_size", m.vocab_size),
        ("model.hidden_size", m.hidden_size),
        ("model.ffn_hidden_size", m.ffn_hidden_size),
        ("model.num_layers", m.num_layers),
        ("model.num_attention_heads", m.num_attention_heads),
        ("model.num_query_groups", m.num_query_groups),
        ("model.max_position_embeddings", m.max_position_embeddings),
        ("train.seq_length", t.seq_length),
        ("train.micro_batch_size", t.micro_batch_size),
        ("train.global_batch_size", t.global_batch_size),
    ]:
        sizes_ok &= need(value >= 1, key, f"must be >= 1, got {value}")
    for key, value in [
        ("model.kv_channels", m.kv_channels),
        ("model.moe_ffn_hidden_size", m.moe_ffn_hidden_size),
        ("model.moe_shared_expert_intermediate_size", m.moe_shared_expert_intermediate_size),
        ("model.moe_latent_size", m.moe_latent_size),
    ]:
        need(value is None or value >= 1, key, f"must be null or >= 1, got {value}")
    sizes_ok &= need(vpp is None or vpp >= 1, "parallel.virtual_pipeline_model_parallel_size",
                     f"must be null or >= 1, got {vpp}")
    need(t.train_iters >= 0, "train.train_iters", f"must be >= 0, got {t.train_iters}")
    need(m.num_experts >= 0, "model.num_experts", f"must be >= 0, got {m.num_experts}")
    if not sizes_ok:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))

    # --- data parallel size ---
    model_parallel = tp * pp * cp
    dp = 0
    if need(world_size % model_parallel == 0, "parallel.tensor_model_parallel_size",
            f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) x context "
            f"({cp}) parallel sizes = {model_parallel}"):
        dp = world_size // model_parallel

    # --- attention heads ---
    need(m.num_attention_heads % tp == 0, "model.num_attention_heads",
         f"{m.num_attention_heads} heads are not divisible by tensor_model_parallel_size {tp}")
    need(m.num_query_groups % tp == 0, "model.num_query_groups",
         f"{m.num_query_groups} key/value groups are not divisible by tensor_model_parallel_size {tp}")
    need(m.num_attention_heads % m.num_query_groups == 0, "model.num_query_groups",
         f"num_attention_heads {m.num_attention_heads} is not divisible by num_query_groups {m.num_query_groups}")
    if m.kv_channels is None:
        need(m.hidden_size % m.num_attention_heads == 0, "model.kv_channels",
             f"is null but hidden_size {m.hidden_size} is not divisible by num_attention_heads "
             f"{m.num_attention_heads}; set kv_channels explicitly")

    # --- sequence / context parallel ---
    if p.sequence_parallel and tp == 1:
        warnings.warn("parallel.sequence_parallel=true has no effect with tensor_model_parallel_size=1", stacklevel=2)
    if p.sequence_parallel:
        need(t.seq_length % tp == 0, "train.seq_length",
             f"{t.seq_length} is not divisible by tensor_model_parallel_size {tp} (sequence parallel)")
    if cp > 1:
        need(importlib.util.find_spec("transformer_engine") is not None, "parallel.context_parallel_size",
             f"context_parallel_size={cp} needs transformer-engine (pip install 'mcore-rl[gpu]'); "
             "it is not installed")
        need(t.seq_length % (2 * cp) == 0, "train.seq_length",
             f"{t.seq_length} is not divisible by 2 x context_parallel_size = {2 * cp}")
    need(t.seq_length <= m.max_position_embeddings, "train.seq_length",
         f"{t.seq_length} exceeds model.max_position_embeddings {m.max_position_embeddings}")

    # --- MoE / expert parallel ---
    if m.is_moe:
        if need(m.num_experts > 0, "model.num_experts", "arch qwen3_moe needs num_experts > 0"):
            need(m.num_experts % ep == 0, "model.num_experts",
                 f"{m.num_experts} experts are not divisible by expert_model_parallel_size {ep}")
            need(1 <= m.moe_router_topk <= m.num_experts, "model.moe_router_topk",
                 f"must be in [1, num_experts={m.num_experts}], got {m.moe_router_topk}")
        if tp > 1:
            need(p.sequence_parallel, "parallel.sequence_parallel",
                 f"megatron-core requires sequence_parallel=true for MoE with tensor_model_parallel_size {tp}")
    else:
        need(m.num_experts == 0, "model.num_experts",
             f"is {m.num_experts} but arch is {m.arch!r}; set model.arch=qwen3_moe for an MoE model")
        need(ep == 1, "parallel.expert_model_parallel_size",
             f"is {ep} but expert parallelism needs model.arch=qwen3_moe (arch is {m.arch!r})")
    if m.moe_latent_size is not None:  # LatentMoE: l = d / alpha, alpha >= 1
        need(m.is_moe, "model.moe_latent_size",
             f"is {m.moe_latent_size} but LatentMoE needs model.arch=qwen3_moe (arch is {m.arch!r})")
        need(m.moe_latent_size <= m.hidden_size, "model.moe_latent_size",
             f"{m.moe_latent_size} exceeds hidden_size {m.hidden_size} (the latent size is "
             "hidden_size / alpha with alpha >= 1)")
    expert_mp = etp * ep * pp
    edp = 0
    if need(world_size % expert_mp == 0, "parallel.expert_model_parallel_size",
            f"world size {world_size} is not divisible by expert tensor ({etp}) x expert ({ep}) x "
            f"pipeline ({pp}) parallel sizes = {expert_mp}"):
        edp = world_size // expert_mp

    # --- pipeline ---
    need(m.num_layers % pp == 0, "model.num_layers",
         f"{m.num_layers} layers are not divisible by pipeline_model_parallel_size {pp}")
    if vpp is not None:
        need(pp > 1, "parallel.virtual_pipeline_model_parallel_size",
             f"is {vpp} but needs pipeline_model_parallel_size > 1 (got {pp})")
        need(m.num_layers % (pp * vpp) == 0, "model.num_layers",
             f"{m.num_layers} layers are not divisible by pipeline ({pp}) x virtual pipeline ({vpp}) = {pp * vpp}")

    # --- AttnRes: N blocks over 2 x num_layers sublayers (attention and MLP each count) ---
    if m.attn_res == "block":
        need(1 <= m.attn_res_num_blocks <= 2 * m.num_layers, "model.attn_res_num_blocks",
             f"must be in [1, 2 x num_layers = {2 * m.num_layers}] (blocks of sublayers; "
             f"{2 * m.num_layers} is Full AttnRes), got {m.attn_res_num_blocks}")

    # --- Over-Encoding n-gram embeddings (mcore_rl/hf/ngram.py, mcore_rl/models/ngram_embedding.py) ---
    ng = m.ngram
    if ng.orders:
        need(all(n >= 2 for n in ng.orders) and len(set(ng.orders)) == len(ng.orders), "model.ngram.orders",
             f"must be distinct n-gram orders >= 2 (the 1-gram table is always there), got {ng.orders}")
        need(ng.num_slices >= 1, "model.ngram.num_slices", f"must be >= 1, got {ng.num_slices}")
        if ng.num_slices >= 1 and ng.orders:
            need(m.hidden_size >= max(ng.orders) * ng.num_slices, "model.ngram.num_slices",
                 f"slices of the order-n table are hidden_size // (n x num_slices) wide: hidden_size "
                 f"{m.hidden_size} is too small for order {max(ng.orders)} with {ng.num_slices} slices")
        if need(1 <= ng.table_size < 2**31, "model.ngram.table_size",
                f"must be in [1, 2^31) when model.ngram.orders is set, got {ng.table_size}"):
            g = math.gcd(ng.table_size, m.vocab_size)
            if g != 1:
                warnings.warn(f"model.ngram.table_size={ng.table_size} shares the factor {g} with "
                              f"model.vocab_size={m.vocab_size}: hashed n-gram ids collide systematically; "
                              "use a table size coprime with the vocabulary (e.g. a prime)", stacklevel=2)
            rows = -(-ng.table_size // 128) * 128  # megatron pads table rows to a multiple of 128
            shards = tp * (dp if ng.shard_over_data_parallel else 1)
            if shards:
                need(rows % shards == 0, "model.ngram.shard_over_data_parallel" if ng.shard_over_data_parallel
                     else "parallel.tensor_model_parallel_size",
                     f"the n-gram tables ({rows} rows: table_size rounded up to a multiple of 128) are "
                     f"not divisible into {shards} row shards (tensor parallel {tp}"
                     + (f" x data parallel {dp})" if ng.shard_over_data_parallel else ")"))
        need(cp == 1, "parallel.context_parallel_size",
             f"is {cp} but n-gram embeddings (model.ngram.orders) need the tokens before each chunk; "
             "context parallelism is not supported with them")

    # --- batch sizes ---
    num_microbatches = 0
    if dp:
        if need(t.global_batch_size % (t.micro_batch_size * dp) == 0, "train.global_batch_size",
                f"{t.global_batch_size} is not divisible by micro_batch_size ({t.micro_batch_size}) x "
                f"data parallel size ({dp}) = {t.micro_batch_size * dp}"):
            num_microbatches = t.global_batch_size // (t.micro_batch_size * dp)
            if vpp is not None and pp > 1:
                need(num_microbatches % pp == 0, "train.global_batch_size",
                     f"gives {num_microbatches} micro-batches per step, which the interleaved pipeline "
                     f"schedule needs to be a multiple of pipeline_model_parallel_size {pp}")

    # --- optimizer schedule ---
    need(o.lr >= 0, "optimizer.lr", f"must be >= 0, got {o.lr}")
    need(0 <= o.min_lr <= o.lr, "optimizer.min_lr", f"must be in [0, optimizer.lr={o.lr}], got {o.min_lr}")
    need(o.lr_warmup_iters >= 0, "optimizer.lr_warmup_iters", f"must be >= 0, got {o.lr_warmup_iters}")

    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    return DerivedSizes(dp, edp, num_microbatches)
