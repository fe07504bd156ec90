"""Hugging Face <-> megatron-core checkpoint conversion: the library behind `mcore-rl convert`.

**hf-to-mcore** reads a local Hugging Face checkpoint (`config.json` + safetensors, one file or an
index of shards) of a Qwen3, Qwen3-MoE, Llama, Qwen2/Qwen2.5, Qwen2-MoE, Mistral, DeepSeek-V3, GLM-4.5 or
GPT-OSS model (or one this package exported; FP8 and MXFP4 releases dequantized on read), builds the megatron-core model in the requested TP/PP/EP layout on every
rank, streams the weights in (`stream_import`: each rank reads only its own slice of each tensor, one
tensor at a time; padded vocabulary rows are zeros) and writes a *model-only* distributed checkpoint
in the format `mcore_rl.train.checkpoint` writes (`<out>/iter_0000000/`, `<out>/latest`). Next to it:
`hf_assets/` (tokenizer,
generation config and other small files of the source) and `recipe.yaml` (the `model:` section, the
checkpoint and the tokenizer), so `mcore-rl sft <out>/recipe.yaml ...` trains from it.

**mcore-to-hf** loads such a checkpoint (or one `mcore-rl sft` saved) into a megatron-core model and
streams it out (`stream_export`): one parameter at a time is gathered to one writer rank, mapped with
`weight_map.megatron_to_hf` (the mapping the weight sync uses) and appended to the current
safetensors shard, so a rank holds a few tensors beyond its model shard. It writes a Hugging Face
checkpoint:

- stock architectures to stock `transformers` classes: dense with QK-norm -> `Qwen3ForCausalLM`,
  dense without -> `LlamaForCausalLM`, MoE with QK-norm and no shared expert -> `Qwen3MoeForCausalLM`;
  without QK-norm: q/k/v biases -> `Qwen2ForCausalLM`, MoE with a gated shared expert ->
  `Qwen2MoeForCausalLM`, a sliding window (or a Mistral source) -> `MistralForCausalLM`;
- everything else (LatentMoE, AttnRes, n-gram embeddings, shared experts, MoE without QK-norm, and
  any future field the stock configs cannot express) -> our remote-code model: `config.json` with
  `model_type: mcore_rl` (`mcore_rl_qwen3` in exports before the rename, still read) and an `auto_map`, plus the modeling files of `mcore_rl/hf/` that
  `configuration.py` and `modeling.py` import (relative imports, followed transitively), so
  `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` loads it without mcore_rl.

A round trip HF -> megatron -> HF reproduces every tensor bit for bit (in the source dtype).

Modules: `hf_checkpoint` (reading HF checkpoint directories; `fp8`, `mxfp4`: quantized weights), `layout` (the layout to convert in),
`streaming` (owned slices, counters), `stream_import` / `stream_export` (the per-tensor data paths),
`to_mcore` (hf-to-mcore), `to_hf` (mcore-to-hf, HF config and remote-code files), `command` (the
`mcore-rl convert` command). It lives outside `mcore_rl.hf`, which must never need megatron-core.
"""

from mcore_rl.convert.command import plan, run
from mcore_rl.convert.hf_checkpoint import (
    ASSETS_DIR,
    SUPPORTED_MODEL_TYPES,
    HFCheckpoint,
    copy_assets,
    model_config_from_hf,
    read_hf_config,
)
from mcore_rl.convert.layout import build_chunks, check_layout, default_world_size, parallel_config
from mcore_rl.convert.stream_export import SafetensorsShardWriter, stream_export
from mcore_rl.convert.stream_import import stream_load
from mcore_rl.convert.streaming import StreamStats, owned_range
from mcore_rl.convert.to_hf import (
    DEFAULT_MAX_SHARD_BYTES,
    REMOTE,
    REMOTE_BASE_CLASS,
    REMOTE_CODE_ENTRY,
    REMOTE_CONFIG_CLASS,
    REMOTE_MODEL_CLASS,
    STOCK_CLASSES,
    export_config,
    export_kind,
    mcore_to_hf,
    model_config_from_dict,
    remote_code_files,
    save_safetensors,
    stored_model_config,
    write_hf_checkpoint,
    write_hf_files,
)
from mcore_rl.convert.to_mcore import RECIPE_FILE, hf_to_mcore, write_recipe

__all__ = [
    "ASSETS_DIR",
    "DEFAULT_MAX_SHARD_BYTES",
    "HFCheckpoint",
    "RECIPE_FILE",
    "REMOTE",
    "REMOTE_BASE_CLASS",
    "REMOTE_CODE_ENTRY",
    "REMOTE_CONFIG_CLASS",
    "REMOTE_MODEL_CLASS",
    "STOCK_CLASSES",
    "SafetensorsShardWriter",
    "StreamStats",
    "SUPPORTED_MODEL_TYPES",
    "build_chunks",
    "check_layout",
    "copy_assets",
    "default_world_size",
    "export_config",
    "export_kind",
    "hf_to_mcore",
    "mcore_to_hf",
    "model_config_from_dict",
    "model_config_from_hf",
    "owned_range",
    "parallel_config",
    "plan",
    "read_hf_config",
    "remote_code_files",
    "run",
    "save_safetensors",
    "stored_model_config",
    "stream_export",
    "stream_load",
    "write_hf_checkpoint",
    "write_hf_files",
    "write_recipe",
]
