"""megatron-core settings of the DeepSeek-V3 family (`MEGATRON`, found through `hf/deepseek_v3.py`).

Multi-head latent attention is megatron-core's own (`MLASelfAttention` with the local or TE spec),
with its own RoPE: plain or YaRN (`rope_type="yarn"`, the `mscale` / `mscale_all_dim` attention
temperature), so GPTModel builds none. The router is megatron-core's `TopKRouter` with its routing
step replaced by the reference's `route` (`DeepseekV3Router`): megatron-core ranks groups by their
best topk // topk_group scores and always renormalises sigmoid scores, the released models rank by
their best 2 and some do not renormalise (norm_topk_prob false). The expert bias moves toward
balance in megatron-core's `finalize_model_grads`, which the train path installs
(`train.forward_backward.prepare_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from mcore_rl.config.model_keys.deepseek_v3 import DeepSeekV3Keys
from mcore_rl.config.model_keys.moe import MoEKeys
from mcore_rl.config.schema import ModelConfig
from mcore_rl.hf.deepseek_v3 import route
from mcore_rl.models.family import MegatronFamily
from mcore_rl.models.latent_moe import LatentProjection


def moe_kwargs(model: ModelConfig) -> dict[str, Any]:
    """TransformerConfig MoE fields of the DeepSeek-V3 router."""
    dsv3 = model.section(DeepSeekV3Keys)
    out: dict[str, Any] = {}
    if dsv3.moe_router_score_function == "sigmoid":
        out.update(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=dsv3.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=dsv3.moe_router_bias_update_rate,
            moe_router_pre_softmax=False,
        )
    if dsv3.moe_router_num_groups:
        out.update(
            moe_router_num_groups=dsv3.moe_router_num_groups,
            moe_router_group_topk=dsv3.moe_router_group_topk,
        )
    if dsv3.moe_router_topk_scaling_factor is not None:
        out["moe_router_topk_scaling_factor"] = dsv3.moe_router_topk_scaling_factor
    out["moe_router_norm_topk_prob"] = model.section(MoEKeys).moe_norm_topk_prob
    return out


@dataclass
class DeepseekV3TransformerConfig(MLATransformerConfig):
    """`MLATransformerConfig` with the router's renormalisation switch (stock `norm_topk_prob`), which
    megatron-core's sigmoid routing lacks (it always renormalises); `DeepseekV3Router` reads it."""

    moe_router_norm_topk_prob: bool = True


def transformer_config(model: ModelConfig) -> tuple[type[TransformerConfig], dict[str, Any]]:
    """`MLATransformerConfig` with MLA's own RoPE: plain, or YaRN with DeepSeek's attention temperature.

    megatron-core's MLA scales cos/sin by m(factor, mscale) / m(factor, mscale_all_dim) and the
    softmax by m(factor, mscale_all_dim)^2 / sqrt(q head size), m(f, x) = 0.1 x ln f + 1: what
    transformers computes from the same fields (its `attention_factor` is refused for MLA)."""
    dsv3 = model.section(DeepSeekV3Keys)
    s = model.rope_scaling
    rope: dict[str, Any] = dict(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    if s.type == "yarn":
        rope = dict(
            rope_type="yarn",
            rotary_scaling_factor=s.factor,
            original_max_position_embeddings=s.original_max_position_embeddings or model.max_position_embeddings,
            beta_fast=s.beta_fast,
            beta_slow=s.beta_slow,
            # transformers: m(factor, mscale) / m(factor, mscale_all_dim) only when both are set and
            # non-zero, else m(factor, 1); megatron-core's m(f, 0) = 1 makes the second case (1, 0)
            mscale=float(s.mscale) if s.mscale and s.mscale_all_dim else 1.0,
            mscale_all_dim=float(s.mscale_all_dim or 0.0) if s.mscale else 0.0,
        )
    return DeepseekV3TransformerConfig, dict(
        q_lora_rank=dsv3.q_lora_rank,
        kv_lora_rank=dsv3.kv_lora_rank,
        qk_head_dim=dsv3.qk_head_dim,
        qk_pos_emb_head_dim=dsv3.qk_pos_emb_head_dim,
        v_head_dim=dsv3.v_head_dim,
        rotary_base=model.rotary_base,
        **rope,
    )


class DeepseekV3Router(TopKRouter):
    """megatron-core's `TopKRouter` (gating, expert bias and its load counts, aux losses) routing with
    DeepSeek-V3's `route`: groups ranked by their best 2 scores, renormalisation per `norm_topk_prob`."""

    config: DeepseekV3TransformerConfig

    def routing(
        self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        seq_length, bsz = logits.shape[:2]
        logits = logits.view(-1, self.config.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        logits = self.apply_z_loss(logits, padding_mask=padding_mask)
        probs_k, idx = route(
            logits,
            self.expert_bias,
            self.topk,
            self.config.moe_router_num_groups,
            self.config.moe_router_group_topk,
            self.config.moe_router_norm_topk_prob,
            self.config.moe_router_topk_scaling_factor,
        )
        probs = torch.zeros_like(logits).scatter(1, idx, probs_k.type_as(logits))
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            aux_map, aux_scores = compute_routing_scores_for_aux_loss(
                logits, self.topk, self.score_function, fused=False, padding_mask=padding_mask
            )
            masked = padding_mask is not None
            probs = self._apply_aux_loss(probs, aux_scores, aux_map, with_padding_mask=masked)
            probs = self._apply_seq_aux_loss(probs, aux_scores, aux_map, seq_length, bsz, with_padding_mask=masked)
            probs = self._apply_global_aux_loss(probs, aux_scores, aux_map, with_padding_mask=masked)
        self._apply_expert_bias(routing_map, padding_mask=padding_mask)
        return probs, routing_map


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
    router=DeepseekV3Router,
    rope_in_attention=True,
)
