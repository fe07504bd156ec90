"""The model families beyond the GQA decoder (`family.py`), registered once: add yours to `FAMILIES`;
and the stock model types that are the GQA decoder with fields set (`stock_decoders.py`), in
`STOCK_DECODERS`.

Part of the remote-code modeling files (imports only the families' modules).
"""

from __future__ import annotations

from typing import Any

# `from .x import` (not `from . import x`): transformers' remote-code loader follows only this form.
from .deepseek_v3 import FAMILY as DEEPSEEK_V3
from .family import ModelFamily, StockDecoder
from .glm4_moe import FAMILY as GLM4_MOE
from .gpt_oss import FAMILY as GPT_OSS
from .stock_decoders import LLAMA, MISTRAL, QWEN2, QWEN2_MOE, QWEN3, QWEN3_MOE

FAMILIES: tuple[ModelFamily, ...] = (DEEPSEEK_V3, GLM4_MOE, GPT_OSS)
STOCK_DECODERS: tuple[StockDecoder, ...] = (QWEN3, QWEN3_MOE, LLAMA, QWEN2, QWEN2_MOE, MISTRAL)


def family_named(name: str | None) -> ModelFamily | None:
    """The family of `McoreRLConfig.family` / `ModelConfig.arch`; None for the GQA decoder's names."""
    return next((f for f in FAMILIES if f.name == name), None)


def family_of(hf: Any) -> ModelFamily | None:
    """The family of an HF config: ours by its `family` field, a stock one by its `model_type`."""
    model_type = getattr(hf, "model_type", None)
    return next(
        (f for f in FAMILIES if f.stock_model_type == model_type or f.name == getattr(hf, "family", None)), None
    )


def stock_decoder(model_type: str | None) -> StockDecoder | None:
    """The record of a stock GQA-decoder model type; None for ours and the families'."""
    return next((d for d in STOCK_DECODERS if d.model_type == model_type), None)
