"""The TP/PP/EP layout a conversion runs in, checked against the model, and the model built in it."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from mcore_rl.config import ConfigError, SFTConfig, TrainConfig, validate_sft_config
from mcore_rl.config.schema import ParallelConfig

if TYPE_CHECKING:
    from mcore_rl.config.schema import ModelConfig


def parallel_config(tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None) -> ParallelConfig:
    """The layout to convert in (sequence parallelism on with TP: megatron-core's MoE needs it)."""

    return ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1,
    )


def default_world_size(pc: ParallelConfig) -> int:
    """The fewest ranks that hold the layout: PP x lcm(TP, ETP x EP)."""
    tp, ep = pc.tensor_model_parallel_size, pc.expert_model_parallel_size
    etp = pc.expert_tensor_parallel_size or tp
    return pc.pipeline_model_parallel_size * math.lcm(tp, etp * ep)


def check_layout(mc: ModelConfig, pc: ParallelConfig, world_size: int) -> None:
    """Raise ValueError if the model cannot be built in this layout on `world_size` ranks.

    Runs the trainer's own validation (so every architecture's rules apply) on a minimal config.
    """

    tp, pp = pc.tensor_model_parallel_size, pc.pipeline_model_parallel_size
    dp = world_size // (tp * pp) if tp * pp and world_size % (tp * pp) == 0 else 1
    cfg = SFTConfig(
        model=mc,
        parallel=pc,
        train=TrainConfig(
            seq_length=min(max(tp, 1), mc.max_position_embeddings), micro_batch_size=1, global_batch_size=max(dp, 1)
        ),
    )
    problems: list[str] = []
    try:
        validate_sft_config(cfg, world_size)
    except ConfigError as err:
        problems += [line.strip() for line in str(err).splitlines()[1:] if line.strip()]
    if problems:
        layout = f"--tp {tp} --pp {pp} --ep {pc.expert_model_parallel_size}" + (
            f" --etp {pc.expert_tensor_parallel_size}" if pc.expert_tensor_parallel_size else ""
        )
        raise ValueError(
            f"layout {layout} on {world_size} rank(s) does not fit this model:\n  " + "\n  ".join(problems)
        )


def build_chunks(mc: ModelConfig, pc: ParallelConfig, precision: str) -> list[torch.nn.Module]:
    """This rank's model chunks in layout `pc` (the model-parallel groups must be set up)."""
    from mcore_rl.models.builder import build_model, transformer_config  # lazy: megatron

    # (Random init is wasted work here, but megatron-core 0.16 sets the tensor-parallel attributes
    # that `shard_for_rank` reads inside its init functions: perform_initialization=False drops them.)
    return build_model(mc, pc, precision, config=transformer_config(mc, pc, precision))
