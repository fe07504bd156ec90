"""CRAFT — RLUF's optimiser ("Reinforcement Learning from User Feedback", arXiv:2505.14946),
"Calibrated-Regularized Reward Ranking Finetuning", read here as CGPO's CRRAFT ("The Perfect Blend:
Redefining RLHF with Mixture of Judges", arXiv:2409.20370; that they are one optimiser is our
reading): RAFT with the judges' constraints, the calibrated reward and a KL penalty. Iterative
best-of-N: each step samples N responses per prompt from the current policy, keeps the best by the
(combined, calibrated) reward, and fine-tunes on it, weighted by that reward, against a KL penalty
to the reference model.

Here the advantage "craft": per group (the N samples of one prompt), the `keep` valid samples with
the highest reward get A = their reward (`weighted`; else 1) and every other sample A = 0. Samples
whose reward is not above `min_reward` are never kept: with `cgpo_judges` (kind "reward_shaping",
before the advantage) a judge's violation is exactly 0 and a passing sample's calibrated reward
σ(r(s, a) − r(s, ā)) lies in (0, 1), so the default 0 keeps only feasible samples, and a group where
all fail trains nothing. Ties go to the first drawn. The pieces around it are the trainer's own:

* the combined reward: `rluf` (Σ_h w_h·v_h over the RMs a sample's domain has) or any reward;
* the constraint filter and calibration: `cgpo_judges` with `calibrate: true`;
* the fine-tuning: the policy loss "reinforce" (−A·log π per token): with A = R on the kept sample
  and 0 elsewhere, its gradient is the gradient of reward-weighted SFT on the best-of-N samples;
* the KL penalty: `algorithm.kl_coef` (the reference model's KL in the loss).

The summaries give no formula for CGPO's "KL truncation" nor the reference response ā; ā is
`cgpo_judges`' choice (a `reference_head`, else the group's mean reward).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_rl.algos.advantages import valid_mask
from mcore_rl.algos.multi_reward import group_index, need
from mcore_rl.algos.registry import register


def best_of_n(rewards: torch.Tensor, group_ids: torch.Tensor, ok: torch.Tensor, keep: int = 1) -> torch.Tensor:
    """[N] bool: in each group, the `keep` samples of `ok` with the highest reward (the first drawn
    on ties)."""
    inverse, k = group_index(group_ids)
    chosen = torch.zeros_like(ok)
    for g in range(k):
        idx = torch.nonzero((inverse == g) & ok).flatten()
        if idx.numel() == 0:
            continue
        # stable sort on −reward: equal rewards keep their drawing order
        order = torch.sort(-rewards[idx].double(), stable=True).indices
        chosen[idx[order[:keep]]] = True
    return chosen


@register("advantage", "craft")
def craft(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    normalize_std: bool = False,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: torch.Tensor | None = None,
    head_names: Sequence[str] = (),
    keep: int = 1,
    weighted: bool = True,
    min_reward: float = 0.0,
) -> torch.Tensor:
    """A [N] float32: the reward (`weighted`, else 1) on each group's `keep` best valid samples whose
    reward is above `min_reward`, 0 elsewhere. (`normalize_std`, `domain_ids`, `reward_heads`: part of
    the advantage signature only; CRAFT has no baseline.)"""
    need(isinstance(keep, int) and keep >= 1, "keep", f"must be an integer >= 1 (samples kept per group), got {keep!r}")
    ok = valid_mask(rewards, group_ids, valid) & ~rewards.isnan() & (rewards.double() > min_reward)
    chosen = best_of_n(rewards, group_ids, ok, keep)
    value = rewards.double() if weighted else torch.ones_like(rewards, dtype=torch.float64)
    return torch.where(chosen, value, torch.zeros_like(value)).to(torch.float32)
