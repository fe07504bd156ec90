"""Rules of the mixed dense/MoE layer pattern, the DeepSeek-V3 router and multi-head latent attention.

They mirror what megatron-core's `TransformerConfig` / `MLATransformerConfig` and its router accept,
and what the reference model computes the same way (docs/deepseek_v3.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mcore_rl.config.schema import ModelConfig

if TYPE_CHECKING:
    from mcore_rl.config.rules import Errors


def check_mixed_moe(m: ModelConfig, errors: Errors) -> None:
    """Layer pattern, sigmoid router with expert bias and grouped top-k, and MLA shapes."""
    check_moe_layer_pattern(m, errors)
    check_router(m, errors)
    check_latent_attention(m, errors)


def check_moe_layer_pattern(m: ModelConfig, errors: Errors) -> None:
    pattern = m.moe_layer_pattern
    if pattern is None:
        return
    key = "model.moe_layer_pattern"
    if not errors.need(
        m.is_moe,
        key,
        f"is {pattern} but the model is dense (arch {m.arch!r}); a per-layer MoE pattern needs an MoE arch",
    ):
        return
    errors.need(
        len(pattern) == m.num_layers,
        key,
        f"has {len(pattern)} entries but num_layers is {m.num_layers} (one 0/1 per layer)",
    )
    errors.need(all(p in (0, 1) for p in pattern), key, f"entries must be 0 (dense) or 1 (MoE), got {pattern}")
    errors.need(any(p == 1 for p in pattern), key, f"{pattern} has no MoE layer; use a dense arch instead")


def check_router(m: ModelConfig, errors: Errors) -> None:
    """The DeepSeek-V3 router features belong to the deepseek_v3 arch (its reference MoE block)."""
    sigmoid = m.moe_router_score_function == "sigmoid"
    deepseek = m.arch == "deepseek_v3"
    if deepseek:
        errors.need(
            sigmoid and m.moe_router_enable_expert_bias,
            "model.moe_router_score_function",
            "arch deepseek_v3 routes with sigmoid scores and the expert bias: set "
            "moe_router_score_function=sigmoid and moe_router_enable_expert_bias=true "
            "(moe_router_bias_update_rate=0 freezes the bias)",
        )
        errors.need(
            m.multi_latent_attention,
            "model.multi_latent_attention",
            "arch deepseek_v3 has multi-head latent attention; set multi_latent_attention=true",
        )
    else:
        for key, value, default in [
            ("moe_router_score_function", m.moe_router_score_function, "softmax"),
            ("moe_router_num_groups", m.moe_router_num_groups, None),
            ("moe_router_topk_scaling_factor", m.moe_router_topk_scaling_factor, None),
            ("multi_latent_attention", m.multi_latent_attention, False),
        ]:
            errors.need(
                value == default, f"model.{key}", f"is {value} but needs model.arch=deepseek_v3 (arch is {m.arch!r})"
            )
    if m.moe_router_enable_expert_bias:
        errors.need(
            sigmoid,
            "model.moe_router_enable_expert_bias",
            "the expert bias (aux-loss-free balancing) needs moe_router_score_function=sigmoid",
        )
        errors.need(
            m.moe_router_bias_update_rate >= 0,
            "model.moe_router_bias_update_rate",
            f"must be >= 0, got {m.moe_router_bias_update_rate}",
        )
    if sigmoid and m.moe_router_topk > 1:
        # megatron-core always renormalises sigmoid top-k scores (topk > 1)
        errors.need(
            m.moe_norm_topk_prob,
            "model.moe_norm_topk_prob",
            "must be true with moe_router_score_function=sigmoid and moe_router_topk > 1 "
            "(megatron-core renormalises sigmoid top-k scores)",
        )
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    if groups is None and group_topk is None:
        return
    if groups is None or group_topk is None:
        errors.need(
            False,
            "model.moe_router_group_topk",
            "grouped top-k needs both moe_router_num_groups and moe_router_group_topk",
        )
        return
    if not errors.need(
        groups >= 1 and 1 <= group_topk <= groups,
        "model.moe_router_group_topk",
        f"must be in [1, moe_router_num_groups={groups}], got {group_topk}",
    ):
        return
    if errors.need(
        m.num_experts % groups == 0,
        "model.moe_router_num_groups",
        f"num_experts {m.num_experts} is not divisible by {groups} groups",
    ):
        per_group = m.num_experts // groups
        errors.need(
            m.moe_router_topk % group_topk == 0
            and m.moe_router_topk // group_topk <= per_group
            and m.moe_router_topk <= group_topk * per_group,
            "model.moe_router_topk",
            f"{m.moe_router_topk} must be a multiple of moe_router_group_topk {group_topk} and fit in "
            f"{group_topk} groups of {per_group} experts",
        )


def check_latent_attention(m: ModelConfig, errors: Errors) -> None:
    if not m.multi_latent_attention:
        return
    for key, value in [
        ("model.kv_lora_rank", m.kv_lora_rank),
        ("model.qk_head_dim", m.qk_head_dim),
        ("model.qk_pos_emb_head_dim", m.qk_pos_emb_head_dim),
        ("model.v_head_dim", m.v_head_dim),
    ]:
        errors.need(value >= 1, key, f"must be >= 1 with multi_latent_attention, got {value}")
    errors.need(
        m.q_lora_rank is None or m.q_lora_rank >= 1,
        "model.q_lora_rank",
        f"must be null (full-rank query) or >= 1, got {m.q_lora_rank}",
    )
    errors.need(
        m.qk_pos_emb_head_dim % 2 == 0,
        "model.qk_pos_emb_head_dim",
        f"must be even (RoPE rotates pairs), got {m.qk_pos_emb_head_dim}",
    )
    errors.need(
        m.qk_layernorm,
        "model.qk_layernorm",
        "must be true with multi_latent_attention (it turns on the latent q/kv RMSNorms)",
    )
    errors.need(
        m.rope_scaling.type == "none",
        "model.rope_scaling.type",
        f"{m.rope_scaling.type!r} with multi_latent_attention is not built (MLA uses plain RoPE here)",
    )
