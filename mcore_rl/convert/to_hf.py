"""mcore-to-hf: a megatron-core dist-checkpoint -> a Hugging Face checkpoint (stock class or remote code)."""

from __future__ import annotations

import os
import shutil
import sys
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mcore_rl.config.model_keys.attn_res import AttnResKeys
from mcore_rl.config.model_keys.latent_moe import LatentMoEKeys
from mcore_rl.config.model_keys.ngram import NgramEmbeddingConfig
from mcore_rl.config.loader import _build
from mcore_rl.config.schema import ModelConfig
from mcore_rl.convert.carried import open_carried
from mcore_rl.convert.hf_checkpoint import ASSETS_DIR, copy_assets
from mcore_rl.convert.layout import build_chunks, check_layout, parallel_config
from mcore_rl.hf.families import FAMILIES, STOCK_DECODERS, family_named
from mcore_rl.hf.rope import respell_rope_in_file
from mcore_rl.convert.stream_export import SafetensorsShardWriter, natural_key, stack_experts, stream_export
from mcore_rl.convert.streaming import StreamStats
from mcore_rl.hf.configuration import (
    hf_config_from_model_config,
    keep_source_layer_keys,
    model_config_from_hf_config,
    to_stock_hf_config,
)
from mcore_rl.parallel import setup
from mcore_rl.train import checkpoint

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from mcore_rl.config.schema import ParallelConfig

STOCK_CLASSES = {
    **{decoder.model_type: decoder.stock_class for decoder in STOCK_DECODERS},
    **{family.stock_model_type: family.stock_class for family in FAMILIES},
}
REMOTE = "remote"
REMOTE_CODE_ENTRY = ("configuration.py", "modeling.py")
REMOTE_CONFIG_CLASS = "McoreRLConfig"
REMOTE_MODEL_CLASS = "McoreRLForCausalLM"
REMOTE_BASE_CLASS = "McoreRLModel"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
# Tensors a stock class keeps in fp32 whatever the model's dtype (its `_keep_in_fp32_modules_strict`).
FP32_TENSORS = {family.stock_model_type: family.fp32_tensors for family in FAMILIES if family.fp32_tensors}


def tensor_dtype(hf_name: str, kind: str | None, dtype: torch.dtype) -> torch.dtype:
    """The dtype an exported tensor is written in: the export's, or fp32 where the stock family keeps it."""
    return torch.float32 if kind and hf_name.endswith(FP32_TENSORS.get(kind, ())) else dtype


# The remote-code files are the modules of mcore_rl.hf (a sibling package of this one).
_HF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hf")
# Source-config fields that are not architecture but belong to the model (special token ids).
_CARRIED_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def export_kind(mc: ModelConfig, family: str | None = None) -> str:
    """'qwen3' | 'qwen3_moe' | 'llama' | 'qwen2' | 'qwen2_moe' | 'mistral' (stock transformers
    classes) or 'remote' (our modeling code).

    Stock only when the stock config expresses the whole model: converting our HF config to the
    stock one and back must lose nothing, so any field a stock config lacks (today's LatentMoE,
    AttnRes and n-gram fields, or tomorrow's) selects the remote-code model. `family` (the source
    checkpoint's model_type) picks between stock classes that compute the same model (Mistral
    without a window is Llama).
    """

    if (
        mc.section(LatentMoEKeys).moe_latent_size
        or mc.section(AttnResKeys).attn_res != "none"
        or mc.section(NgramEmbeddingConfig).orders
    ):
        return REMOTE
    ours = hf_config_from_model_config(mc)
    try:
        stock = to_stock_hf_config(ours, family)
    except ValueError:
        return REMOTE
    back = hf_config_from_model_config(model_config_from_hf_config(stock))
    if back.to_dict() != ours.to_dict():
        return REMOTE
    return stock.model_type


def export_config(
    mc: ModelConfig, dtype: torch.dtype, source: dict[str, Any] | None = None
) -> tuple[PretrainedConfig, str]:
    """The HF config to write, and the export kind (see `export_kind`)."""

    family = (source or {}).get("model_type")
    kind = export_kind(mc, family)
    ours = hf_config_from_model_config(mc)
    cfg: PretrainedConfig
    if kind == REMOTE:
        cfg = ours
        cfg.architectures = [REMOTE_MODEL_CLASS]
        cfg.auto_map = {
            "AutoConfig": f"configuration.{REMOTE_CONFIG_CLASS}",
            "AutoModel": f"modeling.{REMOTE_BASE_CLASS}",
            "AutoModelForCausalLM": f"modeling.{REMOTE_MODEL_CLASS}",
        }
    else:
        cfg = to_stock_hf_config(ours, family)
        keep_source_layer_keys(cfg, source)  # mixed dense/MoE layers in the user's own keys
        cfg.architectures = [STOCK_CLASSES[kind]]
    for key in _CARRIED_FIELDS:
        if source and key in source:  # null stays null (Llama's bos_token_id), not the class default
            setattr(cfg, key, source[key])
    cfg.dtype = dtype
    return cfg, kind


def remote_code_files() -> list[str]:
    """The `mcore_rl/hf/*.py` files the remote-code model needs (relative imports, transitively).

    Raises if one of them imports anything but torch, transformers and the standard library where
    transformers' remote-code loader looks (it refuses to load a model whose files import a
    package that is not installed, so an export must not need mcore_rl).
    """
    from transformers.dynamic_module_utils import get_imports, get_relative_imports  # lazy: transformers

    todo, seen = list(REMOTE_CODE_ENTRY), []
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.append(name)
        todo += [f"{module.replace('.', '/')}.py" for module in get_relative_imports(os.path.join(_HF_DIR, name))]
    allowed = set(sys.stdlib_module_names) | {"torch", "transformers", "__future__"}
    for name in seen:
        extra = sorted(set(get_imports(os.path.join(_HF_DIR, name))) - allowed)
        if extra:
            raise RuntimeError(
                f"mcore_rl/hf/{name} imports {extra} outside a try block; an exported remote-code model "
                "would then need those packages installed to load. Import them lazily inside a "
                "`try:` block (transformers' import check skips those), or not at all."
            )
    return [os.path.join(_HF_DIR, name) for name in seen]


def save_safetensors(
    tensors: dict[str, torch.Tensor], output_dir: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> list[str]:
    """`model.safetensors`, or `model-0000i-of-0000n.safetensors` + index when over `max_shard_bytes`."""
    names = sorted(tensors, key=natural_key)
    writer = SafetensorsShardWriter(
        output_dir, [(n, tuple(tensors[n].shape), tensors[n].dtype) for n in names], max_shard_bytes
    )
    for name in names:
        writer.write(name, tensors[name])
    return writer.close()


def write_hf_checkpoint(
    hf_state: dict[str, torch.Tensor],
    mc: ModelConfig,
    output_dir: str,
    dtype: torch.dtype = torch.float32,
    source_config: dict[str, Any] | None = None,
    assets_dir: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> str:
    """Write config, weights (HF names), remote code if needed and assets; returns the export kind."""
    kind = write_hf_files(mc, output_dir, dtype, source_config, assets_dir)
    family = family_named(mc.arch)
    if family and kind == family.stock_model_type and family.stacked_expert_tensors:  # as stock files hold them
        hf_state = stack_experts(hf_state, family.stacked_expert_tensors)
    save_safetensors(
        {k: v.to(tensor_dtype(k, kind, dtype)).contiguous() for k, v in hf_state.items()}, output_dir, max_shard_bytes
    )
    return kind


def write_hf_files(
    mc: ModelConfig,
    output_dir: str,
    dtype: torch.dtype,
    source_config: dict[str, Any] | None = None,
    assets_dir: str | None = None,
) -> str:
    """Everything of an HF checkpoint but the weights: config, remote code if needed, assets; the export kind."""
    cfg, kind = export_config(mc, dtype, source_config)
    code = remote_code_files() if kind == REMOTE else []
    os.makedirs(output_dir, exist_ok=True)
    if assets_dir and os.path.isdir(assets_dir):
        copy_assets(assets_dir, output_dir)
    cfg.save_pretrained(output_dir)
    respell_rope_in_file(os.path.join(output_dir, "config.json"), mc.rope_scaling.hf_key)  # the source's spelling
    for path in code:
        shutil.copyfile(path, os.path.join(output_dir, os.path.basename(path)))
    return kind


def _stored_dtype(path: str, name: str = "embedding.word_embeddings.weight") -> torch.dtype | None:
    """The dtype a megatron dist-checkpoint stores a tensor in (None if not found)."""
    from megatron.core import dist_checkpointing  # lazy: megatron

    try:
        meta = dist_checkpointing.load_tensors_metadata(path)
    except Exception:  # pragma: no cover - unusual backends
        return None
    for key, value in meta.items():
        if key.endswith(name) and hasattr(value, "dtype"):
            return value.dtype
    return None


def mcore_to_hf(
    input_path: str,
    output_dir: str,
    pc: ParallelConfig | None = None,
    model_config: ModelConfig | None = None,
    dtype: str = "auto",
    tokenizer_dir: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    stats: StreamStats | None = None,
) -> str | None:
    """Export a megatron dist-checkpoint (a save dir or one `iter_*` dir) to HF (collective).

    `model_config` defaults to the one stored in the checkpoint. `dtype="auto"` keeps the source
    HF dtype of a converted checkpoint, else the dtype the weights are stored in. Rank 0 writes,
    streaming one tensor at a time (`stream_export`; `stats` gets its counters); returns the export
    kind there (None elsewhere).
    """
    from megatron.core import dist_checkpointing  # lazy: megatron

    path = checkpoint.latest_checkpoint(input_path)
    if path is None:
        raise FileNotFoundError(f"{input_path} holds no checkpoint (no 'latest' file, no metadata.json)")
    pc = pc or parallel_config()
    _, world_size = setup.init_distributed()
    common = dist_checkpointing.load_common_state_dict(path)["common"]
    mc = model_config or stored_model_config(common, path)
    check_layout(mc, pc, world_size)
    stored = _stored_dtype(path)
    if dtype == "auto":
        out_dtype = _DTYPES.get(common.get("hf_dtype", ""), stored or torch.float32)
    else:
        out_dtype = _DTYPES[dtype]
    setup.init_model_parallel(pc)
    setup.set_seed(0)  # megatron-core modules draw from the model-parallel RNG tracker at build
    # Load in the stored precision, so nothing is rounded on the way in.
    precision = "bf16" if stored == torch.bfloat16 else "fp32"
    chunks = build_chunks(mc, pc, precision)
    checkpoint.load_checkpoint(path, chunks, None)
    kind, carried = None, None
    if dist.get_rank() == 0:
        save_dir = (
            os.path.dirname(path) if os.path.exists(os.path.join(os.path.dirname(path), checkpoint.LATEST)) else path
        )
        assets = tokenizer_dir or os.path.join(save_dir, ASSETS_DIR)
        kind = write_hf_files(mc, output_dir, out_dtype, common.get("hf_config"), assets)
        carried = open_carried(save_dir)  # layers the model does not compute: convert/carried.py
    stream_export(chunks, mc, output_dir, out_dtype, max_shard_bytes, stats, kind, carried)
    dist.barrier()
    return kind


def stored_model_config(common: dict[str, Any], path: str) -> ModelConfig:
    """The `ModelConfig` a checkpoint recorded in its common state (`common["model"]`)."""
    if "model" not in common:
        raise ValueError(
            f"{path} does not record its model config (saved before configs were stored); "
            "pass the recipe it was trained with: --config RECIPE.yaml [model.key=value ...]"
        )
    return model_config_from_dict(common["model"])


def model_config_from_dict(data: dict[str, Any]) -> ModelConfig:
    """A `ModelConfig` from its plain dict (as checkpoints and recipes store it), type-checked."""

    return _build(ModelConfig, data, "model")
