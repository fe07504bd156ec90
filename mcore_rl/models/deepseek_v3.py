"""megatron-core settings of mixed dense/MoE layers and of the DeepSeek-V3 family.

`moe_layer_pattern` becomes megatron-core's list-valued `moe_layer_freq` (`spec.decoder_block_spec`
builds each layer's spec from its global index, so pipeline stages may hold different kinds). The
DeepSeek-V3 router (sigmoid scores, expert bias for selection only, grouped top-k, scaling) and
multi-head latent attention are megatron-core's own (`TopKRouter`, `MLASelfAttention` with the local
or TE spec); the expert bias moves toward balance in megatron-core's `finalize_model_grads`, which
the train path installs (`train.forward_backward.prepare_config`).
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from mcore_rl.config.schema import ModelConfig


def moe_kwargs(model: ModelConfig) -> dict[str, Any]:
    """TransformerConfig MoE fields for the layer pattern and the DeepSeek-V3 router."""
    out: dict[str, Any] = {}
    if model.moe_layer_pattern is not None:
        out["moe_layer_freq"] = [int(p) for p in model.moe_layer_pattern]
    if model.moe_router_score_function == "sigmoid":
        out.update(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=model.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=model.moe_router_bias_update_rate,
            moe_router_pre_softmax=False,
        )
    if model.moe_router_num_groups:
        out.update(moe_router_num_groups=model.moe_router_num_groups, moe_router_group_topk=model.moe_router_group_topk)
    if model.moe_router_topk_scaling_factor is not None:
        out["moe_router_topk_scaling_factor"] = model.moe_router_topk_scaling_factor
    return out


def config_class_and_kwargs(model: ModelConfig) -> tuple[type[TransformerConfig], dict[str, Any]]:
    """`MLATransformerConfig` with plain RoPE for multi-head latent attention, else `TransformerConfig`."""
    if not model.multi_latent_attention:
        return TransformerConfig, {}
    return MLATransformerConfig, dict(
        q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank,
        qk_head_dim=model.qk_head_dim,
        qk_pos_emb_head_dim=model.qk_pos_emb_head_dim,
        v_head_dim=model.v_head_dim,
        rope_type="rope",  # YaRN for MLA: refused by the converter until RoPE scaling lands here
        rotary_base=model.rotary_base,
        rotary_scaling_factor=1.0,  # softmax scale 1 / sqrt(qk_head_dim + qk_pos_emb_head_dim)
        mscale=1.0,
        mscale_all_dim=0.0,
    )
