"""The policy the learner trains, built the same way for SFT and RL.

distributed init -> config validation (before any model exists) -> model-parallel groups -> seeds
-> tokenizer (its vocabulary must fit the model's) -> TransformerConfig -> model chunks in DDP ->
optimizer. Both `mcore-rl sft` and `mcore-rl train` call `build_policy`; RL adds a frozen
reference model with `build_reference_model`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

import torch

from mcore_rl.config import DerivedSizes, RLConfig, SFTConfig
from mcore_rl.data.tokenizer import Tokenizer, load_tokenizer
from mcore_rl.observe import ttfs


@dataclass
class Policy:
    """What one rank holds of the model being trained."""

    chunks: list[torch.nn.Module]  # DDP-wrapped megatron-core model chunks (one per virtual stage)
    optimizer: Any
    tokenizer: Tokenizer
    world_size: int
    sizes: DerivedSizes


def build_policy(
    cfg: SFTConfig | RLConfig,
    validate: Callable[[Any, int], DerivedSizes],
    total_iters: int,
    adapt: Callable[[list[torch.nn.Module]], None] | None = None,
) -> Policy:
    """The policy of a config with `model`, `parallel`, `optimizer`, `train` (seed, precision,
    recompute) and `data.tokenizer_path` sections; `validate(cfg, world_size)` raises on a bad config
    before anything else is built. `total_iters` sizes the LR schedule. `adapt(chunks)` changes the
    bare chunks before DDP and the optimizer see them (a reward model's value head)."""
    from mcore_rl.models.builder import build_model, transformer_config  # lazy: megatron
    from mcore_rl.parallel import setup  # lazy: numpy
    from mcore_rl.train.forward_backward import prepare_config, wrap_ddp  # lazy: megatron
    from mcore_rl.train.optimizer import build_optimizer  # lazy: numpy

    ttfs.mark("imports")  # megatron-core comes in with the builder
    _, world_size = setup.init_distributed()
    sizes = validate(cfg, world_size)
    setup.init_model_parallel(cfg.parallel)
    ttfs.mark("distributed_init")
    setup.set_seed(cfg.train.seed)
    tokenizer = load_tokenizer(cfg.data.tokenizer_path)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size} tokens, data.tokenizer_path={cfg.data.tokenizer_path!r})"
        )
    t = cfg.train
    config = transformer_config(cfg.model, cfg.parallel, t.precision, t.recompute)
    bare = build_model(cfg.model, cfg.parallel, config=config)
    if adapt is not None:
        adapt(list(bare))
    chunks = wrap_ddp(list(bare), config)
    prepare_config(config, chunks)
    optimizer = build_optimizer(chunks, cfg.optimizer, t.precision, total_iters)
    ttfs.mark("model_build")
    return Policy(chunks, optimizer, tokenizer, world_size, sizes)


def build_reference_model(cfg: RLConfig) -> list[torch.nn.Module]:
    """Frozen, unwrapped model chunks of the policy's architecture and layout (π_ref for the KL
    term, or a teacher): forward only, no recomputation, per-token loss scaling like the policy."""
    from mcore_rl.models.builder import build_model, transformer_config  # lazy: megatron

    config = transformer_config(cfg.model, cfg.parallel, cfg.train.precision, "none")
    config.calculate_per_token_loss = True
    chunks = build_model(cfg.model, cfg.parallel, config=config)
    for c in chunks:
        for p in c.parameters():
            p.requires_grad_(False)
    return chunks


@torch.no_grad()
def copy_weights(dst: list[torch.nn.Module], src: list[torch.nn.Module]) -> None:
    """Copy the (possibly DDP-wrapped) `src` chunks' parameters into `dst`, same layout."""
    from mcore_rl.models.shards import unwrap_model  # lazy: transformers

    for d, s in zip(dst, src):
        for (n1, p1), (n2, p2) in zip(d.named_parameters(), unwrap_model(s).named_parameters()):
            assert n1 == n2, (n1, n2)
            p1.copy_(p2)
