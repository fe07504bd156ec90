"""Reading local Hugging Face checkpoint directories: tensors, config, and the small files around them."""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterator, Mapping

import torch
from safetensors import safe_open
from transformers import AutoConfig

from mcore_rl.config.rope_scaling import check_rope_scaling
from mcore_rl.convert import mxfp4
from mcore_rl.convert.fp8 import dequantize, fp8_layout, fp8_layout_of, scale_rows_for
from mcore_rl.config.rules import Errors
from mcore_rl.hf.configuration import OWN_MODEL_TYPES, model_config_from_hf_config, unsupported_stock_fields
from mcore_rl.hf.families import FAMILIES, STOCK_DECODERS, family_of
from mcore_rl.hf.refused_architectures import refusal

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from mcore_rl.config.schema import ModelConfig

SUPPORTED_MODEL_TYPES = (
    *(decoder.model_type for decoder in STOCK_DECODERS),
    *OWN_MODEL_TYPES,  # with exports written before the reference classes were renamed
    *(family.stock_model_type for family in FAMILIES),
    *(alias for family in FAMILIES for alias in family.config_aliases),
)
# Where a converted megatron checkpoint keeps the source's assets (`copy_assets`).
ASSETS_DIR = "hf_assets"
# Copied along as assets: small files that are not weights, config or code (tokenizer, chat
# template, generation config, README, ...).
_NOT_ASSETS = re.compile(
    r"(.*\.(safetensors|bin|pt|pth|ckpt|gguf|h5|msgpack|onnx|py|pyc)|.*\.index\.json|config\.json)$"
)
_MAX_ASSET_BYTES = 100 * 1024**2
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,  # block-scaled FP8 checkpoints (convert/fp8.py)
}


class HFCheckpoint(Mapping[str, torch.Tensor]):
    """The tensors of a local safetensors checkpoint, read from disk when looked up.

    With `wanted`, a name it rejects comes back as a *meta* tensor of the right shape and dtype
    (nothing is read): `hf_to_megatron` can then build every megatron tensor, and a rank reads only
    the tensors its own layers and experts need. An FP8 checkpoint (`convert/fp8.py`: block-scaled or
    per-channel scales) reads as its dequantized self: each FP8 weight
    comes back in the checkpoint's dtype and its scale tensors are not listed.

    Expert tensors a family's stock checkpoint stacks over the experts (`ModelFamily.
    stacked_expert_tensors`: GPT-OSS's `mlp.experts.gate_up_proj` [E, ...]) are listed and read per
    expert, under the names the reference model gives them (`mlp.experts.{j}.gate_up_proj`): a
    read touches one expert's bytes, never the stack. MXFP4 stacks (`convert/mxfp4.py`: `*_blocks`
    and `*_scales`, GPT-OSS as released) read dequantized, one expert at a time, in the checkpoint's
    dtype.
    """

    def __init__(self, directory: str, wanted: Callable[[str], bool] | None = None) -> None:
        self.directory = directory
        self.wanted = wanted
        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        self._files: dict[str, str] = {}
        if os.path.exists(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            self._files = {name: os.path.join(directory, file) for name, file in weight_map.items()}
        elif os.path.exists(single):
            with safe_open(single, "pt", device="cpu") as f:
                self._files = {name: single for name in f.keys()}
        else:
            found = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
            raise FileNotFoundError(
                f"{directory}: no model.safetensors or model.safetensors.index.json (found {found}); "
                "only safetensors checkpoints are read - re-save others with transformers' save_pretrained"
            )
        stacked = _stacked_expert_tensors(directory)
        fused = [n for n in self._files if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]
        if fused and not stacked:
            raise ValueError(
                f"{directory}: fused expert tensors ({fused[0]}, ...) are an in-memory transformers layout, "
                "not a checkpoint one; re-save with transformers' save_pretrained (per-expert names)"
            )
        self._handles: dict[str, Any] = {}
        self.fp8 = fp8_layout_of(directory)
        suffix = self.fp8.scale_suffix if self.fp8 else ""
        scales = {n for n in self._files if suffix and n.endswith(suffix) and n[: -len(suffix)] in self._files}
        self._hidden = scales  # read through their weights, not listed
        self._quantized = {n[: -len(suffix)] for n in self._hidden}
        self._mxfp4: set[str] = set()  # stacked names stored as MXFP4 blocks and scales
        if mxfp4.is_mxfp4(directory):
            blocks = {n[: -len(mxfp4.BLOCKS_SUFFIX)] for n in self._files if n.endswith(mxfp4.BLOCKS_SUFFIX)}
            self._mxfp4 = {n for n in blocks if n + mxfp4.SCALES_SUFFIX in self._files}
            self._hidden |= {n + suffix for n in self._mxfp4 for suffix in mxfp4.SUFFIXES}
        # one expert's slice of a stacked tensor: per-expert name -> (stacked name, expert)
        self._experts: dict[str, tuple[str, int]] = {}
        self._names: list[str] = []
        for name in [*self._files, *self._mxfp4]:
            head, sep, leaf = name.rpartition(".mlp.experts.")
            if sep and leaf in stacked and (name in self._mxfp4 or name not in self._hidden):
                count = self._stacked_shape(name)[0]
                per_expert = {f"{head}.mlp.experts.{j}.{leaf}": (name, j) for j in range(count)}
                self._experts.update(per_expert)
                self._names += per_expert
            elif name not in self._hidden and name not in self._mxfp4:
                self._names.append(name)
        self._listed = set(self._names)
        self._dtype: torch.dtype | None = None

    def _stacked_shape(self, name: str) -> list[int]:
        """[E, ...] of a stacked expert tensor as it reads (MXFP4: [E, in, out] unquantized)."""
        if name in self._mxfp4:
            blocks = name + mxfp4.BLOCKS_SUFFIX
            return mxfp4.unquantized_shape(self._handle(self._files[blocks]).get_slice(blocks).get_shape())
        return list(self._handle(self._files[name]).get_slice(name).get_shape())

    def _read_expert(self, name: str) -> torch.Tensor:
        """One expert's slice of a stacked tensor; only its bytes are read (the file opened for this read)."""
        stacked, expert = self._experts[name]
        if stacked not in self._mxfp4:
            return self._read_one_expert(stacked, expert)
        blocks, scales = (self._read_one_expert(stacked + suffix, expert) for suffix in mxfp4.SUFFIXES)
        return mxfp4.dequantize(blocks, scales, self.dtype())

    def _read_one_expert(self, stored: str, expert: int) -> torch.Tensor:
        with safe_open(self._files[stored], "pt", device="cpu") as handle:
            return handle.get_slice(stored)[expert]

    def _handle(self, path: str) -> Any:
        if path not in self._handles:
            self._handles[path] = safe_open(path, "pt", device="cpu")
        return self._handles[path]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._files and name not in self._experts:
            raise KeyError(f"Hugging Face checkpoint {self.directory} has no tensor {name!r}")
        if self.wanted is not None and not self.wanted(name):
            return self.meta(name)
        if name in self._experts:
            return self._read_expert(name)
        handle = self._handle(self._files[name])
        if name in self._quantized:
            assert self.fp8 is not None  # only FP8 checkpoints list quantized names
            scale_name = name + self.fp8.scale_suffix
            scale = self._handle(self._files[scale_name]).get_tensor(scale_name)
            return dequantize(handle.get_tensor(name), scale, self.fp8.block, self.dtype())
        return handle.get_tensor(name)

    def meta(self, name: str) -> torch.Tensor:
        """A *meta* tensor of `name`'s shape and the dtype it reads as (nothing is read)."""
        if name not in self._files and name not in self._experts:
            raise KeyError(f"Hugging Face checkpoint {self.directory} has no tensor {name!r}")
        if name in self._experts:
            stacked = self._experts[name][0]
            piece_dtype = self.dtype() if stacked in self._mxfp4 else self.meta_dtype(stacked)
            return torch.empty(self._stacked_shape(stacked)[1:], dtype=piece_dtype, device="meta")
        piece = self._handle(self._files[name]).get_slice(name)
        dtype = self.dtype() if name in self._quantized else _SAFETENSORS_DTYPES[piece.get_dtype()]
        return torch.empty(piece.get_shape(), dtype=dtype, device="meta")

    def meta_dtype(self, name: str) -> torch.dtype:
        """The dtype a stored tensor has in its file."""
        return _SAFETENSORS_DTYPES[self._handle(self._files[name]).get_slice(name).get_dtype()]

    def __contains__(self, name: object) -> bool:
        return name in self._listed

    def read_rows(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Only the slice [start, stop) of tensor `name` along `dim` (0 or 1) is read from disk.

        The file is opened for this one read: a handle kept open keeps the pages it read resident
        (measured: RSS grew with every tensor read), which is what streaming must not do.
        """

        if name not in self._files and name not in self._experts:
            raise KeyError(f"Hugging Face checkpoint {self.directory} has no tensor {name!r}")
        if dim not in (0, 1):
            raise ValueError(f"{name}: slices are read along dim 0 or 1, not {dim}")
        if name in self._experts:  # one expert's slice, then its rows
            return self._read_expert(name).narrow(dim, start, stop - start).contiguous()
        with safe_open(self._files[name], "pt", device="cpu") as handle:
            piece = handle.get_slice(name)
            rows = piece[start:stop] if dim == 0 else piece[:, start:stop]
        if name not in self._quantized:
            return rows
        assert self.fp8 is not None  # only FP8 checkpoints list quantized names
        first, last = scale_rows_for(start, stop, self.fp8.block[dim])
        scale_name = name + self.fp8.scale_suffix
        with safe_open(self._files[scale_name], "pt", device="cpu") as handle:
            piece = handle.get_slice(scale_name)
            if len(piece.get_shape()) < 2:  # one scale for the tensor
                scale = piece[:]
            else:
                scale = piece[first:last] if dim == 0 else piece[:, first:last]
        at = (start, 0) if dim == 0 else (0, start)
        return dequantize(rows, scale, self.fp8.block, self.dtype(), *at)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def dtype(self) -> torch.dtype:
        """The dtype of the (first) embedding tensor: what the checkpoint is stored in (and what its
        FP8 weights are dequantized to)."""
        if self._dtype is None:
            name = "model.embed_tokens.weight" if "model.embed_tokens.weight" in self._files else self._names[0]
            self._dtype = _SAFETENSORS_DTYPES[self._handle(self._files[name]).get_slice(name).get_dtype()]
        return self._dtype


def _stacked_expert_tensors(directory: str) -> tuple[str, ...]:
    """The expert tensors the checkpoint's family stacks over the experts (by its config.json's model_type)."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return ()
    with open(path, encoding="utf-8") as f:
        model_type = json.load(f).get("model_type")
    family = next((f for f in FAMILIES if model_type in (f.stock_model_type, *f.config_aliases)), None)
    return family.stacked_expert_tensors if family else ()


def read_hf_config(directory: str) -> PretrainedConfig:
    """The `transformers` config of a local checkpoint directory (supported model types only)."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{directory} is not a Hugging Face checkpoint directory (no config.json)")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    model_type = data.get("model_type")
    refused = refusal(model_type)
    if refused is not None:
        raise ValueError(f"{path}: {refused}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{path}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    import mcore_rl.hf  # noqa: F401  (registers our model_types with AutoConfig)

    alias_of = next((f for f in FAMILIES if model_type in f.config_aliases), None)
    if alias_of is not None:  # the family's stock config under another model_type (no remote code run)
        data = {k: v for k, v in data.items() if k not in ("model_type", "auto_map")}
        return AutoConfig.for_model(alias_of.stock_model_type, **data)
    return AutoConfig.from_pretrained(directory, local_files_only=True)


def model_config_from_hf(hf: PretrainedConfig, rope_key: str | None = None) -> ModelConfig:
    """`configuration.model_config_from_hf_config`, after rejecting what megatron-core here cannot
    express (every problem at once, each naming the `config.json` field). `rope_key`: the RoPE key
    the source file has (`rope_key_in_file`), named in errors and kept for export."""

    model_type = getattr(hf, "model_type", None)
    problems: list[str] = []
    if refusal(model_type) is not None:
        raise ValueError(refusal(model_type))
    if model_type not in SUPPORTED_MODEL_TYPES:
        problems.append(f"model_type={model_type!r}: supported are {', '.join(SUPPORTED_MODEL_TYPES)}")
    family = family_of(hf)
    # a family's stock config says what its attention_bias means (GLM-4.5: q/k/v only) in its `unsupported`;
    # a family may take attention biases outright (GPT-OSS)
    if getattr(hf, "attention_bias", False) and not (
        family and (family.attention_bias or model_type == family.stock_model_type)
    ):
        problems.append("attention_bias=true: the megatron-core models here have no attention biases")
    problems += unsupported_stock_fields(hf, rope_key)
    try:  # FP8 weights: a layout the reader dequantizes (convert/fp8.py)
        fp8_layout(dict(getattr(hf, "quantization_config", None) or {}))
    except ValueError as err:
        problems.append(str(err))
    mc = None if problems else model_config_from_hf_config(hf, rope_key)
    if mc is not None:  # the scaling's values, named as the file spells them
        errors = Errors()
        check_rope_scaling(mc.rope_scaling, mc.max_position_embeddings, errors, rope_key or "rope_parameters")
        problems += errors.lines
    if problems:
        raise ValueError(f"cannot convert this {model_type} checkpoint:\n  " + "\n  ".join(problems))
    assert mc is not None  # built whenever there were no problems
    return mc


def copy_assets(source_dir: str, target_dir: str) -> str | None:
    """Copy the small non-weight, non-config, non-code files (tokenizer, ...); None if there are none."""
    names = [
        n
        for n in sorted(os.listdir(source_dir))
        if os.path.isfile(os.path.join(source_dir, n))
        and not _NOT_ASSETS.match(n)
        and os.path.getsize(os.path.join(source_dir, n)) <= _MAX_ASSET_BYTES
    ]
    if not names:
        return None
    os.makedirs(target_dir, exist_ok=True)
    for name in names:
        shutil.copyfile(os.path.join(source_dir, name), os.path.join(target_dir, name))
    return target_dir
