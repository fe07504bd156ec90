"""The embedded inference engine's core (continuous batching, sampling, KV cache, FP8 weights)."""

from .core import EngineCore, Request, RequestOutput
from .fp8 import dequantize_block_fp8, is_fp8_weight, quantize_block_fp8
from .sampling import SamplingParams

__all__ = [
    "EngineCore",
    "Request",
    "RequestOutput",
    "SamplingParams",
    "dequantize_block_fp8",
    "is_fp8_weight",
    "quantize_block_fp8",
]
