"""megatron-core settings of the DeepSeek-V3 family (`MEGATRON`, found through `hf/deepseek_v3.py`).

The DeepSeek-V3 router (sigmoid scores, expert bias for selection only, grouped top-k, scaling) and
multi-head latent attention are megatron-core's own (`TopKRouter`, `MLASelfAttention` with the local
or TE spec); the expert bias moves toward balance in megatron-core's `finalize_model_grads`, which
the train path installs (`train.forward_backward.prepare_config`).
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from mcore_rl.config.schema import ModelConfig
from mcore_rl.models.family import MegatronFamily
from mcore_rl.models.latent_moe import LatentProjection


def moe_kwargs(model: ModelConfig) -> dict[str, Any]:
    """TransformerConfig MoE fields of the DeepSeek-V3 router."""
    out: dict[str, Any] = {}
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


def transformer_config(model: ModelConfig) -> tuple[type[TransformerConfig], dict[str, Any]]:
    """`MLATransformerConfig` with plain RoPE for multi-head latent attention."""
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


class MLADotProductAttention(DotProductAttention):
    """megatron-core's local `DotProductAttention` for MLA, whose query/key and value head sizes
    differ: `MLASelfAttention` passes them as `k_channels` / `v_channels` (the TE attention takes
    them; the local one does not), and the context it returns is heads x v_channels wide."""

    def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels


def use_local_mla() -> None:
    """Let `MLASelfAttention` build from the local spec without transformer-engine, with its down
    projections duplicated on every TP rank (`spec.decoder_layer_spec` puts `LatentProjection`,
    TELinear's "duplicated" mode without TE, in their place).

    `megatron.core.extensions.transformer_engine` imports without TE (its classes are then mock
    placeholders), so `multi_latent_attention.HAVE_TE` is True and `isinstance(.., TELinear)` fails
    on the placeholder; the TE flag is switched off and `TELinear` pointed at `LatentProjection`, so
    MLA builds the down projections in "duplicated" mode. Why not the local spec's column-parallel
    down projections: megatron-core 0.16.1 then gathers the shared RoPE key over TP with
    `gather_from_tensor_model_parallel_region`, whose backward keeps only this rank's slice, so the
    key's gradient misses the other ranks' heads (TP=2 gradients differed from TP=1 by ~0.5%).
    Duplicated, the key is gathered from the sequence-parallel region and its gradient summed."""
    import importlib.util

    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False
        multi_latent_attention.TELinear = LatentProjection


def local_attention_submodules(qk_norm: type) -> dict[str, type | ModuleSpec]:
    """The local spec's MLA submodules: the latent q/kv RMSNorms, the core attention with MLA's
    unequal q/k and v head sizes, and the down projections duplicated on every TP rank."""
    use_local_mla()
    return dict(
        q_layernorm=qk_norm,
        kv_layernorm=qk_norm,
        core_attention=MLADotProductAttention,
        linear_q_down_proj=LatentProjection,
        linear_kv_down_proj=LatentProjection,
    )


MEGATRON = MegatronFamily(
    transformer_config=transformer_config,
    moe_kwargs=moe_kwargs,
    layer_spec_kwargs=dict(multi_latent_attention=True),
    local_attention_submodules=local_attention_submodules,
)
