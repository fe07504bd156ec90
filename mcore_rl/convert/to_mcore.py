"""hf-to-mcore: a Hugging Face checkpoint -> a model-only megatron-core dist-checkpoint."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
import yaml

from mcore_rl.config import config_to_dict
from mcore_rl.convert.carried import carried_names, save_carried
from mcore_rl.convert.hf_checkpoint import ASSETS_DIR, HFCheckpoint, copy_assets, model_config_from_hf, read_hf_config
from mcore_rl.convert.layout import build_chunks, check_layout
from mcore_rl.convert.stream_import import stream_load
from mcore_rl.convert.streaming import StreamStats
from mcore_rl.data.tokenizer_match import has_tokenizer
from mcore_rl.hf.rope import rope_key_in_file
from mcore_rl.parallel import setup
from mcore_rl.train import checkpoint

if TYPE_CHECKING:
    from mcore_rl.config.schema import ModelConfig, ParallelConfig

RECIPE_FILE = "recipe.yaml"
CARRIED_SHARD_BYTES = 5 * 1024**3


def hf_to_mcore(
    input_dir: str,
    output_dir: str,
    pc: ParallelConfig,
    precision: str = "fp32",
    stats: StreamStats | None = None,
) -> str:
    """Convert a local HF checkpoint to a model-only megatron dist-checkpoint (collective).

    Call on every rank of an initialised world (or a single process); returns the iteration dir.
    Each rank streams in only the slices it owns (`stream_import`; `stats` gets its counters).
    """

    hf_config = read_hf_config(input_dir)
    mc = model_config_from_hf(hf_config, rope_key_in_file(input_dir))
    target = checkpoint.checkpoint_dir(output_dir, 0)
    if os.path.exists(target):  # checked before joining the world: no rank can have written it yet
        raise FileExistsError(f"{target} already exists; choose an empty --output")
    _, world_size = setup.init_distributed()
    check_layout(mc, pc, world_size)
    setup.init_model_parallel(pc)
    setup.set_seed(0)  # megatron-core modules draw from the model-parallel RNG tracker at build
    chunks = build_chunks(mc, pc, precision)
    source = HFCheckpoint(input_dir)
    stream_load(chunks, source, mc, stats)
    common = {
        "model": config_to_dict(mc),
        "hf_config": hf_config.to_dict(),
        "hf_dtype": str(source.dtype()).replace("torch.", ""),
        "hf_source": os.path.abspath(input_dir),
    }
    path = checkpoint.save_checkpoint(output_dir, 0, chunks, None, common)
    if dist.get_rank() == 0:
        assets = copy_assets(input_dir, os.path.join(output_dir, ASSETS_DIR))
        # layers past the model's (DeepSeek's MTP layers): kept for the export, not trained
        save_carried(source, carried_names(source, mc.num_layers), output_dir, CARRIED_SHARD_BYTES)
        write_recipe(output_dir, mc, assets)
    dist.barrier()
    return path


def write_recipe(output_dir: str, mc: ModelConfig, assets_dir: str | None) -> str:
    """`<output>/recipe.yaml`: model, checkpoint and tokenizer, for `mcore-rl sft` (or as `defaults`)."""

    recipe: dict[str, Any] = {"model": config_to_dict(mc), "checkpoint": {"load_dir": os.path.abspath(output_dir)}}
    if assets_dir and has_tokenizer(assets_dir):
        recipe["data"] = {"tokenizer_path": os.path.abspath(assets_dir)}
    path = os.path.abspath(os.path.join(output_dir, RECIPE_FILE))
    with open(path, "w", encoding="utf-8") as f:
        f.write(
            "# Written by `mcore-rl convert hf-to-mcore`: train from the converted weights with\n"
            f"#   mcore-rl sft {path} [key=value ...]\n# or list this file under `defaults:` in a recipe.\n"
        )
        yaml.safe_dump(recipe, f, sort_keys=False, default_flow_style=False)
    return path
