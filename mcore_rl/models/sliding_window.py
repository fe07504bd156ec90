"""Sliding-window attention (Mistral) in megatron-core's local attention, with packed documents.

megatron-core 0.16.1 supports a window in its local `DotProductAttention` (`window_size=(left,
right)`, applied by `FusedScaleMaskSoftmax`'s torch path), but there the window mask *replaces* the
attention mask it is given: packed rows would attend across documents. `apply` makes the softmax
mask both (masked = outside the window or masked by the caller). transformer-engine's attention
takes the window natively.

HF's window W (`kv > q - W`: the token and the W - 1 before it) is megatron's `(W - 1, 0)`.
"""

from __future__ import annotations

from typing import Any

from mcore_rl.config.schema import ModelConfig

_applied = False


def window_size(model: ModelConfig) -> tuple[int, int] | None:
    """megatron-core's `window_size` for `model.sliding_window` (None = full causal attention)."""
    return None if model.sliding_window is None else (model.sliding_window - 1, 0)


def apply() -> None:
    global _applied
    if _applied:
        return
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer.utils import get_sliding_window_causal_mask

    original = fused_softmax.FusedScaleMaskSoftmax.forward_torch_softmax

    def forward_torch_softmax(self: Any, input: Any, mask: Any, softmax_offset: Any = None) -> Any:
        window = self.window_size
        if window is None or mask is None:
            return original(self, input, mask, softmax_offset)
        outside = get_sliding_window_causal_mask(input.size(2), input.size(3), window).to(mask.device)
        self.window_size = None  # the original would otherwise drop `mask` for its window mask
        try:
            return original(self, input, mask | outside, softmax_offset)
        finally:
            self.window_size = window

    fused_softmax.FusedScaleMaskSoftmax.forward_torch_softmax = forward_torch_softmax
    _applied = True
