"""FP8 checkpoints, dequantized on read: DeepSeek's block-scaled FP8 (DeepSeek-V3, Kimi-K2, DeepSeek-R1
as released) and compressed-tensors' FP8 (GLM-4.5-FP8 and GLM-4.5-Air-FP8 as released).

Both store a linear weight [rows, cols] as `float8_e4m3fn` and beside it one scale per block of
br x bc elements (the last block of a dimension may be partial); the weight is `fp8 * scale` of its
block, computed in fp32 and rounded once to the checkpoint's dtype (DeepSeek's own `weight_dequant`
and compressed-tensors' decompression do the same). They differ in where the block comes from and
what the scale is called (`Fp8Layout`):

- DeepSeek (`quant_method: fp8`): `<name>_scale_inv` [ceil(rows / br), ceil(cols / bc)] in fp32,
  `weight_block_size` [128, 128] in the released files;
- compressed-tensors (`quant_method: compressed-tensors`, `format: float-quantized`, 8-bit float
  weights): `<name>_scale`, per output channel (`strategy: channel`, [rows, 1]: a block is one row,
  what the GLM-4.5 releases use), per block (`strategy: block`, `block_structure`) or one per tensor
  (`strategy: tensor`). Their activation scheme (dynamic per token) is a serving matter: nothing of
  it is stored.

The rows are dequantized a chunk at a time, so the fp32 intermediates are 128 rows of one tensor
(128 x 18432 x 4 B x 2 = 19 MB for the largest DeepSeek matrix) beside the output. Only the rows a
rank reads are dequantized: a row range needs only the scale rows of its blocks. Export writes
unquantized weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

SCALE_SUFFIX = "_scale_inv"  # DeepSeek's
COMPRESSED_SCALE_SUFFIX = "_scale"  # compressed-tensors'
WHOLE = 2**62  # a block dimension that spans the whole tensor
_CHUNK_ROWS = 128


@dataclasses.dataclass(frozen=True)
class Fp8Layout:
    """How a checkpoint stores its FP8 weights' scales: the block one scale covers, and its name."""

    block: tuple[int, int]
    scale_suffix: str


def fp8_layout(quantization: dict[str, Any]) -> Fp8Layout | None:
    """The FP8 layout a `quantization_config` describes; None when it is not FP8 at all. Raises
    ValueError naming the field for FP8 variants that are not read here."""
    method = quantization.get("quant_method")
    if method == "fp8":
        block = quantization.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2):
            raise ValueError(f"quantization_config.weight_block_size={block!r}: expected [rows, cols]")
        return Fp8Layout((int(block[0]), int(block[1])), SCALE_SUFFIX)
    if method != "compressed-tensors":
        return None
    fmt = quantization.get("format")
    if fmt != "float-quantized":
        raise ValueError(f"quantization_config.format={fmt!r}: only compressed-tensors' 'float-quantized' is read")
    layouts = {_group_block(name, group) for name, group in (quantization.get("config_groups") or {}).items()}
    if len(layouts) != 1:
        raise ValueError(f"quantization_config.config_groups: expected one weight scheme, found {len(layouts)}")
    return Fp8Layout(layouts.pop(), COMPRESSED_SCALE_SUFFIX)


def _group_block(name: str, group: dict[str, Any]) -> tuple[int, int]:
    """The scale block of one compressed-tensors config group's FP8 weights."""
    weights = group.get("weights") or {}
    key = f"quantization_config.config_groups.{name}.weights"
    if weights.get("num_bits") != 8 or weights.get("type") != "float" or not weights.get("symmetric", True):
        raise ValueError(f"{key}={weights}: only symmetric 8-bit float (FP8) weights are dequantized on import")
    strategy = weights.get("strategy")
    if strategy == "channel":
        return 1, WHOLE
    if strategy == "tensor":
        return WHOLE, WHOLE
    if strategy == "block" and isinstance(weights.get("block_structure"), (list, tuple)):
        rows, cols = weights["block_structure"]
        return int(rows), int(cols)
    raise ValueError(f"{key}.strategy={strategy!r}: FP8 weights are read per channel, per block or per tensor")


def fp8_layout_of(directory: str) -> Fp8Layout | None:
    """The FP8 layout of a checkpoint directory's `config.json`, None when its weights are not FP8."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        quantization: dict[str, Any] = json.load(f).get("quantization_config") or {}
    try:
        return fp8_layout(quantization)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def dequantize(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype,
    first_row: int = 0,
    first_col: int = 0,
) -> torch.Tensor:
    """`weight` (FP8 rows/cols starting at `first_row` / `first_col` of the whole tensor) times the
    scale of each element's block, in `dtype`. `scale` holds the block rows and columns that cover
    `weight` (the first one being the block of `first_row` / `first_col`)."""
    rows, cols = weight.shape
    br, bc = block
    scale = scale.reshape(scale.shape[0] if scale.ndim else 1, -1).float()  # a per-tensor scale: [1, 1]
    col_block = (torch.arange(cols) + first_col) // bc - first_col // bc
    out = torch.empty(rows, cols, dtype=dtype)
    # a chunk of rows at a time: the fp32 intermediates stay a chunk, not the whole slice
    for start in range(0, rows, _CHUNK_ROWS):
        stop = min(start + _CHUNK_ROWS, rows)
        row_block = (torch.arange(start, stop) + first_row) // br - first_row // br
        scales = scale[row_block][:, col_block]
        out[start:stop] = (weight[start:stop].float() * scales).to(dtype)
    return out


def scale_rows_for(start: int, stop: int, block_rows: int) -> tuple[int, int]:
    """The scale rows [first, last) that cover weight rows [start, stop)."""
    return start // block_rows, -(-stop // block_rows)
