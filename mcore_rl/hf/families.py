"""The model families beyond the GQA decoder (`family.py`), registered once: add yours to `FAMILIES`.

Part of the remote-code modeling files (imports only the families' modules).
"""

from __future__ import annotations

from typing import Any

# `from .x import` (not `from . import x`): transformers' remote-code loader follows only this form.
from .deepseek_v3 import FAMILY as DEEPSEEK_V3
from .family import ModelFamily

FAMILIES: tuple[ModelFamily, ...] = (DEEPSEEK_V3,)


def family_named(name: str | None) -> ModelFamily | None:
    """The family of `McoreRLConfig.family` / `ModelConfig.arch`; None for the GQA decoder's names."""
    return next((f for f in FAMILIES if f.name == name), None)


def family_of(hf: Any) -> ModelFamily | None:
    """The family of an HF config: ours by its `family` field, a stock one by its `model_type`."""
    model_type = getattr(hf, "model_type", None)
    return next(
        (f for f in FAMILIES if f.stock_model_type == model_type or f.name == getattr(hf, "family", None)), None
    )
