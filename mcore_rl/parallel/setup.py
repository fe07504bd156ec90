"""Process groups: torch.distributed plus megatron-core's model-parallel state, from the config."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from mcore_rl.config.schema import ParallelConfig
from mcore_rl.parallel import cpu_compat, mcore_fixes


@dataclass(frozen=True)
class ParallelLayout:
    """Where this rank sits; `dp` is derived from the world size."""

    world_size: int
    rank: int
    tp: int
    pp: int
    vpp: int | None
    ep: int
    etp: int
    cp: int
    dp: int


def init_distributed(timeout_minutes: int = 30) -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment (single process if absent).

    gloo without CUDA, NCCL with it. Returns (rank, world_size).
    """
    cpu_compat.apply()
    mcore_fixes.apply()
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(minutes=timeout_minutes)
    if world_size == 1 and "MASTER_PORT" not in os.environ:
        # One process outside torchrun: an in-process store, no port. A port picked free and bound
        # later is a race: runs started together failed with EADDRINUSE.
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return 0, 1
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout)
    return rank, world_size


def init_model_parallel(cfg: ParallelConfig) -> ParallelLayout:
    """Create megatron-core's TP/PP/VPP/EP/ETP/CP/DP groups for `cfg` on the current world."""
    from megatron.core import parallel_state

    cpu_compat.apply()
    mcore_fixes.apply()
    world_size = dist.get_world_size()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_model_parallel_size,
        context_parallel_size=cfg.context_parallel_size,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,
        create_gloo_process_groups=False,
    )
    model_parallel = cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size * cfg.context_parallel_size
    return ParallelLayout(
        world_size=world_size,
        rank=dist.get_rank(),
        tp=cfg.tensor_model_parallel_size,
        pp=cfg.pipeline_model_parallel_size,
        vpp=cfg.virtual_pipeline_model_parallel_size,
        ep=cfg.expert_model_parallel_size,
        etp=cfg.expert_tensor_parallel_size or cfg.tensor_model_parallel_size,
        cp=cfg.context_parallel_size,
        dp=world_size // model_parallel,
    )


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch; then megatron-core's per-TP/EP RNG tracker.

    Call after `init_model_parallel`: tensor-parallel ranks need different streams for dropout
    inside TP regions and identical ones outside them.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if parallel_state.model_parallel_is_initialized():
        model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def destroy() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
