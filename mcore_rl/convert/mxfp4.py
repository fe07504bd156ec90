"""MXFP4 expert weights (GPT-OSS as released), dequantized on read.

The released GPT-OSS checkpoints (`quantization_config.quant_method: mxfp4`) store each stacked
expert weight `mlp.experts.<name>` [E, in, out] as two tensors, output-major:

- `<name>_blocks` [E, out, in / 32, 16] uint8: blocks of 32 values along the input dimension, two
  e2m1 (FP4) values per byte, the low nibble first;
- `<name>_scales` [E, out, in / 32] uint8: one E8M0 exponent per block, biased by 127.

A value is `E2M1[nibble] * 2 ** (scale - 127)`, exact in fp32 and rounded once to the checkpoint's
dtype (bf16 in the release). The biases, attention, router, embeddings and head are not quantized.
One expert is dequantized at a time (its rows of both tensors are read alone), so the intermediates
are that expert's [out, in] in fp32 beside its output. Export writes unquantized weights.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
SUFFIXES = (BLOCKS_SUFFIX, SCALES_SUFFIX)
BLOCK = 32  # values per scale, along the input dimension
_SCALE_BIAS = 127
# the 16 e2m1 values by their 4-bit code: sign bit, 2 exponent bits, 1 mantissa bit
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def is_mxfp4(directory: str) -> bool:
    """Whether a checkpoint's `config.json` says its expert weights are MXFP4."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        quantization: dict[str, Any] = json.load(f).get("quantization_config") or {}
    return quantization.get("quant_method") == "mxfp4"


def unquantized_shape(blocks_shape: list[int]) -> list[int]:
    """[..., in, out] of a weight stored as blocks [..., out, in / 32, 16]."""
    *lead, out, groups, nbytes = blocks_shape
    return [*lead, groups * nbytes * 2, out]


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One weight [..., in, out] in `dtype` from its blocks [..., out, in / 32, 16] and scales [..., out, in / 32]."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).int()  # low nibble first
    values = lut[codes].flatten(-2)  # [..., out, in / 32, 32]
    exponents = scales.to(torch.int32) - _SCALE_BIAS
    values = torch.ldexp(values, exponents.unsqueeze(-1).float())
    return values.flatten(-2).transpose(-1, -2).to(dtype)
