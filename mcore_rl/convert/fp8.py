"""Block-scaled FP8 checkpoints (DeepSeek-V3, Kimi-K2, DeepSeek-R1 as released), dequantized on read.

Such a checkpoint stores a linear weight [rows, cols] as `float8_e4m3fn` and beside it
`<name>_scale_inv` [ceil(rows / br), ceil(cols / bc)] in fp32, one factor per br x bc block
(`quantization_config.weight_block_size`, [128, 128] in the released files; the last block of a
dimension may be partial). The weight is `fp8 * scale_inv` of its block, computed in fp32 and
rounded once to the checkpoint's dtype (DeepSeek's own `weight_dequant` does the same), one block
row at a time, so the fp32 intermediates are a block row (128 x 18432 x 4 B x 2 = 19 MB for the
largest released matrix) beside the output. Only the rows a rank reads are dequantized: a row range
needs only the scale rows of its blocks.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

SCALE_SUFFIX = "_scale_inv"


def block_size_of(directory: str) -> tuple[int, int] | None:
    """`weight_block_size` of a checkpoint's `config.json` when it is block-scaled FP8, else None."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        quantization: dict[str, Any] = json.load(f).get("quantization_config") or {}
    block = quantization.get("weight_block_size")
    if quantization.get("quant_method") != "fp8" or not block:
        return None
    rows, cols = block
    return int(rows), int(cols)


def dequantize(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype,
    first_row: int = 0,
    first_col: int = 0,
) -> torch.Tensor:
    """`weight` (FP8 rows/cols starting at `first_row` / `first_col` of the whole tensor) times the
    scale of each element's block, in `dtype`. `scale_inv` holds the block rows and columns that
    cover `weight` (the first one being the block of `first_row` / `first_col`)."""
    rows, cols = weight.shape
    br, bc = block
    col_block = (torch.arange(cols) + first_col) // bc - first_col // bc
    out = torch.empty(rows, cols, dtype=dtype)
    # one block row at a time: the fp32 intermediates stay a block row, not the whole slice
    edges = [0, *range(br - first_row % br, rows, br), rows]
    for i, (start, stop) in enumerate(zip(edges[:-1], edges[1:])):
        if start < stop:
            scales = scale_inv[i].float()[col_block]
            out[start:stop] = (weight[start:stop].float() * scales).to(dtype)
    return out


def scale_rows_for(start: int, stop: int, block_rows: int) -> tuple[int, int]:
    """The scale rows [first, last) that cover weight rows [start, stop)."""
    return start // block_rows, -(-stop // block_rows)
