"""The validation toolkit: an error collector and the rules of the sections SFT and RL share.

Each `check_*` function holds the rules of one section or concern and adds one line per violated
rule to an `Errors`, naming the dotted key to change; `validate_sft_config` and `validate_rl_config`
are compositions of them. Rules mirror megatron-core requirements (parallel_state's rank layout,
TransformerConfig, the MoE layer, the interleaved pipeline schedule). Names of algorithms, rewards
and tasks come from their registries, imported inside the functions that need them: those
packages import `mcore_rl.config`, so a top-level import here would be a cycle.
"""

from __future__ import annotations

import importlib.util
import math
import os
import warnings
from typing import TYPE_CHECKING, Any

from mcore_rl.config.model_keys.attn_res import AttnResKeys
from mcore_rl.config.model_keys.latent_moe import LatentMoEKeys
from mcore_rl.config.model_keys.moe import MoEKeys
from mcore_rl.config.model_keys.mtp import MTPKeys
from mcore_rl.config.model_keys.ngram import NgramEmbeddingConfig
from mcore_rl.config.errors import ConfigError
from mcore_rl.config.rope_scaling import check_model_rope_scaling
from mcore_rl.config.moe_rules import check_family_layout, check_mixed_moe
from mcore_rl.config.schema import ModelConfig, OptimizerConfig, ParallelConfig

if TYPE_CHECKING:
    from mcore_rl.data.tasks import Task


class Errors:
    """Collects one line per violated rule, so a recipe's problems are all reported at once."""

    def __init__(self, assume_transformer_engine: bool = False) -> None:
        self.lines: list[str] = []
        # `mcore-rl profile`: validate for a target cluster that has transformer-engine, not this machine
        self.assume_transformer_engine = assume_transformer_engine

    def need(self, ok: bool, key: str, msg: str) -> bool:
        """Record `key: msg` unless `ok`; returns `ok`, so dependent rules can be skipped."""
        if not ok:
            self.lines.append(f"{key}: {msg}")
        return ok

    def raise_if_any(self) -> None:
        """One `ConfigError`, one line per rule, each line once, in the order the rules ran."""
        if self.lines:
            raise ConfigError("invalid config:\n  " + "\n  ".join(dict.fromkeys(self.lines)))


def check_stage_starts(stages: Any, prefix: str, errors: Errors) -> None:
    """Stages (anything with a `start_step`) start at >= 0, each after the previous one; each error
    under `prefix[k].start_step`."""
    last = -1
    for k, st in enumerate(stages):
        errors.need(
            st.start_step > last,
            f"{prefix}[{k}].start_step",
            f"must be >= 0 and after the previous stage's ({last}), got {st.start_step}",
        )
        last = max(last, st.start_step)


def need_positive(errors: Errors, values: list[tuple[str, int]]) -> bool:
    """`key: must be >= 1` for each (key, value) below 1; True when all are positive divisors."""
    ok = True
    for key, value in values:
        ok &= errors.need(value >= 1, key, f"must be >= 1, got {value}")
    return ok


def expert_tensor_parallel_size(p: ParallelConfig) -> int:
    """The expert tensor-parallel size megatron-core uses (null = the dense one)."""
    return p.expert_tensor_parallel_size if p.expert_tensor_parallel_size is not None else p.tensor_model_parallel_size


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """`vocab_size` rounded up to a multiple of divisible_by x tp (Megatron's `_vocab_size_with_padding`);
    here, not in models/vocab_padding.py, so that estimating memory (`mcore-rl profile`) needs no torch."""
    multiple = max(divisible_by, 1) * max(tp, 1)
    return -(-vocab_size // multiple) * multiple


# ------------------------------------------------------------------- sizes (everything divides by them)


def check_parallel_sizes(p: ParallelConfig, world_size: int, errors: Errors) -> bool:
    """World and parallel sizes must be positive before any divisibility rule can be evaluated."""
    ok = need_positive(errors, [("world_size", world_size)])
    ok &= need_positive(
        errors,
        [
            ("parallel.tensor_model_parallel_size", p.tensor_model_parallel_size),
            ("parallel.pipeline_model_parallel_size", p.pipeline_model_parallel_size),
            ("parallel.context_parallel_size", p.context_parallel_size),
            ("parallel.expert_model_parallel_size", p.expert_model_parallel_size),
            ("parallel.expert_tensor_parallel_size", expert_tensor_parallel_size(p)),
        ],
    )
    vpp = p.virtual_pipeline_model_parallel_size
    ok &= errors.need(
        vpp is None or vpp >= 1, "parallel.virtual_pipeline_model_parallel_size", f"must be null or >= 1, got {vpp}"
    )
    return ok


def check_model_sizes(m: ModelConfig, errors: Errors) -> bool:
    """Model dimensions must be positive (nullable ones null or positive) before they are divided."""
    experts = m.section(MoEKeys)
    ok = need_positive(
        errors,
        [
            ("model.vocab_size", m.vocab_size),
            ("model.hidden_size", m.hidden_size),
            ("model.ffn_hidden_size", m.ffn_hidden_size),
            ("model.num_layers", m.num_layers),
            ("model.num_attention_heads", m.num_attention_heads),
            ("model.num_query_groups", m.num_query_groups),
            ("model.max_position_embeddings", m.max_position_embeddings),
            ("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by),  # vocabulary padding
        ],
    )
    for key, value in [
        ("model.kv_channels", m.kv_channels),
        ("model.moe_ffn_hidden_size", experts.moe_ffn_hidden_size),
        ("model.moe_shared_expert_intermediate_size", experts.moe_shared_expert_intermediate_size),
        ("model.moe_latent_size", m.section(LatentMoEKeys).moe_latent_size),
    ]:
        errors.need(value is None or value >= 1, key, f"must be null or >= 1, got {value}")
    errors.need(experts.num_experts >= 0, "model.num_experts", f"must be >= 0, got {experts.num_experts}")
    return ok


# ------------------------------------------------------------------- model (sizes known to be positive)


def check_model(m: ModelConfig, errors: Errors) -> None:
    """Rules of the model section alone: attention shape, MoE, LatentMoE, AttnRes."""
    check_attention(m, errors)
    check_moe(m, errors)
    check_attn_res(m, errors)
    check_qwen2_mistral(m, errors)
    check_model_rope_scaling(m, errors)  # RoPE scaling (Llama 3.x, YaRN, linear)
    check_mixed_moe(m, errors)  # moe_layer_pattern, DeepSeek-V3 router, MLA (moe_rules.py)
    check_mtp(m, errors)  # MTP draft heads (models/mtp.py)


def check_mtp(m: ModelConfig, errors: Errors) -> None:
    """MTP heads: a count >= 0, on the GQA decoder with one kind of layer (the heads' layer is built
    from the decoder's one spec; AttnRes and n-gram embeddings change what the layers read)."""
    n = m.section(MTPKeys).mtp_num_layers
    if not errors.need(n >= 0, "model.mtp_num_layers", f"must be >= 0, got {n}") or n == 0:
        return
    errors.need(
        m.arch in ("qwen3", "qwen3_moe")
        and m.section(MoEKeys).moe_layer_pattern is None
        and m.section(AttnResKeys).attn_res == "none"
        and not m.section(NgramEmbeddingConfig).orders,
        "model.mtp_num_layers",
        f"MTP heads are built for the GQA decoder (arch qwen3 / qwen3_moe) without moe_layer_pattern, AttnRes or "
        f"n-gram embeddings (arch is {m.arch!r}); the MTP layers of a family's own checkpoint are carried "
        "unchanged by the converter",
    )


def check_qwen2_mistral(m: ModelConfig, errors: Errors) -> None:
    """Qwen2-MoE's gate scales a shared expert (of the plain MoE block); a window holds >= 1 token."""
    experts = m.section(MoEKeys)
    if experts.moe_shared_expert_gate:
        errors.need(
            m.is_moe and bool(experts.moe_shared_expert_intermediate_size),
            "model.moe_shared_expert_gate",
            "gates the shared expert: needs model.arch=qwen3_moe and moe_shared_expert_intermediate_size",
        )
        errors.need(
            m.section(LatentMoEKeys).moe_latent_size is None,
            "model.moe_shared_expert_gate",
            "is not supported together with LatentMoE (model.moe_latent_size)",
        )
    if m.sliding_window is not None:
        errors.need(m.sliding_window >= 1, "model.sliding_window", f"must be null or >= 1, got {m.sliding_window}")


def check_attention(m: ModelConfig, errors: Errors) -> None:
    """GQA needs whole query heads per key/value group, and the head dim must be derivable."""
    errors.need(
        m.num_attention_heads % m.num_query_groups == 0,
        "model.num_query_groups",
        f"num_attention_heads {m.num_attention_heads} is not divisible by num_query_groups {m.num_query_groups}",
    )
    if m.kv_channels is None:  # the head dim is derived: the error names the keys it comes from
        errors.need(
            m.hidden_size % m.num_attention_heads == 0,
            "model.hidden_size",
            f"{m.hidden_size} is not divisible by model.num_attention_heads {m.num_attention_heads}, so the "
            "head dim cannot be derived from them; change either, or set model.kv_channels",
        )


def check_moe(m: ModelConfig, errors: Errors) -> None:
    """Experts exist exactly for the MoE arch; the router picks among them; latents are narrower."""
    experts = m.section(MoEKeys)
    if m.is_moe:
        if errors.need(experts.num_experts > 0, "model.num_experts", f"arch {m.arch} needs num_experts > 0"):
            errors.need(
                1 <= experts.moe_router_topk <= experts.num_experts,
                "model.moe_router_topk",
                f"must be in [1, num_experts={experts.num_experts}], got {experts.moe_router_topk}",
            )
    else:
        errors.need(
            experts.num_experts == 0,
            "model.num_experts",
            f"is {experts.num_experts} but arch is {m.arch!r}; set model.arch=qwen3_moe for an MoE model",
        )
    latent = m.section(LatentMoEKeys).moe_latent_size
    if latent is not None:  # LatentMoE: l = d / alpha, alpha >= 1
        errors.need(
            m.is_moe,
            "model.moe_latent_size",
            f"is {latent} but LatentMoE needs model.arch=qwen3_moe (arch is {m.arch!r})",
        )
        errors.need(
            latent <= m.hidden_size,
            "model.moe_latent_size",
            f"{latent} exceeds hidden_size {m.hidden_size} (the latent size is hidden_size / alpha with alpha >= 1)",
        )


def check_attn_res(m: ModelConfig, errors: Errors) -> None:
    """Block AttnRes splits 2 x num_layers sublayers (attention and MLP each count) into N blocks."""
    depth = m.section(AttnResKeys)
    if depth.attn_res == "block":
        errors.need(
            1 <= depth.attn_res_num_blocks <= 2 * m.num_layers,
            "model.attn_res_num_blocks",
            f"must be in [1, 2 x num_layers = {2 * m.num_layers}] (blocks of sublayers; "
            f"{2 * m.num_layers} is Full AttnRes), got {depth.attn_res_num_blocks}",
        )


# ------------------------------------------------------------------- parallel layout vs the model


def check_parallel(p: ParallelConfig, m: ModelConfig, world_size: int, errors: Errors) -> tuple[int, int]:
    """How the model is cut over ranks; returns (data parallel, expert data parallel), 0 if undefined."""
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    dp = 0
    if errors.need(
        world_size % (tp * pp * cp) == 0,
        "parallel.tensor_model_parallel_size",
        f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) x context "
        f"({cp}) parallel sizes = {tp * pp * cp}",
    ):
        dp = world_size // (tp * pp * cp)
    check_tensor_parallel(p, m, errors)
    if cp > 1 and not errors.assume_transformer_engine:
        errors.need(
            importlib.util.find_spec("transformer_engine") is not None,
            "parallel.context_parallel_size",
            f"context_parallel_size={cp} needs transformer-engine (pip install 'mcore-rl[gpu]'); it is not installed",
        )
    edp = check_expert_parallel(p, m, world_size, errors)
    check_pipeline(p, m, errors)
    return dp, edp


def check_tensor_parallel(p: ParallelConfig, m: ModelConfig, errors: Errors) -> None:
    """Each tensor-parallel rank holds whole heads and key/value groups."""
    tp = p.tensor_model_parallel_size
    errors.need(
        m.num_attention_heads % tp == 0,
        "model.num_attention_heads",
        f"{m.num_attention_heads} heads are not divisible by tensor_model_parallel_size {tp}",
    )
    errors.need(
        m.num_query_groups % tp == 0,
        "model.num_query_groups",
        f"{m.num_query_groups} key/value groups are not divisible by tensor_model_parallel_size {tp}",
    )
    # the vocabulary need not divide by TP: the model pads it (model.make_vocab_size_divisible_by)


def check_expert_parallel(p: ParallelConfig, m: ModelConfig, world_size: int, errors: Errors) -> int:
    """Experts split evenly over EP, MoE with TP needs SP; returns the expert data-parallel size (0 = undefined)."""
    tp, pp, ep, etp = (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.expert_model_parallel_size,
        expert_tensor_parallel_size(p),
    )
    if m.is_moe:
        if m.section(MoEKeys).num_experts > 0:
            errors.need(
                m.section(MoEKeys).num_experts % ep == 0,
                "model.num_experts",
                f"{m.section(MoEKeys).num_experts} experts are not divisible by expert_model_parallel_size {ep}",
            )
        if tp > 1:
            errors.need(
                p.sequence_parallel,
                "parallel.sequence_parallel",
                f"megatron-core requires sequence_parallel=true for MoE with tensor_model_parallel_size {tp}",
            )
        check_family_layout(m, p, errors)  # e.g. expert biases only with one expert-TP rank (moe_rules.py)
    else:
        errors.need(
            ep == 1,
            "parallel.expert_model_parallel_size",
            f"is {ep} but expert parallelism needs model.arch=qwen3_moe (arch is {m.arch!r})",
        )
    if errors.need(
        world_size % (etp * ep * pp) == 0,
        "parallel.expert_model_parallel_size",
        f"world size {world_size} is not divisible by expert tensor ({etp}) x expert ({ep}) x "
        f"pipeline ({pp}) parallel sizes = {etp * ep * pp}",
    ):
        return world_size // (etp * ep * pp)
    return 0


def check_pipeline(p: ParallelConfig, m: ModelConfig, errors: Errors) -> None:
    """Every (virtual) pipeline stage gets the same number of layers."""
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    errors.need(
        m.num_layers % pp == 0,
        "model.num_layers",
        f"{m.num_layers} layers are not divisible by pipeline_model_parallel_size {pp}",
    )
    if vpp is not None:
        errors.need(
            pp > 1,
            "parallel.virtual_pipeline_model_parallel_size",
            f"is {vpp} but needs pipeline_model_parallel_size > 1 (got {pp})",
        )
        errors.need(
            m.num_layers % (pp * vpp) == 0,
            "model.num_layers",
            f"{m.num_layers} layers are not divisible by pipeline ({pp}) x virtual pipeline ({vpp}) = {pp * vpp}",
        )


def check_sequence(seq_length: int, p: ParallelConfig, m: ModelConfig, errors: Errors) -> None:
    """`train.seq_length` splits over SP and CP ranks and stays within the position embeddings."""
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    if p.sequence_parallel and tp == 1:
        warnings.warn("parallel.sequence_parallel=true has no effect with tensor_model_parallel_size=1", stacklevel=4)
    if p.sequence_parallel:
        errors.need(
            seq_length % tp == 0,
            "train.seq_length",
            f"{seq_length} is not divisible by tensor_model_parallel_size {tp} (sequence parallel)",
        )
    if cp > 1:
        errors.need(
            seq_length % (2 * cp) == 0,
            "train.seq_length",
            f"{seq_length} is not divisible by 2 x context_parallel_size = {2 * cp}",
        )
    errors.need(
        seq_length <= m.max_position_embeddings,
        "train.seq_length",
        f"{seq_length} exceeds model.max_position_embeddings {m.max_position_embeddings}",
    )


def check_ngram(m: ModelConfig, p: ParallelConfig, dp: int, errors: Errors) -> None:
    """Over-Encoding n-gram tables (mcore_rl/hf/ngram.py): orders, slice widths, row sharding, no CP."""
    ng, tp, cp = m.section(NgramEmbeddingConfig), p.tensor_model_parallel_size, p.context_parallel_size
    if not ng.orders:
        return
    errors.need(
        all(n >= 2 for n in ng.orders) and len(set(ng.orders)) == len(ng.orders),
        "model.ngram.orders",
        f"must be distinct n-gram orders >= 2 (the 1-gram table is always there), got {ng.orders}",
    )
    if errors.need(ng.num_slices >= 1, "model.ngram.num_slices", f"must be >= 1, got {ng.num_slices}"):
        errors.need(
            m.hidden_size >= max(ng.orders) * ng.num_slices,
            "model.ngram.num_slices",
            f"slices of the order-n table are hidden_size // (n x num_slices) wide: hidden_size "
            f"{m.hidden_size} is too small for order {max(ng.orders)} with {ng.num_slices} slices",
        )
    if errors.need(
        1 <= ng.table_size < 2**31,
        "model.ngram.table_size",
        f"must be in [1, 2^31) when model.ngram.orders is set, got {ng.table_size}",
    ):
        g = math.gcd(ng.table_size, m.vocab_size)
        if g != 1:
            warnings.warn(
                f"model.ngram.table_size={ng.table_size} shares the factor {g} with "
                f"model.vocab_size={m.vocab_size}: hashed n-gram ids collide systematically; "
                "use a table size coprime with the vocabulary (e.g. a prime)",
                stacklevel=4,
            )
        rows = -(-ng.table_size // 128) * 128  # megatron pads table rows to a multiple of 128
        shards = tp * (dp if ng.shard_over_data_parallel else 1)
        if shards:
            errors.need(
                rows % shards == 0,
                "model.ngram.shard_over_data_parallel"
                if ng.shard_over_data_parallel
                else "parallel.tensor_model_parallel_size",
                f"the n-gram tables ({rows} rows: table_size rounded up to a multiple of 128) are "
                f"not divisible into {shards} row shards (tensor parallel {tp}"
                + (f" x data parallel {dp})" if ng.shard_over_data_parallel else ")"),
            )
    errors.need(
        cp == 1,
        "parallel.context_parallel_size",
        f"is {cp} but n-gram embeddings (model.ngram.orders) need the tokens before each chunk; "
        "context parallelism is not supported with them",
    )


def check_layout(
    m: ModelConfig, p: ParallelConfig, seq_length: int, world_size: int, errors: Errors
) -> tuple[int, int]:
    """All model and parallel-layout rules (sizes must be positive); returns (dp, expert dp)."""
    check_model(m, errors)
    dp, edp = check_parallel(p, m, world_size, errors)
    check_sequence(seq_length, p, m, errors)
    check_ngram(m, p, dp, errors)
    return dp, edp


# ------------------------------------------------------------------- optimizer


def check_optimizer(o: OptimizerConfig, errors: Errors) -> None:
    """The LR schedule runs from warmup to lr and decays to min_lr; negative values make no schedule."""
    errors.need(o.lr >= 0, "optimizer.lr", f"must be >= 0, got {o.lr}")
    errors.need(0 <= o.min_lr <= o.lr, "optimizer.min_lr", f"must be in [0, optimizer.lr={o.lr}], got {o.min_lr}")
    errors.need(o.lr_warmup_iters >= 0, "optimizer.lr_warmup_iters", f"must be >= 0, got {o.lr_warmup_iters}")
    if o.lr_decay_style == "step":
        errors.need(
            o.lr_step_period >= 1,
            "optimizer.lr_step_period",
            f"lr_decay_style=step needs a decay period >= 1, got {o.lr_step_period}",
        )
        errors.need(0 < o.lr_step_factor < 1, "optimizer.lr_step_factor", f"must be in (0, 1), got {o.lr_step_factor}")
        errors.need(
            o.lr_step_start_iter >= o.lr_warmup_iters,
            "optimizer.lr_step_start_iter",
            f"must be >= optimizer.lr_warmup_iters={o.lr_warmup_iters}, got {o.lr_step_start_iter}",
        )
    errors.need(
        o.update_mask is None or os.path.isfile(o.update_mask),
        "optimizer.update_mask",
        f"no such file: {o.update_mask!r}",
    )
    errors.need(
        o.name != "sgd" or o.backend == "torch",
        "optimizer.backend",
        f"optimizer.name=sgd has only the torch kernel, got backend={o.backend!r}",
    )


# ------------------------------------------------------------------- names from registries


def need_registered(errors: Errors, key: str, what: str, name: str, registered: list[str], hint: str = "") -> bool:
    """A name must be one of its registry's; the message lists them, so a typo is easy to fix."""
    return errors.need(name in registered, key, f"unknown {what} {name!r}; registered: {', '.join(registered)}{hint}")


def check_task_name(name: str, errors: Errors) -> bool:
    """`data.synthetic_task` must be a task registered in `mcore_rl.data.tasks`."""
    from mcore_rl.data.tasks import task_names  # lazy: registries, read at validation

    return need_registered(errors, "data.synthetic_task", "task", name, task_names())


def build_task(name: str, max_digits: int, errors: Errors) -> Task | None:
    """The synthetic task the run will use (None if its name is unknown or its options are refused)."""
    from mcore_rl.data.tasks import get_task, task_names  # lazy: registries, read at validation

    if name not in task_names():
        return None
    try:
        return get_task(name, max_digits=max_digits)
    except (TypeError, ValueError) as err:
        errors.need(False, "data.synthetic_task", f"task {name!r} refuses its options (max_digits={max_digits}): {err}")
        return None
