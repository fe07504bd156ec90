"""Group-relative advantage estimators: GRPO (with/without std), Dr.GRPO, RLOO.

Each prompt is sampled G times; the samples of one prompt share a group id. The baseline is the
group's own reward statistics, so no value model is needed. Group ids can be any integers (not
necessarily contiguous or sorted) and groups may differ in size.

A group of one sample has no baseline to compare against: every estimator gives it advantage 0
(verl instead falls back to mean 0, std 1, i.e. the raw reward).
"""

from __future__ import annotations

import torch

from mcore_rl.algos.registry import register


def make_group_ids(num_groups: int, group_size: int) -> torch.Tensor:
    """[0]*G + [1]*G + …: ids for prompts laid out consecutively, G samples each."""
    return torch.arange(num_groups).repeat_interleave(group_size)


def group_stats(
    values: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group size, group mean, group unbiased variance), each [N]."""
    if values.shape != group_ids.shape or values.ndim != 1:
        raise ValueError(f"rewards {tuple(values.shape)} and group_ids {tuple(group_ids.shape)} must be equal 1-D")
    _, inverse = torch.unique(group_ids, return_inverse=True)
    k = int(inverse.max()) + 1 if inverse.numel() else 0
    v = values.double()
    count = torch.zeros(k, dtype=torch.float64, device=v.device).index_add_(0, inverse, torch.ones_like(v))
    total = torch.zeros_like(count).index_add_(0, inverse, v)
    mean = total / count
    dev = v - mean[inverse]
    sq = torch.zeros_like(count).index_add_(0, inverse, dev * dev)
    var = sq / (count - 1).clamp_min(1)
    return count[inverse], mean[inverse], var[inverse]


@register("advantage", "grpo")
def grpo(
    rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps), std with Bessel's correction (as verl and TRL).

    `normalize_std=False` gives the mean-only advantage (= Dr.GRPO's)."""
    count, mean, var = group_stats(rewards, group_ids)
    adv = rewards.double() - mean
    if normalize_std:
        adv = adv / (var.sqrt() + eps)
    return torch.where(count > 1, adv, torch.zeros_like(adv)).to(torch.float32)


@register("advantage", "dr_grpo")
def dr_grpo(rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = False) -> torch.Tensor:
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): A_i = r_i - mean_g, no std
    division (it up-weights groups that are almost all right or all wrong). Pair it with the
    `seq-mean-token-sum-norm` aggregation, its other half, which removes the 1/|y| length bias.
    `normalize_std` is part of the advantage signature only; Dr.GRPO never divides by the std."""
    return grpo(rewards, group_ids, normalize_std=False)


@register("advantage", "rloo")
def rloo(rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = False) -> torch.Tensor:
    """REINFORCE leave-one-out: A_i = r_i - mean_{j≠i} r_j = G/(G-1) (r_i - mean_g).
    (`normalize_std` is part of the advantage signature only; RLOO has no std division.)"""
    count, mean, _ = group_stats(rewards, group_ids)
    adv = (rewards.double() - mean) * count / (count - 1).clamp_min(1)
    return torch.where(count > 1, adv, torch.zeros_like(adv)).to(torch.float32)


def to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sequence advantages [N] onto response tokens [N, T] (zero off the mask)."""
    return advantages[:, None].to(torch.float32) * mask.to(torch.float32)
