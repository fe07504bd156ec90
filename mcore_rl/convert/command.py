"""The `mcore-rl convert` command: checks before any worker starts, and one rank's run.

Argument parsing and the torchrun relaunch live in mcore_rl/cli.py.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from mcore_rl.config import SFTConfig, load_config
from mcore_rl.convert.hf_checkpoint import HFCheckpoint, model_config_from_hf, read_hf_config
from mcore_rl.convert.layout import check_layout, default_world_size, parallel_config
from mcore_rl.convert.reward_model import (
    hf_reward_model_to_mcore,
    is_hf_reward_model,
    is_reward_model_checkpoint,
    mcore_reward_model_to_hf,
)
from mcore_rl.convert.to_hf import REMOTE, REMOTE_MODEL_CLASS, STOCK_CLASSES, mcore_to_hf, stored_model_config
from mcore_rl.convert.to_mcore import RECIPE_FILE, hf_to_mcore
from mcore_rl.hf.rope import rope_key_in_file
from mcore_rl.parallel import setup
from mcore_rl.train.checkpoint import latest_checkpoint

if TYPE_CHECKING:
    from mcore_rl.config.schema import ModelConfig, ParallelConfig


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"--max-shard-size {text!r}: expected e.g. 5GB, 500MB or a byte count")
    scale = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


def _model_config_from_args(args: Any) -> ModelConfig | None:
    if not getattr(args, "config", None) and not getattr(args, "overrides", None):
        return None

    return load_config(SFTConfig, args.config, list(args.overrides or [])).model


def plan(args: Any) -> tuple[ParallelConfig, int]:
    """Check what can be checked before any worker starts; returns (layout, world size).

    Raises FileNotFoundError / ValueError / ConfigError with a message for the user.
    """
    pc = parallel_config(args.tp, args.pp, args.ep, args.etp)
    for flag in ("tp", "pp", "ep"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    world = int(os.environ.get("WORLD_SIZE", args.nproc_per_node or default_world_size(pc)))
    mc: ModelConfig | None
    if args.direction == "hf-to-mcore":
        mc = model_config_from_hf(read_hf_config(args.input), rope_key_in_file(args.input))
        check_layout(mc, pc, world)
        HFCheckpoint(args.input)  # the weights are there and readable
        target = os.path.join(args.output, "iter_0000000")
        if os.path.exists(target):
            raise FileExistsError(f"{target} already exists; choose an empty --output")
    else:
        if not os.path.isdir(args.input):
            raise FileNotFoundError(f"--input {args.input} does not exist")
        if not (
            os.path.exists(os.path.join(args.input, "latest"))
            or os.path.exists(os.path.join(args.input, "metadata.json"))
        ):
            raise FileNotFoundError(f"--input {args.input} holds no checkpoint (no 'latest' file, no metadata.json)")
        mc = _model_config_from_args(args)
        if mc is None and world > 1:  # check the layout before workers start (imports megatron)
            from megatron.core import dist_checkpointing  # lazy: megatron

            path = latest_checkpoint(args.input)
            assert path is not None  # checked above: --input holds a checkpoint
            mc = stored_model_config(dist_checkpointing.load_common_state_dict(path)["common"], path)
        if mc is not None:
            check_layout(mc, pc, world)
        if args.tokenizer and not os.path.isdir(args.tokenizer):
            raise FileNotFoundError(f"--tokenizer {args.tokenizer} is not a directory")
        _parse_size(args.max_shard_size)
    return pc, world


def run(args: Any) -> int:
    """One rank's share of `mcore-rl convert` (a world of one outside torchrun)."""

    for message in (".*ShardedTensor.*", ".*`load_state_dict` is deprecated.*", ".*full scope is deprecated.*"):
        warnings.filterwarnings("ignore", message=message)
    pc = parallel_config(args.tp, args.pp, args.ep, args.etp)
    try:
        if args.direction == "hf-to-mcore" and is_hf_reward_model(args.input):
            path = hf_reward_model_to_mcore(args.input, args.output, pc, args.precision)
            if dist.get_rank() == 0:
                recipe = os.path.join(args.output, RECIPE_FILE)
                print(f"wrote reward-model checkpoint {path}; train it further: mcore-rl rm-train {recipe}", flush=True)
        elif args.direction == "mcore-to-hf" and is_reward_model_checkpoint(args.input):
            name = mcore_reward_model_to_hf(args.input, args.output, pc)
            if dist.get_rank() == 0:
                how = f"AutoModelForSequenceClassification.from_pretrained({args.output!r})"
                print(f"wrote Hugging Face checkpoint {args.output} (stock {name}); load it with {how}", flush=True)
        elif args.direction == "hf-to-mcore":
            path = hf_to_mcore(args.input, args.output, pc, args.precision)
            if dist.get_rank() == 0:
                recipe = os.path.join(args.output, RECIPE_FILE)
                print(
                    f"wrote megatron checkpoint {path} (model only, converted with TP={pc.tensor_model_parallel_size} "
                    f"PP={pc.pipeline_model_parallel_size} EP={pc.expert_model_parallel_size}; it loads in any layout)\n"
                    f"train from it: mcore-rl sft {recipe} [key=value ...]",
                    flush=True,
                )
        else:
            kind = mcore_to_hf(
                args.input,
                args.output,
                pc,
                _model_config_from_args(args),
                args.dtype,
                args.tokenizer,
                _parse_size(args.max_shard_size),
            )
            if dist.get_rank() == 0:
                assert kind is not None  # mcore_to_hf returns the export kind on rank 0
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
