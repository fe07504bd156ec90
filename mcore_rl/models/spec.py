"""megatron-core layer specs for the Qwen3-style dense and MoE decoders.

With transformer-engine importable we use megatron-core's TE spec (fused norms and GEMMs); otherwise
its local spec with our sequence-parallel-capable RMSNorm in place of `WrappedTorchNorm`.
"""

from __future__ import annotations

import dataclasses
import importlib.util

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
    get_transformer_layer_offset,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_rl.models.family import MegatronFamily
from mcore_rl.models.latent_moe import with_latent_moe
from mcore_rl.models.norm import RMSNorm


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def decoder_layer_spec(
    config: TransformerConfig,
    use_te: bool | None = None,
    moe: bool | None = None,
    family: MegatronFamily | None = None,
) -> ModuleSpec:
    """One decoder layer: GQA (or the `family`'s own) self-attention with QK-norm and RoPE, SwiGLU
    MLP or MoE. `moe=False` builds a dense layer in an MoE model (mixed layers)."""
    if use_te is None:
        use_te = transformer_engine_available()
    num_experts = config.num_moe_experts if moe is None or moe else None
    family_kwargs = family.layer_spec_kwargs if family is not None else {}
    if use_te:
        te_spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts,
            moe_grouped_gemm=False,
            qk_layernorm=config.qk_layernorm,
            **family_kwargs,
        )
        if family is not None and family.te_attention_submodules is not None:  # e.g. GPT-OSS's sinks
            te_attention = te_spec.submodules.self_attention
            te_attention = dataclasses.replace(
                te_attention,
                submodules=dataclasses.replace(te_attention.submodules, **family.te_attention_submodules()),
            )
            te_spec = dataclasses.replace(
                te_spec, submodules=dataclasses.replace(te_spec.submodules, self_attention=te_attention)
            )
        return with_router(te_spec, family)
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts,
        qk_layernorm=config.qk_layernorm,
        normalization="RMSNorm",
        **family_kwargs,
    )
    attention = spec.submodules.self_attention
    qk_norm = RMSNorm if config.qk_layernorm else attention.submodules.q_layernorm
    replaced: dict[str, type | ModuleSpec] = dict(q_layernorm=qk_norm, k_layernorm=qk_norm)
    if family is not None:  # the family's attention without transformer-engine (models/<family>.py)
        replaced = family.local_attention_submodules(qk_norm)
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(attention.submodules, **replaced))
    submodules = dataclasses.replace(
        spec.submodules,
        input_layernorm=RMSNorm,
        pre_mlp_layernorm=RMSNorm,
        self_attention=attention,
    )
    return with_router(dataclasses.replace(spec, submodules=submodules), family)


def with_router(spec: ModuleSpec, family: MegatronFamily | None) -> ModuleSpec:
    """The layer spec with the family's own router class in its MoE layer (unchanged without one)."""
    mlp = spec.submodules.mlp
    if family is None or family.router is None or not hasattr(mlp.submodules, "router"):
        return spec
    mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, router=family.router))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))


def decoder_block_spec(
    config: TransformerConfig,
    vp_stage: int | None = None,
    use_te: bool | None = None,
    family: MegatronFamily | None = None,
) -> TransformerBlockSubmodules:
    """The layers this pipeline stage (and virtual stage) builds, plus the final norm.

    With a list `moe_layer_freq` (mixed dense/MoE layers) each layer gets the spec of its global
    index, so pipeline stages may hold different layer kinds."""
    if use_te is None:
        use_te = transformer_engine_available()
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    pattern = config.moe_layer_freq if config.num_moe_experts else 1
    if isinstance(pattern, list):
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        kinds = {
            0: decoder_layer_spec(config, use_te, moe=False, family=family),
            1: with_latent_moe(decoder_layer_spec(config, use_te, moe=True, family=family), config),
        }
        layers = [kinds[pattern[offset + i]] for i in range(num_layers)]
    else:
        layers = [with_latent_moe(decoder_layer_spec(config, use_te, family=family), config)] * num_layers
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm = TENorm
    else:
        final_norm = RMSNorm
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=final_norm)
