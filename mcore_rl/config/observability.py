"""The `logging:` section both `mcore-rl sft` and `mcore-rl train` share (observability): where the
metrics go, the device peak MFU is measured against, and the steps to profile.

Checked before any worker starts: Weights & Biases is an optional package (`pip install
'mcore-rl[wandb]'`), so `logging.wandb: true` without it fails here, naming the key.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # rules imports schema, which imports this module
    from mcore_rl.config.rules import Errors


@dataclass
class ObservabilityConfig:
    tensorboard: bool = False  # run_dir/tensorboard (metrics.jsonl is always written); RL turns it on
    wandb: bool = False  # Weights & Biases (optional extra `wandb`); files under run_dir/wandb
    wandb_project: str = "mcore-rl"  # Weights & Biases project
    wandb_name: str = ""  # "" = the run directory's name
    wandb_mode: Literal["offline", "online"] = "offline"  # offline needs no network (`wandb sync` later)
    # MFU's denominator, FLOP/s of one device at the training precision; 0 = a table by device kind
    # (CUDA), measured with a matmul on CPU (observe/throughput.py)
    peak_flops_per_device: float = 0.0
    profile_steps: list[int] = field(default_factory=list)  # torch.profiler trace of these optimizer steps
    memory_snapshot_steps: list[int] = field(default_factory=list)  # memory timeline (CPU) / snapshot (CUDA)


def check_observability(o: ObservabilityConfig, errors: Errors) -> None:
    errors.need(
        not o.wandb or importlib.util.find_spec("wandb") is not None,
        "logging.wandb",
        "is true but the `wandb` package is not installed: pip install 'mcore-rl[wandb]' (or set logging.wandb=false)",
    )
    errors.need(not o.wandb or bool(o.wandb_project), "logging.wandb_project", "must not be empty")
    errors.need(
        o.peak_flops_per_device >= 0,
        "logging.peak_flops_per_device",
        f"must be >= 0 (0 = by device kind), got {o.peak_flops_per_device}",
    )
    for key in ("profile_steps", "memory_snapshot_steps"):
        bad = [s for s in getattr(o, key) if not isinstance(s, int) or s < 1]
        errors.need(not bad, f"logging.{key}", f"optimizer steps count from 1; got {bad}")
