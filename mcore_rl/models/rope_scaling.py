"""RoPE scaling in the megatron-core model: linear, Llama 3.x and YaRN, with megatron-core's own code.

What megatron-core 0.16 offers, and how each type uses it:

* linear: `GPTModel(seq_len_interpolation_factor=factor)` divides the positions by the factor,
  which is transformers' division of the inverse frequencies.
* llama3: `RotaryEmbedding._apply_scaling` has transformers' formula, but GPTModel passes only the
  factor (low/high frequency factors 1 and 4, original context 8192 are fixed). `configure_rotary_embedding`
  recomputes the chunk's `inv_freq` with the same method and the configured values.
* yarn: `GPTModel(position_embedding_type="yarn")` builds a `YarnRotaryEmbedding` for ordinary
  (non-MLA) attention from `config.yarn_*`, and the attention multiplies cos and sin by the
  concentration factor of those fields, as transformers multiplies them by `attention_factor`. The
  fields exist only on `MLATransformerConfig` (which also turns on MLA), so a YaRN model gets
  `YarnTransformerConfig`: `TransformerConfig` plus those fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_rl.config.schema import ModelConfig, RopeScalingConfig

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


@dataclass
class YarnTransformerConfig(TransformerConfig):
    """`TransformerConfig` with the `yarn_*` fields GPTModel and the attention read for YaRN RoPE
    (same names and meaning as in `MLATransformerConfig`)."""

    yarn_rotary_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True


def transformer_config_class(model: ModelConfig) -> type[TransformerConfig]:
    return YarnTransformerConfig if model.rope_scaling.type == "yarn" else TransformerConfig


def _yarn_mscales(s: RopeScalingConfig) -> tuple[float, float]:
    """megatron-core's (mscale, mscale_all_dim) for transformers' attention factor.

    megatron-core scales cos/sin by m(factor, mscale) / m(factor, mscale_all_dim), m(f, x) =
    0.1 x ln f + 1 (1 when f <= 1). transformers uses `attention_factor` when given, else that ratio
    when both mscales are set and non-zero, else m(factor, 1); mscale_all_dim = 0 makes the
    denominator 1, and an explicit attention factor a is m(factor, (a - 1) / (0.1 ln factor)).
    """
    if s.attention_factor is not None:
        if s.factor <= 1.0:  # megatron-core's factor is 1 here; validation allows only a = 1
            return 1.0, 0.0
        return (s.attention_factor - 1.0) / (0.1 * math.log(s.factor)), 0.0
    if s.mscale and s.mscale_all_dim:
        return float(s.mscale), float(s.mscale_all_dim)
    return 1.0, 0.0


def transformer_config_kwargs(model: ModelConfig) -> dict[str, Any]:
    """The `yarn_*` fields of a YaRN model's `YarnTransformerConfig` ({} for the other types)."""
    s = model.rope_scaling
    if s.type != "yarn":
        return {}
    mscale, mscale_all_dim = _yarn_mscales(s)
    return dict(
        yarn_rotary_scaling_factor=s.factor,
        yarn_original_max_position_embeddings=s.original_max_position_embeddings or model.max_position_embeddings,
        yarn_beta_fast=s.beta_fast,
        yarn_beta_slow=s.beta_slow,
        yarn_mscale=mscale,
        yarn_mscale_all_dim=mscale_all_dim,
        yarn_correction_range_round_to_int=s.truncate,
    )


def gpt_model_kwargs(model: ModelConfig) -> dict[str, Any]:
    """GPTModel's position-embedding keywords for the model's RoPE (scaled or not)."""
    s = model.rope_scaling
    kwargs: dict[str, Any] = dict(position_embedding_type="yarn" if s.type == "yarn" else "rope")
    if s.type == "linear":
        kwargs["seq_len_interpolation_factor"] = s.factor
    if model.rotary_percent != 1.0:  # partial rotary (GLM-4.5): the first share of each head's channels
        kwargs["rotary_percent"] = model.rotary_percent
    return kwargs


def configure_rotary_embedding(chunk: GPTModel, model: ModelConfig) -> None:
    """Llama 3.x: the chunk's RoPE frequencies with the configured low/high frequency factors and
    original context (megatron-core's `_apply_scaling`); a no-op for the other types."""
    s = model.rope_scaling
    if s.type != "llama3":
        return
    rotary = chunk.rotary_pos_emb
    rotary.inv_freq = rotary._apply_scaling(
        rotary.inv_freq,
        factor=s.factor,
        low_freq_factor=s.low_freq_factor,
        high_freq_factor=s.high_freq_factor,
        original_max_position_embeddings=s.original_max_position_embeddings or model.max_position_embeddings,
    )
    rotary.forward.cache_clear()  # its forward is lru-cached per length: nothing stale may remain
