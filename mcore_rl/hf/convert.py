"""Hugging Face <-> megatron-core checkpoint conversion: the library behind `mcore-rl convert`.

**hf-to-mcore** reads a local Hugging Face checkpoint (`config.json` + safetensors, one file or an
index of shards) of a Qwen3, Qwen3-MoE or Llama model (or one this module exported), builds the
megatron-core model in the requested TP/PP/EP layout on every rank, copies the weights in through
`weight_map.hf_to_megatron` + `shards.load_full_state_dict` and writes a *model-only* distributed
checkpoint in the format `mcore_rl.train.checkpoint` writes (`<out>/iter_0000000/`, `<out>/latest`).
Each rank reads only the tensors of its own layers and experts. Next to it: `hf_assets/` (tokenizer,
generation config and other small files of the source) and `recipe.yaml` (the `model:` section, the
checkpoint and the tokenizer), so `mcore-rl sft <out>/recipe.yaml ...` trains from it.

**mcore-to-hf** loads such a checkpoint (or one `mcore-rl sft` saved) into a megatron-core model,
gathers the full tensors, maps them with `weight_map.full_megatron_to_hf` (the mapping the weight
sync uses) and writes a Hugging Face checkpoint:

- stock architectures to stock `transformers` classes: dense with QK-norm -> `Qwen3ForCausalLM`,
  dense without -> `LlamaForCausalLM`, MoE with QK-norm and no shared expert -> `Qwen3MoeForCausalLM`;
- everything else (LatentMoE, AttnRes, n-gram embeddings, shared experts, MoE without QK-norm, and
  any future field the stock configs cannot express) -> our remote-code model: `config.json` with
  `model_type: mcore_rl_qwen3` and an `auto_map`, plus the modeling files of `mcore_rl/hf/` that
  `configuration.py` and `modeling.py` import (relative imports, followed transitively), so
  `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` loads it without mcore_rl.

A round trip HF -> megatron -> HF reproduces every tensor bit for bit (in the source dtype).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from mcore_rl.config.schema import ModelConfig, ParallelConfig

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "llama", "mcore_rl_qwen3")
STOCK_CLASSES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM"}
REMOTE = "remote"
REMOTE_CODE_ENTRY = ("configuration.py", "modeling.py")
REMOTE_CONFIG_CLASS = "McoreRLQwen3Config"
REMOTE_MODEL_CLASS = "Qwen3ReferenceForCausalLM"
REMOTE_BASE_CLASS = "Qwen3ReferenceModel"
ASSETS_DIR = "hf_assets"
RECIPE_FILE = "recipe.yaml"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
# Copied along as assets: small files that are not weights, config or code (tokenizer, chat
# template, generation config, README, ...).
_NOT_ASSETS = re.compile(
    r"(.*\.(safetensors|bin|pt|pth|ckpt|gguf|h5|msgpack|onnx|py|pyc)|.*\.index\.json|config\.json)$"
)
_MAX_ASSET_BYTES = 100 * 1024**2
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "mcore_rl_tokenizer.json")
# Source-config fields that are not architecture but belong to the model (special token ids).
_CARRIED_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.")
_MC_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_MC_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.")


# ---------------------------------------------------------------------------------------------
# reading Hugging Face checkpoints
# ---------------------------------------------------------------------------------------------


class HFCheckpoint(Mapping[str, torch.Tensor]):
    """The tensors of a local safetensors checkpoint, read from disk when looked up.

    With `wanted`, a name it rejects comes back as a *meta* tensor of the right shape and dtype
    (nothing is read): `hf_to_megatron` can then build every megatron tensor, and a rank reads only
    the tensors its own layers and experts need.
    """

    def __init__(self, directory: str, wanted: Optional[Callable[[str], bool]] = None) -> None:
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
            from safetensors import safe_open

            with safe_open(single, "pt", device="cpu") as f:
                self._files = {name: single for name in f.keys()}
        else:
            found = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
            raise FileNotFoundError(
                f"{directory}: no model.safetensors or model.safetensors.index.json (found {found}); "
                "only safetensors checkpoints are read - re-save others with transformers' save_pretrained"
            )
        fused = [n for n in self._files if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]
        if fused:
            raise ValueError(
                f"{directory}: fused expert tensors ({fused[0]}, ...) are an in-memory transformers layout, "
                "not a checkpoint one; re-save with transformers' save_pretrained (per-expert names)"
            )
        self._handles: dict[str, Any] = {}

    def _handle(self, path: str) -> Any:
        if path not in self._handles:
            from safetensors import safe_open

            self._handles[path] = safe_open(path, "pt", device="cpu")
        return self._handles[path]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise KeyError(f"Hugging Face checkpoint {self.directory} has no tensor {name!r}")
        handle = self._handle(self._files[name])
        if self.wanted is not None and not self.wanted(name):
            piece = handle.get_slice(name)
            return torch.empty(piece.get_shape(), dtype=_SAFETENSORS_DTYPES[piece.get_dtype()], device="meta")
        return handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def dtype(self) -> torch.dtype:
        """The dtype of the (first) embedding tensor: what the checkpoint is stored in."""
        name = "model.embed_tokens.weight" if "model.embed_tokens.weight" in self._files else next(iter(self._files))
        return _SAFETENSORS_DTYPES[self._handle(self._files[name]).get_slice(name).get_dtype()]


def read_hf_config(directory: str) -> "PretrainedConfig":
    """The `transformers` config of a local checkpoint directory (supported model types only)."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{directory} is not a Hugging Face checkpoint directory (no config.json)")
    with open(path, encoding="utf-8") as f:
        model_type = json.load(f).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{path}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    import mcore_rl.hf  # noqa: F401  (registers mcore_rl_qwen3 with AutoConfig)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory, local_files_only=True)


def model_config_from_hf(hf: "PretrainedConfig") -> "ModelConfig":
    """`configuration.model_config_from_hf_config`, after rejecting what megatron-core here cannot
    express (every problem at once, each naming the `config.json` field)."""
    from mcore_rl.hf.configuration import model_config_from_hf_config, unsupported_stock_fields

    model_type = getattr(hf, "model_type", None)
    problems: list[str] = []
    if model_type not in SUPPORTED_MODEL_TYPES:
        problems.append(f"model_type={model_type!r}: supported are {', '.join(SUPPORTED_MODEL_TYPES)}")
    if getattr(hf, "attention_bias", False):
        problems.append("attention_bias=true: the megatron-core models here have no attention biases")
    problems += unsupported_stock_fields(hf)
    if problems:
        raise ValueError(f"cannot convert this {model_type} checkpoint:\n  " + "\n  ".join(problems))
    return model_config_from_hf_config(hf)


def model_config_from_dict(data: dict[str, Any]) -> "ModelConfig":
    """A `ModelConfig` from its plain dict (as checkpoints and recipes store it), type-checked."""
    from mcore_rl.config.loader import _build
    from mcore_rl.config.schema import ModelConfig

    return _build(ModelConfig, data, "model")


# ---------------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------------


def parallel_config(tp: int = 1, pp: int = 1, ep: int = 1, etp: Optional[int] = None) -> "ParallelConfig":
    """The layout to convert in (sequence parallelism on with TP: megatron-core's MoE needs it)."""
    from mcore_rl.config.schema import ParallelConfig

    return ParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, sequence_parallel=tp > 1,
    )


def default_world_size(pc: "ParallelConfig") -> int:
    """The fewest ranks that hold the layout: PP x lcm(TP, ETP x EP)."""
    tp, ep = pc.tensor_model_parallel_size, pc.expert_model_parallel_size
    etp = pc.expert_tensor_parallel_size or tp
    return pc.pipeline_model_parallel_size * math.lcm(tp, etp * ep)


def check_layout(mc: "ModelConfig", pc: "ParallelConfig", world_size: int) -> None:
    """Raise ValueError if the model cannot be built in this layout on `world_size` ranks.

    Runs the trainer's own validation (so every architecture's rules apply) on a minimal config.
    """
    from mcore_rl.config import ConfigError, SFTConfig, TrainConfig, validate_sft_config

    tp, pp = pc.tensor_model_parallel_size, pc.pipeline_model_parallel_size
    dp = world_size // (tp * pp) if tp * pp and world_size % (tp * pp) == 0 else 1
    cfg = SFTConfig(
        model=mc, parallel=pc,
        train=TrainConfig(seq_length=min(max(tp, 1), mc.max_position_embeddings), micro_batch_size=1,
                          global_batch_size=max(dp, 1)),
    )
    problems: list[str] = []
    try:
        validate_sft_config(cfg, world_size)
    except ConfigError as err:
        problems += [line.strip() for line in str(err).splitlines()[1:] if line.strip()]
    if tp >= 1 and mc.vocab_size % tp:
        problems.append(f"model.vocab_size: {mc.vocab_size} is not divisible by tensor_model_parallel_size {tp}")
    if problems:
        layout = (f"--tp {tp} --pp {pp} --ep {pc.expert_model_parallel_size}"
                  + (f" --etp {pc.expert_tensor_parallel_size}" if pc.expert_tensor_parallel_size else ""))
        raise ValueError(f"layout {layout} on {world_size} rank(s) does not fit this model:\n  " + "\n  ".join(problems))


def _build_chunks(mc: "ModelConfig", pc: "ParallelConfig", precision: str) -> list[torch.nn.Module]:
    from mcore_rl.models.builder import build_model, transformer_config

    # (Random init is wasted work here, but megatron-core 0.16 sets the tensor-parallel attributes
    # that `shard_for_rank` reads inside its init functions: perform_initialization=False drops them.)
    return build_model(mc, pc, precision, config=transformer_config(mc, pc, precision))


def _wanted_by(chunks: list[torch.nn.Module], mc: "ModelConfig") -> Callable[[str], bool]:
    """Which HF tensors this rank's chunks need (its layers, its experts, its end of the model)."""
    from mcore_rl.models.shards import iter_local_params

    layers: set[int] = set()
    experts: set[tuple[int, int]] = set()
    top: set[str] = set()
    for _, name, _ in iter_local_params(chunks):
        m = _MC_LAYER.match(name)
        if not m:
            top.add(name)
            continue
        layers.add(int(m.group(1)))
        e = _MC_EXPERT.match(m.group(2))
        if e:
            experts.add((int(m.group(1)), int(e.group(1))))
    need = {
        "model.embed_tokens.weight": "embedding.word_embeddings.weight" in top
        or (mc.tie_word_embeddings and "output_layer.weight" in top),
        "lm_head.weight": "output_layer.weight" in top,
        "model.norm.weight": "decoder.final_layernorm.weight" in top,
    }

    def wanted(name: str) -> bool:
        m = _LAYER.match(name)
        if not m:
            return need.get(name, True)  # other top-level tensors (new architectures): read them
        layer = int(m.group(1))
        if layer not in layers:
            return False
        e = _HF_EXPERT.match(m.group(2))
        return e is None or (layer, int(e.group(1))) in experts

    return wanted


# ---------------------------------------------------------------------------------------------
# HF -> megatron
# ---------------------------------------------------------------------------------------------


def hf_to_mcore(input_dir: str, output_dir: str, pc: "ParallelConfig", precision: str = "fp32") -> str:
    """Convert a local HF checkpoint to a model-only megatron dist-checkpoint (collective).

    Call on every rank of an initialised world (or a single process); returns the iteration dir.
    """
    import torch.distributed as dist

    from mcore_rl.config import config_to_dict
    from mcore_rl.hf.weight_map import hf_to_megatron
    from mcore_rl.models.shards import load_full_state_dict
    from mcore_rl.parallel import setup
    from mcore_rl.train import checkpoint

    hf_config = read_hf_config(input_dir)
    mc = model_config_from_hf(hf_config)
    target = checkpoint.checkpoint_dir(output_dir, 0)
    if os.path.exists(target):  # checked before joining the world: no rank can have written it yet
        raise FileExistsError(f"{target} already exists; choose an empty --output")
    _, world_size = setup.init_distributed()
    check_layout(mc, pc, world_size)
    setup.init_model_parallel(pc)
    setup.set_seed(0)  # megatron-core modules draw from the model-parallel RNG tracker at build
    chunks = _build_chunks(mc, pc, precision)
    source = HFCheckpoint(input_dir, wanted=_wanted_by(chunks, mc))
    load_full_state_dict(chunks, hf_to_megatron(source, mc))
    common = {
        "model": config_to_dict(mc),
        "hf_config": hf_config.to_dict(),
        "hf_dtype": str(source.dtype()).replace("torch.", ""),
        "hf_source": os.path.abspath(input_dir),
    }
    path = checkpoint.save_checkpoint(output_dir, 0, chunks, None, common)
    if dist.get_rank() == 0:
        assets = copy_assets(input_dir, os.path.join(output_dir, ASSETS_DIR))
        write_recipe(output_dir, mc, assets)
    dist.barrier()
    return path


def copy_assets(source_dir: str, target_dir: str) -> Optional[str]:
    """Copy the small non-weight, non-config, non-code files (tokenizer, ...); None if there are none."""
    names = [
        n for n in sorted(os.listdir(source_dir))
        if os.path.isfile(os.path.join(source_dir, n)) and not _NOT_ASSETS.match(n)
        and os.path.getsize(os.path.join(source_dir, n)) <= _MAX_ASSET_BYTES
    ]
    if not names:
        return None
    os.makedirs(target_dir, exist_ok=True)
    for name in names:
        shutil.copyfile(os.path.join(source_dir, name), os.path.join(target_dir, name))
    return target_dir


def write_recipe(output_dir: str, mc: "ModelConfig", assets_dir: Optional[str]) -> str:
    """`<output>/recipe.yaml`: model, checkpoint and tokenizer, for `mcore-rl sft` (or as `defaults`)."""
    import yaml

    from mcore_rl.config import config_to_dict

    recipe: dict[str, Any] = {"model": config_to_dict(mc), "checkpoint": {"load_dir": os.path.abspath(output_dir)}}
    if assets_dir and any(os.path.exists(os.path.join(assets_dir, f)) for f in _TOKENIZER_FILES):
        recipe["data"] = {"tokenizer_path": os.path.abspath(assets_dir)}
    path = os.path.abspath(os.path.join(output_dir, RECIPE_FILE))
    with open(path, "w", encoding="utf-8") as f:
        f.write("# Written by `mcore-rl convert hf-to-mcore`: train from the converted weights with\n"
                f"#   mcore-rl sft {path} [key=value ...]\n# or list this file under `defaults:` in a recipe.\n")
        yaml.safe_dump(recipe, f, sort_keys=False, default_flow_style=False)
    return path


# ---------------------------------------------------------------------------------------------
# megatron -> HF
# ---------------------------------------------------------------------------------------------


def export_kind(mc: "ModelConfig") -> str:
    """'qwen3' | 'qwen3_moe' | 'llama' (stock transformers classes) or 'remote' (our modeling code).

    Stock only when the stock config expresses the whole model: converting our HF config to the
    stock one and back must lose nothing, so any field a stock config lacks (today's LatentMoE,
    AttnRes and n-gram fields, or tomorrow's) selects the remote-code model.
    """
    from mcore_rl.hf.configuration import (
        hf_config_from_model_config,
        model_config_from_hf_config,
        to_stock_hf_config,
    )

    if mc.moe_latent_size or mc.attn_res != "none" or mc.ngram.orders:
        return REMOTE
    ours = hf_config_from_model_config(mc)
    try:
        stock = to_stock_hf_config(ours)
    except ValueError:
        return REMOTE
    back = hf_config_from_model_config(model_config_from_hf_config(stock))
    if back.to_dict() != ours.to_dict():
        return REMOTE
    return stock.model_type


def export_config(
    mc: "ModelConfig", dtype: torch.dtype, source: Optional[dict[str, Any]] = None
) -> tuple["PretrainedConfig", str]:
    """The HF config to write, and the export kind (see `export_kind`)."""
    from mcore_rl.hf.configuration import hf_config_from_model_config, to_stock_hf_config

    kind = export_kind(mc)
    ours = hf_config_from_model_config(mc)
    if kind == REMOTE:
        cfg = ours
        cfg.architectures = [REMOTE_MODEL_CLASS]
        cfg.auto_map = {
            "AutoConfig": f"configuration.{REMOTE_CONFIG_CLASS}",
            "AutoModel": f"modeling.{REMOTE_BASE_CLASS}",
            "AutoModelForCausalLM": f"modeling.{REMOTE_MODEL_CLASS}",
        }
    else:
        cfg = to_stock_hf_config(ours)
        cfg.architectures = [STOCK_CLASSES[kind]]
    for key in _CARRIED_FIELDS:
        if source and source.get(key) is not None:
            setattr(cfg, key, source[key])
    cfg.dtype = dtype
    return cfg, kind


def remote_code_files() -> list[str]:
    """The `mcore_rl/hf/*.py` files the remote-code model needs (relative imports, transitively).

    Raises if one of them imports anything but torch, transformers and the standard library where
    transformers' remote-code loader looks (it refuses to load a model whose files import a
    package that is not installed, so an export must not need mcore_rl).
    """
    from transformers.dynamic_module_utils import get_imports, get_relative_imports

    here = os.path.dirname(os.path.abspath(__file__))
    todo, seen = list(REMOTE_CODE_ENTRY), []
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.append(name)
        todo += [f"{module.replace('.', '/')}.py" for module in get_relative_imports(os.path.join(here, name))]
    allowed = set(sys.stdlib_module_names) | {"torch", "transformers", "__future__"}
    for name in seen:
        extra = sorted(set(get_imports(os.path.join(here, name))) - allowed)
        if extra:
            raise RuntimeError(
                f"mcore_rl/hf/{name} imports {extra} outside a try block; an exported remote-code model "
                "would then need those packages installed to load. Import them lazily inside a "
                "`try:` block (transformers' import check skips those), or not at all."
            )
    return [os.path.join(here, name) for name in seen]


def save_safetensors(
    tensors: dict[str, torch.Tensor], output_dir: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> list[str]:
    """`model.safetensors`, or `model-0000i-of-0000n.safetensors` + index when over `max_shard_bytes`."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors, key=_natural_key):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(output_dir, file), metadata={"format": "pt"})
        files.append(file)
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(output_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files + ["model.safetensors.index.json"]


def _natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def write_hf_checkpoint(
    hf_state: dict[str, torch.Tensor],
    mc: "ModelConfig",
    output_dir: str,
    dtype: torch.dtype = torch.float32,
    source_config: Optional[dict[str, Any]] = None,
    assets_dir: Optional[str] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> str:
    """Write config, weights (HF names), remote code if needed and assets; returns the export kind."""
    cfg, kind = export_config(mc, dtype, source_config)
    code = remote_code_files() if kind == REMOTE else []
    os.makedirs(output_dir, exist_ok=True)
    if assets_dir and os.path.isdir(assets_dir):
        copy_assets(assets_dir, output_dir)
    save_safetensors({k: v.to(dtype).contiguous() for k, v in hf_state.items()}, output_dir, max_shard_bytes)
    cfg.save_pretrained(output_dir)
    for path in code:
        shutil.copyfile(path, os.path.join(output_dir, os.path.basename(path)))
    return kind


def _stored_dtype(path: str, name: str = "embedding.word_embeddings.weight") -> Optional[torch.dtype]:
    """The dtype a megatron dist-checkpoint stores a tensor in (None if not found)."""
    from megatron.core import dist_checkpointing

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
    pc: Optional["ParallelConfig"] = None,
    model_config: Optional["ModelConfig"] = None,
    dtype: str = "auto",
    tokenizer_dir: Optional[str] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Optional[str]:
    """Export a megatron dist-checkpoint (a save dir or one `iter_*` dir) to HF (collective).

    `model_config` defaults to the one stored in the checkpoint. `dtype="auto"` keeps the source
    HF dtype of a converted checkpoint, else the dtype the weights are stored in. Rank 0 writes;
    returns the export kind there (None elsewhere).
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from mcore_rl.hf.weight_map import full_megatron_to_hf
    from mcore_rl.models.shards import gather_full_state_dict
    from mcore_rl.parallel import setup
    from mcore_rl.train import checkpoint

    path = checkpoint.latest_checkpoint(input_path)
    if path is None:
        raise FileNotFoundError(f"{input_path} holds no checkpoint (no 'latest' file, no metadata.json)")
    pc = pc or parallel_config()
    _, world_size = setup.init_distributed()
    common = dist_checkpointing.load_common_state_dict(path)["common"]
    mc = model_config or _model_config_of(common, path)
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
    chunks = _build_chunks(mc, pc, precision)
    checkpoint.load_checkpoint(path, chunks, None)
    hf_state = full_megatron_to_hf(gather_full_state_dict(chunks), mc)
    kind = None
    if dist.get_rank() == 0:
        save_dir = os.path.dirname(path) if os.path.exists(os.path.join(os.path.dirname(path), checkpoint.LATEST)) else path
        assets = tokenizer_dir or os.path.join(save_dir, ASSETS_DIR)
        kind = write_hf_checkpoint(hf_state, mc, output_dir, out_dtype, common.get("hf_config"), assets, max_shard_bytes)
    dist.barrier()
    return kind


def _model_config_of(common: dict[str, Any], path: str) -> "ModelConfig":
    if "model" not in common:
        raise ValueError(
            f"{path} does not record its model config (saved before configs were stored); "
            "pass the recipe it was trained with: --config RECIPE.yaml [model.key=value ...]"
        )
    return model_config_from_dict(common["model"])


# ---------------------------------------------------------------------------------------------
# the `mcore-rl convert` command (argument parsing lives in mcore_rl/cli.py)
# ---------------------------------------------------------------------------------------------


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"--max-shard-size {text!r}: expected e.g. 5GB, 500MB or a byte count")
    scale = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


def _model_config_from_args(args: Any) -> Optional["ModelConfig"]:
    if not getattr(args, "config", None) and not getattr(args, "overrides", None):
        return None
    from mcore_rl.config import SFTConfig, load_config

    return load_config(SFTConfig, args.config, list(args.overrides or [])).model


def plan(args: Any) -> tuple["ParallelConfig", int]:
    """Check what can be checked before any worker starts; returns (layout, world size).

    Raises FileNotFoundError / ValueError / ConfigError with a message for the user.
    """
    pc = parallel_config(args.tp, args.pp, args.ep, args.etp)
    for flag in ("tp", "pp", "ep"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    world = int(os.environ.get("WORLD_SIZE", args.nproc_per_node or default_world_size(pc)))
    if args.direction == "hf-to-mcore":
        mc = model_config_from_hf(read_hf_config(args.input))
        check_layout(mc, pc, world)
        HFCheckpoint(args.input)  # the weights are there and readable
        target = os.path.join(args.output, "iter_0000000")
        if os.path.exists(target):
            raise FileExistsError(f"{target} already exists; choose an empty --output")
    else:
        if not os.path.isdir(args.input):
            raise FileNotFoundError(f"--input {args.input} does not exist")
        if not (os.path.exists(os.path.join(args.input, "latest"))
                or os.path.exists(os.path.join(args.input, "metadata.json"))):
            raise FileNotFoundError(f"--input {args.input} holds no checkpoint (no 'latest' file, no metadata.json)")
        mc = _model_config_from_args(args)
        if mc is None and world > 1:  # check the layout before workers start (imports megatron)
            from megatron.core import dist_checkpointing

            from mcore_rl.train.checkpoint import latest_checkpoint

            path = latest_checkpoint(args.input)
            mc = _model_config_of(dist_checkpointing.load_common_state_dict(path)["common"], path)
        if mc is not None:
            check_layout(mc, pc, world)
        if args.tokenizer and not os.path.isdir(args.tokenizer):
            raise FileNotFoundError(f"--tokenizer {args.tokenizer} is not a directory")
        _parse_size(args.max_shard_size)
    return pc, world


def run(args: Any) -> int:
    """One rank's share of `mcore-rl convert` (a world of one outside torchrun)."""
    import warnings

    import torch.distributed as dist

    from mcore_rl.parallel import setup

    for message in (".*ShardedTensor.*", ".*`load_state_dict` is deprecated.*", ".*full scope is deprecated.*"):
        warnings.filterwarnings("ignore", message=message)
    pc = parallel_config(args.tp, args.pp, args.ep, args.etp)
    try:
        if args.direction == "hf-to-mcore":
            path = hf_to_mcore(args.input, args.output, pc, args.precision)
            if dist.get_rank() == 0:
                recipe = os.path.join(args.output, RECIPE_FILE)
                print(f"wrote megatron checkpoint {path} (model only, converted with TP={pc.tensor_model_parallel_size} "
                      f"PP={pc.pipeline_model_parallel_size} EP={pc.expert_model_parallel_size}; it loads in any layout)\n"
                      f"train from it: mcore-rl sft {recipe} [key=value ...]", flush=True)
        else:
            kind = mcore_to_hf(
                args.input, args.output, pc, _model_config_from_args(args), args.dtype, args.tokenizer,
                _parse_size(args.max_shard_size),
            )
            if dist.get_rank() == 0:
                if kind == REMOTE:
                    how = f"AutoModelForCausalLM.from_pretrained({args.output!r}, trust_remote_code=True)"
                    what = f"remote-code {REMOTE_MODEL_CLASS}"
                else:
                    how = f"AutoModelForCausalLM.from_pretrained({args.output!r})"
                    what = f"stock {STOCK_CLASSES[kind]}"
                print(f"wrote Hugging Face checkpoint {args.output} ({what}); load it with {how}", flush=True)
    finally:
        setup.destroy()
    return 0
