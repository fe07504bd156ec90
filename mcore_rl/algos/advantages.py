"""Group-relative advantage estimators: GRPO (with/without std), Dr.GRPO, RLOO.

Each prompt is sampled G times; the samples of one prompt share a group id. The baseline is the
group's own reward statistics, so no value model is needed. Group ids can be any integers (not
necessarily contiguous or sorted) and groups may differ in size.

A group of one sample has no baseline to compare against: every estimator gives it advantage 0
(verl instead falls back to mean 0, std 1, i.e. the raw reward).

Every estimator takes an optional `valid` mask [N] (the learner passes the samples it trains on:
not aborted, no reward error). Invalid samples get advantage 0 and are left out of their group's
statistics, so a failed reward (scored `error_reward`) does not shift the baseline of the samples
that were scored. A group with fewer than 2 valid samples has no baseline: all its advantages are
0 (`too_few_valid_frac` says how many groups that was).

The kind's one signature is `fn(rewards, group_ids, *, normalize_std, valid, domain_ids=None,
reward_heads=None, head_names=(), **options)`: the multi-domain, multi-reward estimators
(`golongrl`, `dvao`, `papo`; see `multi_reward.py`) use the domain ids and the reward-head matrix,
the estimators here accept and ignore them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_rl.algos.registry import register

Heads = torch.Tensor | None


def make_group_ids(num_groups: int, group_size: int) -> torch.Tensor:
    """[0]*G + [1]*G + …: ids for prompts laid out consecutively, G samples each."""
    return torch.arange(num_groups).repeat_interleave(group_size)


def valid_mask(values: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    if values.shape != group_ids.shape or values.ndim != 1:
        raise ValueError(f"rewards {tuple(values.shape)} and group_ids {tuple(group_ids.shape)} must be equal 1-D")
    if valid is None:
        return torch.ones(values.shape, dtype=torch.bool, device=values.device)
    if valid.shape != values.shape:
        raise ValueError(f"valid {tuple(valid.shape)} must have the shape of rewards {tuple(values.shape)}")
    return valid.to(device=values.device, dtype=torch.bool)


def _valid_counts(group_ids: torch.Tensor, ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid samples per group [K], each sample's group index [N])."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    k = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(k, dtype=torch.float64, device=ok.device).index_add_(0, inverse, ok.double())
    return count, inverse


def group_stats(
    values: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (valid samples in the group, their mean, their unbiased variance), each [N];
    invalid samples count nowhere (a group without valid samples has mean 0)."""
    ok = valid_mask(values, group_ids, valid)
    count, inverse = _valid_counts(group_ids, ok)
    v = torch.where(ok, values.double(), torch.zeros((), dtype=torch.float64, device=values.device))
    total = torch.zeros_like(count).index_add_(0, inverse, v)
    mean = total / count.clamp_min(1)
    dev = (v - mean[inverse]) * ok.double()
    sq = torch.zeros_like(count).index_add_(0, inverse, dev * dev)
    var = sq / (count - 1).clamp_min(1)
    return count[inverse], mean[inverse], var[inverse]


def too_few_valid_frac(group_ids: torch.Tensor, valid: torch.Tensor | None = None) -> float:
    """The fraction of groups with fewer than 2 valid samples (every advantage of theirs is 0)."""
    count, _ = _valid_counts(group_ids, valid_mask(group_ids, group_ids, valid))
    return float((count < 2).double().mean()) if count.numel() else 0.0


def kept(adv: torch.Tensor, count: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """Advantage 0 for invalid samples and for groups with fewer than 2 valid ones."""
    return torch.where((count > 1) & ok, adv, torch.zeros_like(adv)).to(torch.float32)


@register("advantage", "grpo")
def grpo(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    normalize_std: bool = True,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: Heads = None,
    head_names: Sequence[str] = (),
    eps: float = 1e-6,
) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps), std with Bessel's correction (as verl and TRL).

    `normalize_std=False` gives the mean-only advantage (= Dr.GRPO's)."""
    count, mean, var = group_stats(rewards, group_ids, valid)
    adv = rewards.double() - mean
    if normalize_std:
        adv = adv / (var.sqrt() + eps)
    return kept(adv, count, valid_mask(rewards, group_ids, valid))


@register("advantage", "dr_grpo")
def dr_grpo(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    normalize_std: bool = False,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: Heads = None,
    head_names: Sequence[str] = (),
) -> torch.Tensor:
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): A_i = r_i - mean_g, no std
    division (it up-weights groups that are almost all right or all wrong). Pair it with the
    `seq-mean-token-sum-norm` aggregation, its other half, which removes the 1/|y| length bias.
    `normalize_std` is part of the advantage signature only; Dr.GRPO never divides by the std."""
    return grpo(rewards, group_ids, normalize_std=False, valid=valid)


@register("advantage", "rloo")
def rloo(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    normalize_std: bool = False,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: Heads = None,
    head_names: Sequence[str] = (),
) -> torch.Tensor:
    """REINFORCE leave-one-out: A_i = r_i - mean_{j≠i} r_j = G/(G-1) (r_i - mean_g), over the
    group's valid samples. (`normalize_std` is part of the advantage signature only; RLOO has no
    std division.)"""
    count, mean, _ = group_stats(rewards, group_ids, valid)
    adv = (rewards.double() - mean) * count / (count - 1).clamp_min(1)
    return kept(adv, count, valid_mask(rewards, group_ids, valid))


def to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sequence advantages [N] onto response tokens [N, T] (zero off the mask)."""
    return advantages[:, None].to(torch.float32) * mask.to(torch.float32)
