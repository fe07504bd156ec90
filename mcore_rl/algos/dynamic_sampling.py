"""DAPO's dynamic sampling: groups whose rewards are all equal have zero group-relative advantage
and only dilute the batch, so drop them and sample more prompts until the batch is full.

The pure pieces: the selection on tensors and the one-group test the rollout scheduler filters
with (its refill rounds: `runtime/scheduler.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mcore_rl.algos.advantages import group_stats
from mcore_rl.algos.registry import register

# A group counts as constant when its reward std is at most this. Not 0: rewards that are equal as
# numbers need not be equal in floating point after shaping or averaging ([0.1, 0.1, 0.1] in float64
# has a std of 1.4e-17), and such a group carries no advantage signal either.
DEFAULT_STD_TOLERANCE = 1e-6


@register("group_filter", "nonzero_std")
def nonzero_std_groups(
    rewards: torch.Tensor, group_ids: torch.Tensor, tol: float = DEFAULT_STD_TOLERANCE
) -> torch.Tensor:
    """Keep mask [N]: True for samples whose group's reward std is > `tol` (singletons dropped)."""
    count, _, var = group_stats(rewards, group_ids)
    return (count > 1) & (var.sqrt() > tol)


def is_constant(rewards: Sequence[float], tol: float = DEFAULT_STD_TOLERANCE) -> bool:
    """Whether one group's rewards carry no group-relative signal: fewer than 2, or std <= `tol`."""
    return len(rewards) < 2 or _std(rewards) <= tol


def _std(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
