"""The GLM-4.5 family (GLM-4.5, GLM-4.5-Air, GLM-4.6: stock `Glm4MoeForCausalLM`): its HF config
translation (stock `Glm4MoeConfig` <-> `ModelConfig` <-> ours with `family="glm4_moe"`), what of a
stock config it refuses, and its weight names; registered in `families.py` as `FAMILY` (the
megatron-core side is `mcore_rl/models/glm4_moe.py`).

GLM-4.5 is two known parts put together, so this module builds nothing of its own:

* attention: the GQA decoder's (`modeling.ReferenceAttention`, megatron-core's GQA) with q/k/v
  biases (stock `attention_bias` biases q/k/v only), optional per-head QK-norm (`use_qk_norm`) and
  partial rotary (`partial_rotary_factor`: RoPE turns the first half of each head's channels,
  rotate-half pairs within them; megatron-core's `rotary_percent`), which are fields of the decoder;
* MoE: DeepSeek-V3's (`deepseek_v3.py`, which this family builds on): the sigmoid router with the
  selection-only expert bias, grouped top-k (`n_group` / `topk_group`), `routed_scaling_factor`,
  `norm_topk_prob`, always-on shared experts, the first `first_k_dense_replace` layers dense, and
  the multi-token-prediction layers (`num_nextn_predict_layers`) carried through conversion. Its
  weight names are DeepSeek-V3's too::

    model.layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}, model.layers.{i}.self_attn.o_proj.weight
    model.layers.{i}.self_attn.{q,k}_norm.weight                        (use_qk_norm)
    model.layers.{i}.mlp.gate.weight [E, hidden], model.layers.{i}.mlp.gate.e_score_correction_bias [E]
    model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight
    model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight

Part of the remote-code modeling files (imports only torch and its siblings).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .deepseek_v3 import (
    DeepseekV3ReferenceMoeBlock,
    _keys,
    first_k_dense,
    mlp_megatron_to_hf,
    mlp_to_megatron,
    moe_layer_pattern,
    unsupported_groups,
)
from .family import ModelFamily
from .rope import ROPE_KEYS, partial_rotary_factor_of, rope_scaling_of, rope_type_of

if TYPE_CHECKING:  # in a try block: transformers' remote-code import check skips it (no mcore_rl needed)
    try:
        from mcore_rl.config.rules import Errors
        from mcore_rl.config.schema import ModelConfig
    except ImportError:
        pass


# Our config's fields for this family are DeepSeek-V3's (`n_group`, `topk_group`,
# `routed_scaling_factor`, `num_nextn_predict_layers`, on every config) and the decoder's own
# (`qkv_bias`, `use_qk_norm`, `partial_rotary_factor`): none of its own.
CONFIG_FIELDS: dict[str, Any] = {}


def configure(cfg: Any) -> None:
    """Nothing derived: the decoder's head_dim is the attention's, `partial_rotary_factor` its RoPE's share."""


def _stock(hf: Any) -> bool:
    return getattr(hf, "model_type", None) == "glm4_moe"


def num_experts(hf: Any) -> int:
    return (hf.n_routed_experts if _stock(hf) else getattr(hf, "num_experts", 0)) or 0


def model_fields(hf: Any) -> dict[str, Any]:
    """ModelConfig fields of a GLM-4.5 config (stock `Glm4MoeConfig` or ours with family glm4_moe)
    beyond the decoder's, which the shared translation reads (head_dim, use_qk_norm, partial rotary)."""
    stock = _stock(hf)
    shared = (hf.n_shared_experts or 0) * hf.moe_intermediate_size if stock else hf.shared_expert_intermediate_size
    return dict(
        arch="glm4_moe",
        num_experts=num_experts(hf),
        add_qkv_bias=bool(hf.attention_bias if stock else getattr(hf, "qkv_bias", False)),
        moe_shared_expert_intermediate_size=shared or None,
        moe_shared_expert_gate=False,
        moe_aux_loss_coeff=0.0,  # balance comes from the expert bias
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=hf.n_group,
        moe_router_group_topk=hf.topk_group,
        moe_router_topk_scaling_factor=float(hf.routed_scaling_factor),
        mtp_num_layers_carried=int(getattr(hf, "num_nextn_predict_layers", 0) or 0),
    )


def hf_fields(mc: ModelConfig) -> dict[str, Any]:
    """Our HF config's GLM-4.5 fields (the sigmoid router's, the MTP layers carried) of a `ModelConfig`."""
    k = _keys(mc)[0]
    return dict(
        family="glm4_moe",
        n_group=k.moe_router_num_groups,
        topk_group=k.moe_router_group_topk,
        routed_scaling_factor=k.moe_router_topk_scaling_factor or 1.0,
        num_nextn_predict_layers=k.mtp_num_layers_carried,
    )


def to_stock(cfg: Any) -> Any:
    """A stock `Glm4MoeConfig`: first-k-dense layers, shared experts of n x moe_intermediate_size,
    biases on q/k/v only, plain RoPE over `partial_rotary_factor` of each head."""
    from transformers import Glm4MoeConfig

    first_k = first_k_dense(cfg, "stock Glm4MoeConfig")
    shared = cfg.shared_expert_intermediate_size
    if shared % cfg.moe_intermediate_size:
        raise ValueError("stock GLM-4.5 needs shared experts of n x moe_intermediate_size")
    if cfg.attention_bias:
        raise ValueError("stock GLM-4.5 has no o_proj bias (its attention_bias biases q/k/v only: qkv_bias)")
    if rope_scaling_of(cfg) is not None:
        raise ValueError("stock GLM-4.5 here runs plain RoPE (a scaled RoPE on partial rotary is not built)")
    # head_dim is no declared field of the stock config, but its attention reads it (GLM-4.5: 128, not
    # hidden_size / heads) and config.json carries it as an extra key
    extra: dict[str, Any] = {"head_dim": cfg.head_dim}
    return Glm4MoeConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        n_shared_experts=shared // cfg.moe_intermediate_size,
        n_routed_experts=cfg.num_experts,
        routed_scaling_factor=cfg.routed_scaling_factor,
        n_group=cfg.n_group or 1,
        topk_group=cfg.topk_group or 1,
        num_experts_per_tok=cfg.num_experts_per_tok,
        first_k_dense_replace=first_k,
        norm_topk_prob=cfg.norm_topk_prob,
        hidden_act=cfg.hidden_act,
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.initializer_range,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": partial_rotary_factor_of(cfg),
        },
        attention_bias=bool(cfg.qkv_bias),
        use_qk_norm=bool(cfg.use_qk_norm),
        num_mtp_layers=cfg.num_nextn_predict_layers,  # written as num_nextn_predict_layers (attribute_map)
        **extra,
    )


def unsupported(hf: Any) -> list[str]:
    """What of a stock GLM-4.5 config the reference and megatron-core models here cannot compute."""
    problems = unsupported_groups(hf)
    quantization = dict(getattr(hf, "quantization_config", None) or {})
    if quantization and quantization.get("quant_method") != "compressed-tensors":  # the FP8 releases'
        problems.append(
            f"quantization_config={quantization}: of quantized GLM-4.5 checkpoints only the released FP8 "
            "(quant_method 'compressed-tensors') is dequantized on import"
        )
    for key in ROPE_KEYS:
        kind = rope_type_of(getattr(hf, key, None))
        if kind != "default":
            problems.append(f"{key}.rope_type={kind!r}: GLM-4.5's partial rotary runs plain RoPE here")
            break
    return problems


def stock_experts_fused(config: Any) -> bool:
    """Whether the installed stock `Glm4MoeForCausalLM` stores experts fused (transformers>=5)."""
    from transformers.models.glm4_moe import modeling_glm4_moe as stock

    with torch.device("meta"):
        experts = stock.Glm4MoeExperts(to_stock(config))
    return any(name == "gate_up_proj" for name, _ in experts.named_parameters())


def hf_to_megatron(hf: dict[str, torch.Tensor], p: str, q: str, mc: Any, moe_layer: bool) -> dict[str, torch.Tensor]:
    """One GLM-4.5 layer's MLP tensors (dense, or DeepSeek-V3's MoE); the shared map adds the GQA
    attention and the norms."""
    return mlp_to_megatron(hf, p, q, mc, moe_layer)


# ---- ModelConfig: the family's `model.*` keys and their rules (config/moe_rules.py runs them) -------

# Its keys are DeepSeek-V3's router and MTP keys (`DeepSeekV3Keys`: this family builds on it).


def check_model_config(m: ModelConfig, errors: Errors) -> None:
    """GLM-4.5 routes with the sigmoid router and its expert bias and has no gate on its shared
    experts; the router's own rules (groups, bias rate) are DeepSeek-V3's, run for every config."""
    if m.arch != "glm4_moe":
        return
    try:  # here, in a try block, as `_keys`: remote code loads without mcore_rl and must not import it
        from mcore_rl.config.model_keys.latent_moe import LatentMoEKeys
    except ImportError as err:
        raise ImportError("reading a ModelConfig needs the mcore_rl package") from err

    k, moe = _keys(m)
    mla = type(k)()  # DeepSeek-V3's attention keys stay at their defaults: GLM-4.5 has the GQA decoder's
    for key in (
        "multi_latent_attention",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_head_dim",
        "qk_pos_emb_head_dim",
        "v_head_dim",
    ):
        value = getattr(k, key)
        errors.need(
            value == getattr(mla, key),
            f"model.{key}",
            f"is {value} but arch glm4_moe has the GQA decoder's attention, not DeepSeek-V3's latent attention",
        )
    errors.need(
        k.moe_router_score_function == "sigmoid" and k.moe_router_enable_expert_bias,
        "model.moe_router_score_function",
        "arch glm4_moe routes with sigmoid scores and the expert bias: set moe_router_score_function=sigmoid "
        "and moe_router_enable_expert_bias=true (moe_router_bias_update_rate=0 freezes the bias)",
    )
    errors.need(
        not moe.moe_shared_expert_gate,
        "model.moe_shared_expert_gate",
        "arch glm4_moe has no gate on its shared experts; set moe_shared_expert_gate=false",
    )
    errors.need(
        m.section(LatentMoEKeys).moe_latent_size is None,
        "model.moe_latent_size",
        "arch glm4_moe has no LatentMoE (its MoE block is the sigmoid router's); set moe_latent_size=null",
    )


FAMILY = ModelFamily(
    name="glm4_moe",
    stock_model_type="glm4_moe",
    stock_class="Glm4MoeForCausalLM",
    config_fields=CONFIG_FIELDS,
    configure=configure,
    num_experts=num_experts,
    model_fields=model_fields,
    hf_fields=hf_fields,
    moe_layer_pattern=moe_layer_pattern,
    to_stock=to_stock,
    unsupported=unsupported,
    attention=None,  # the GQA decoder's
    moe_block=DeepseekV3ReferenceMoeBlock,
    stock_experts_fused=stock_experts_fused,
    megatron_to_hf=mlp_megatron_to_hf,  # the expert bias and shared experts; the decoder's names otherwise
    hf_to_megatron=hf_to_megatron,
    fp32_tensors=(".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"),  # stock _keep_in_fp32_modules_strict
    check_model=check_model_config,
    megatron="mcore_rl.models.glm4_moe",
    builds_on="deepseek_v3",
    partial_rotary=True,
)
