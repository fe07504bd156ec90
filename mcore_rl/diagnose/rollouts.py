"""What the sampling analyses share: a policy (HF-format directory, as `mcore-rl serve` loads it), the
prompts and rewards of an `mcore-rl train` recipe, and G rollouts per prompt from the embedded engine,
scored by the recipe's reward(s) the way training scores them.

A run directory holds `metrics.jsonl` and megatron checkpoints (`checkpoint.save_dir`), but no
rollouts, and the embedded engine loads HF-format weights: a megatron checkpoint given as `--model`
is refused with the command that converts it (`mcore-rl convert mcore-to-hf`).
"""

from __future__ import annotations

import argparse
import copy
import os
from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.data.samples import Prompt, Sample
from mcore_rl.config import ConfigError, RLConfig, load_config, validate_rl_config
from mcore_rl.data.tokenizer import load_tokenizer
from mcore_rl.rollout.pool import EmbeddedEnginePool


def add_policy_arguments(parser: argparse.ArgumentParser, default_prompts: int = 16, default_group: int = 8) -> None:
    """--config/overrides (the task, its rewards, sampling), --model, and how many rollouts."""
    parser.add_argument(
        "--config",
        default="configs/demo.yaml",
        help="the `mcore-rl train` recipe whose task, rewards and sampling to use",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides of --config, e.g. rollout.max_new_tokens=8")
    parser.add_argument(
        "--model",
        default=None,
        help="HF-format model directory (config.json + *.safetensors; `mcore-rl convert mcore-to-hf` "
        "makes one from a checkpoint); default: the recipe's model, randomly initialised",
    )
    parser.add_argument("--prompts", type=int, default=default_prompts, help="prompts to sample")
    parser.add_argument("--group-size", type=int, default=default_group, help="rollouts per prompt (G)")
    parser.add_argument("--temperature", type=float, default=None, help="default: rollout.temperature")
    parser.add_argument(
        "--split",
        choices=["eval", "train"],
        default="eval",
        help="the held-out evaluation prompts, or the first prompts of the training stream",
    )


def _is_megatron_checkpoint(path: str) -> bool:
    if os.path.isfile(os.path.join(path, "metadata.json")) or os.path.isfile(os.path.join(path, "latest")):
        return True
    return os.path.isdir(path) and any(n.startswith("iter_") for n in os.listdir(path))


def check_model_dir(path: str) -> None:
    """A directory the embedded engine can load, or an error that says what to do instead."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--model {path!r} does not exist")
    if os.path.isfile(os.path.join(path, "config.json")):
        return
    if _is_megatron_checkpoint(path):
        raise ValueError(
            f"--model {path!r} is a megatron checkpoint, not an HF-format model; the analysis samples with the "
            f"embedded engine, which loads HF weights: convert it first with `mcore-rl convert mcore-to-hf --input "
            f"{path} --output DIR --config RECIPE` (the run's recipe; its latest checkpoint is converted) and pass "
            "--model DIR"
        )
    if os.path.isfile(os.path.join(path, "metrics.jsonl")):
        raise ValueError(
            f"--model {path!r} is a run directory (metrics.jsonl), which holds no model the embedded engine can "
            "load: the run's checkpoints are in its checkpoint.save_dir; convert one with `mcore-rl convert "
            "mcore-to-hf --input SAVE_DIR --output DIR --config RECIPE` and pass --model DIR"
        )
    raise ValueError(
        f"--model {path!r} has no config.json: expected an HF-format model directory (config.json + *.safetensors)"
    )


@dataclass
class Policy:
    cfg: RLConfig
    model: torch.nn.Module  # McoreRLForCausalLM, fp32, eval mode
    tokenizer: Any
    source: str  # what was loaded


def load_recipe(args: argparse.Namespace) -> tuple[Any, Any]:
    """The recipe (validated as `mcore-rl train` validates it) and its tokenizer."""

    try:
        cfg = load_config(RLConfig, args.config, list(args.overrides or []))
        validate_rl_config(cfg, 1)
    except ConfigError as err:  # the command reports ValueErrors as one line
        raise ValueError(f"{args.config}: {err}") from None
    return cfg, load_tokenizer(cfg.data.tokenizer_path)


def load_policy(args: argparse.Namespace) -> Policy:
    """The recipe and the model to analyse (`--model`, else the recipe's model, randomly initialised)."""
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config  # lazy: transformers

    cfg, tokenizer = load_recipe(args)
    model: torch.nn.Module
    if args.model is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.train.seed)
            model = McoreRLForCausalLM(hf_config_from_model_config(cfg.model))
        source = f"{args.config}: model, random initialisation (seed {cfg.train.seed})"
    else:
        from mcore_rl.rollout.engine.core import EngineCore  # lazy: transformers

        check_model_dir(args.model)
        engine = EngineCore.from_model_path(
            args.model, tokenizer_path=cfg.data.tokenizer_path, max_running_requests=1, context_length=8
        )
        model, tokenizer, source = engine.model, engine.tokenizer, args.model
    model = model.float().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return Policy(cfg, model, tokenizer, source)


def take_prompts(policy: Policy, n: int, split: str) -> list[Prompt]:
    from mcore_rl.agent.groups import environment_examples  # lazy: the engine stack
    from mcore_rl.data.prompts import build_prompt_sets  # lazy: numpy

    if n < 1:
        raise ValueError(f"--prompts must be >= 1, got {n}")
    sets = build_prompt_sets(policy.cfg, policy.tokenizer, environment_examples)
    return sets.eval_prompts[:n] if split == "eval" else sets.train.take(n)


def sample_groups(
    policy: Policy, prompts: list[Prompt], group_size: int, temperature: float | None = None
) -> list[list[Sample]]:
    """`group_size` rollouts of each prompt from an embedded engine holding a copy of the policy (full
    precision, whatever rollout.quantization says: the analysis measures the policy itself), seeded as
    training rollouts are, and scored by the recipe's reward heads (`Sample.reward`, `Sample.reward_heads`)."""
    from mcore_rl.rollout.engine.core import EngineCore  # lazy: transformers
    from mcore_rl.runtime.rollout_manager import SALT_TRAIN, RolloutManager, build_reward_runner  # lazy: numpy

    if group_size < 1:
        raise ValueError(f"--group-size must be >= 1, got {group_size}")
    cfg = policy.cfg
    longest = max(len(p.ids) for p in prompts) + cfg.rollout.max_new_tokens
    core = EngineCore(
        copy.deepcopy(policy.model),
        policy.tokenizer,
        max_running_requests=max(1, min(len(prompts) * group_size, cfg.rollout.max_running_requests)),
        context_length=max(longest, cfg.rollout.context_length),
        random_seed=cfg.train.seed,
        return_original_logprob=False,
    )
    rewards = build_reward_runner(cfg)
    manager = RolloutManager(EmbeddedEnginePool([core]), None, rewards, cfg)  # type: ignore[arg-type]  # the analysis passes its own prompts to each call; the manager's stream is never read
    t = cfg.rollout.temperature if temperature is None else temperature
    try:
        return manager.generate(prompts, group_size, t, SALT_TRAIN)
    finally:
        rewards.close()
