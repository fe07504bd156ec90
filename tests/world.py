"""Spawn a real gloo world of N CPU processes and run one function on every rank.

Importing megatron-core costs seconds per process, so a test should run many checks inside one
world rather than one world per check. An exception on any rank fails the calling test.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, store_path: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from mcore_rl.parallel import cpu_compat

    cpu_compat.apply()
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        if "megatron.core.parallel_state" in sys.modules:  # (a check that never imported megatron skips it)
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def run_world(world_size: int, fn: Callable[..., Any], *args: Any) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned gloo ranks; re-raise failures."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world_size, os.path.join(tmp, "store"), fn, args), nprocs=world_size, join=True)
