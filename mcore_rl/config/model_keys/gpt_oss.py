"""GPT-OSS's keys (`hf/gpt_oss.py`, which checks them, and `models/gpt_oss.py`): attention sinks,
the layers the sliding window applies to, biases on every linear, and the experts' clamped SwiGLU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mcore_rl.config.schema import ModelConfig
from mcore_rl.config.sections import Section


@dataclass
class GptOssKeys:
    """GPT-OSS's sinks, window pattern, biases and clamped SwiGLU (docs/model_families.md)."""

    family: ClassVar[str] = "gpt_oss"  # the `hf/families.py` family whose bundle checks these keys

    # A window on some layers only: one entry per layer, 1 = attends within sliding_window, 0 = to
    # every earlier token; None = sliding_window (if set) on every layer. Stock GPT-OSS: 1, 0, 1, ...
    sliding_window_pattern: list[int] | None = None
    attention_sinks: bool = False  # a learned logit per head joins every attention softmax (no value)
    linear_biases: bool = False  # biases on q/k/v/o, the router and the experts' two linears
    # the experts' clamped SwiGLU, gate <= limit, |up| <= limit, gate * sigmoid(1.702 gate) * (up + 1);
    # None = not clamped
    swiglu_limit: float | None = None


SECTION = Section(ModelConfig, "", GptOssKeys, flat=True)
