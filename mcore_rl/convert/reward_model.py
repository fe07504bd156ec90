"""Reward models between Hugging Face and megatron-core: the stock `*ForSequenceClassification`
classes (Llama, Qwen2, Qwen3, Mistral, ... : `model.*` decoder weights and a bias-free `score`
linear layer, one row per label) <-> an `mcore-rl rm-train` checkpoint (the same decoder with the
value head of `models/value_head.py`, `num_heads` = `num_labels`).

The decoder's weights go through the causal LM's name map (`hf.weight_map`); `score.weight` is the
head. The source's `config.json` is carried in the checkpoint (as `mcore-rl convert hf-to-mcore`
carries it) and written back as it was, so HF -> megatron -> HF reproduces every tensor bit for bit
and the same config; a reward model trained from scratch gets the stock config of its decoder with
the sequence-classification class, `num_labels` and the tokenizer's special ids (the HF class pools
at the last token that is not `pad_token_id`).

Both directions load the whole model on each rank (`models/shards.py`), unlike the streaming
converter of causal LMs: fine for the reward models of this package's tests and demos, not for a
70B one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
import torch.distributed as dist
import yaml

from mcore_rl.config import config_to_dict
from mcore_rl.config.schema import ModelConfig, ParallelConfig
from mcore_rl.convert.hf_checkpoint import ASSETS_DIR, HFCheckpoint, copy_assets, model_config_from_hf, read_hf_config
from mcore_rl.convert.layout import build_chunks, check_layout, parallel_config
from mcore_rl.convert.to_hf import export_config, save_safetensors, stored_model_config
from mcore_rl.hf.rope import rope_key_in_file
from mcore_rl.hf.weight_map import hf_to_megatron, megatron_to_hf
from mcore_rl.parallel import setup
from mcore_rl.train import checkpoint
from mcore_rl.train.hf_provenance import checkpoint_save_dir

HF_HEAD = "score.weight"
MEGATRON_HEAD = "output_layer.weight"  # models/value_head.py: HEAD_PARAM (not imported: megatron at import)
SEQUENCE_CLASSIFICATION = "ForSequenceClassification"
RECIPE_FILE = "recipe.yaml"


def is_hf_reward_model(directory: str) -> bool:
    """Whether the HF checkpoint in `directory` is a sequence classifier (its config's architectures)."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        architectures = json.load(f).get("architectures") or []
    return any(str(a).endswith(SEQUENCE_CLASSIFICATION) for a in architectures)


def is_reward_model_checkpoint(input_path: str) -> bool:
    """Whether the megatron checkpoint at `input_path` was written by `mcore-rl rm-train` or this converter."""
    from megatron.core import dist_checkpointing  # lazy: megatron

    path = checkpoint.latest_checkpoint(input_path)
    return path is not None and "reward_model" in dist_checkpointing.load_common_state_dict(path)["common"]


def _decoder(mc: ModelConfig) -> ModelConfig:
    """The config whose weight map covers the decoder alone (tied: no `lm_head` / `output_layer`)."""
    return dataclasses.replace(mc, tie_word_embeddings=True)


def _build_reward_chunks(mc: ModelConfig, pc: ParallelConfig, precision: str, num_heads: int) -> list[torch.nn.Module]:
    from mcore_rl.models.value_head import install_value_head  # lazy: megatron

    setup.init_model_parallel(pc)
    setup.set_seed(0)  # megatron-core modules draw from the model-parallel RNG tracker at build
    chunks = build_chunks(mc, pc, precision)
    for chunk in chunks:
        install_value_head(chunk, num_heads, seed=0)
    return chunks


def hf_reward_model_to_mcore(input_dir: str, output_dir: str, pc: ParallelConfig, precision: str = "fp32") -> str:
    """A stock HF sequence classifier -> a model-only reward-model checkpoint (collective); its path."""
    from mcore_rl.models.shards import load_full_state_dict  # lazy: megatron

    hf_config = read_hf_config(input_dir)
    architectures = getattr(hf_config, "architectures", None) or []
    if not any(a.endswith(SEQUENCE_CLASSIFICATION) for a in architectures):
        raise ValueError(
            f"{input_dir}/config.json: architectures {architectures} name no *{SEQUENCE_CLASSIFICATION} class; "
            "a causal LM converts with `mcore-rl convert hf-to-mcore`"
        )
    mc = dataclasses.replace(model_config_from_hf(hf_config, rope_key_in_file(input_dir)), tie_word_embeddings=False)
    num_heads = int(hf_config.num_labels or 1)
    target = checkpoint.checkpoint_dir(output_dir, 0)
    if os.path.exists(target):
        raise FileExistsError(f"{target} already exists; choose an empty --output")
    _, world_size = setup.init_distributed()
    check_layout(mc, pc, world_size)
    chunks = _build_reward_chunks(mc, pc, precision, num_heads)
    source = HFCheckpoint(input_dir)
    hf = {name: source[name] for name in source}
    full = hf_to_megatron(hf, _decoder(mc))
    full[MEGATRON_HEAD] = hf[HF_HEAD]
    load_full_state_dict(chunks, full)
    common = {
        "model": config_to_dict(mc),
        "reward_model": {"num_heads": num_heads},
        "hf_config": hf_config.to_dict(),
        "hf_dtype": str(source.dtype()).replace("torch.", ""),
        "hf_source": os.path.abspath(input_dir),
    }
    path = checkpoint.save_checkpoint(output_dir, 0, chunks, None, common)
    if dist.get_rank() == 0:
        assets = copy_assets(input_dir, os.path.join(output_dir, ASSETS_DIR))
        _write_recipe(output_dir, mc, num_heads, assets)
    dist.barrier()
    return path


def _write_recipe(output_dir: str, mc: ModelConfig, num_heads: int, assets_dir: str | None) -> None:
    recipe: dict[str, Any] = {
        "model": config_to_dict(mc),
        "checkpoint": {"load_dir": os.path.abspath(output_dir)},
        "reward_model": {"num_heads": num_heads},
    }
    if assets_dir:
        recipe["data"] = {"tokenizer_path": os.path.abspath(assets_dir)}
    path = os.path.join(output_dir, RECIPE_FILE)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"# Written by the reward-model converter: go on training with\n#   mcore-rl rm-train {path}\n")
        yaml.safe_dump(recipe, f, sort_keys=False, default_flow_style=False)


def mcore_reward_model_to_hf(input_path: str, output_dir: str, pc: ParallelConfig | None = None) -> str | None:
    """A reward-model checkpoint (a save dir or an `iter_*` dir) -> a stock HF sequence classifier
    (collective; global rank 0 writes). Returns the class name there, None elsewhere."""
    from megatron.core import dist_checkpointing  # lazy: megatron

    from mcore_rl.models.shards import gather_full_state_dict  # lazy: megatron

    path = checkpoint.latest_checkpoint(input_path)
    if path is None:
        raise FileNotFoundError(f"{input_path} holds no checkpoint (no 'latest' file, no metadata.json)")
    pc = pc or parallel_config()
    _, world_size = setup.init_distributed()
    common = dist_checkpointing.load_common_state_dict(path)["common"]
    if "reward_model" not in common:
        raise ValueError(f"{path} is not a reward-model checkpoint (no 'reward_model' in its common state)")
    mc = stored_model_config(common, path)
    num_heads = int(common["reward_model"]["num_heads"])
    check_layout(mc, pc, world_size)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(common.get("hf_dtype", ""), torch.float32)
    chunks = _build_reward_chunks(mc, pc, "bf16" if dtype == torch.bfloat16 else "fp32", num_heads)
    checkpoint.load_checkpoint(path, chunks, None)
    full = gather_full_state_dict(chunks)
    if dist.get_rank() != 0:
        dist.barrier()
        return None
    tensors: dict[str, torch.Tensor] = {HF_HEAD: full.pop(MEGATRON_HEAD)}
    for name, tensor in full.items():
        tensors.update(megatron_to_hf(name, tensor, _decoder(mc)))
    config = _hf_config(mc, dtype, num_heads, common)
    os.makedirs(output_dir, exist_ok=True)
    assets = os.path.join(checkpoint_save_dir(path), ASSETS_DIR)
    if os.path.isdir(assets):
        copy_assets(assets, output_dir)
    config.save_pretrained(output_dir)
    save_safetensors({k: v.to(dtype).contiguous() for k, v in tensors.items()}, output_dir)
    dist.barrier()
    return str((config.architectures or [""])[0])


def _hf_config(mc: ModelConfig, dtype: torch.dtype, num_heads: int, common: dict[str, Any]) -> Any:
    """The source's config as it was, or the stock config of the decoder as a sequence classifier."""
    source = common.get("hf_config")
    cfg, kind = export_config(_decoder(mc), dtype, source)
    if source and any(str(a).endswith(SEQUENCE_CLASSIFICATION) for a in source.get("architectures") or []):
        return type(cfg).from_dict(source)
    stock = str((cfg.architectures or [""])[0])
    if kind == "remote" or not stock.endswith("ForCausalLM"):
        raise ValueError(f"no stock sequence-classification class for this model (it exports as {stock})")
    cfg.architectures = [stock.removesuffix("ForCausalLM") + SEQUENCE_CLASSIFICATION]
    cfg.num_labels = num_heads
    cfg.tie_word_embeddings = False
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if key in common.get("special_tokens", {}):
            setattr(cfg, key, common["special_tokens"][key])
    return cfg
