"""megatron-core settings of the GLM-4.5 family (`MEGATRON`, found through `hf/glm4_moe.py`).

Its attention is megatron-core's GQA with q/k/v biases (`add_qkv_bias`), QK-norm as configured and
partial rotary (GPTModel's `rotary_percent`, `models/rope_scaling.py`), all fields of the decoder,
so the layer spec is the decoder's. Its router is DeepSeek-V3's (`models/deepseek_v3.py`: the
sigmoid router with the expert bias, grouped top-k ranked by a group's best 2 scores, the
`norm_topk_prob` switch), read from a `TransformerConfig` that carries the switch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_rl.config.schema import ModelConfig
from mcore_rl.models.deepseek_v3 import DeepseekV3Router, moe_kwargs
from mcore_rl.models.family import MegatronFamily


@dataclass
class Glm4MoeTransformerConfig(TransformerConfig):
    """`TransformerConfig` with the router's renormalisation switch (stock `norm_topk_prob`), which
    `DeepseekV3Router` reads; GLM-4.5 has GQA, not MLA, so not DeepSeek-V3's `MLATransformerConfig`."""

    moe_router_norm_topk_prob: bool = True


def transformer_config(model: ModelConfig) -> tuple[type[TransformerConfig], dict[str, Any]]:
    """No fields beyond the decoder's: its RoPE is GPTModel's (plain, over `rotary_percent`)."""
    return Glm4MoeTransformerConfig, {}


def local_attention_submodules(qk_norm: type) -> dict[str, type | ModuleSpec]:
    """The decoder's local GQA: only its QK-norm class (RMSNorm, or none without QK-norm)."""
    return dict(q_layernorm=qk_norm, k_layernorm=qk_norm)


MEGATRON = MegatronFamily(
    transformer_config=transformer_config,
    moe_kwargs=moe_kwargs,
    layer_spec_kwargs={},
    local_attention_submodules=local_attention_submodules,
    router=DeepseekV3Router,
)
