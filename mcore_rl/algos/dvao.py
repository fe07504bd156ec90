"""DVAO (Alibaba Cloud, date not given): variance-adaptive combination of several rewards' advantages.

With n reward heads per sample, summing the rewards before normalising (RC) lets one head's noise
swamp the others, and summing per-head z-scores (AC) gives a head with a tiny spread as much say as
an informative one. DVAO weighs each head's group advantage A_k by ŵ_k ∝ w_k σ_k (its initial
weight times its within-group population std), which simplifies to

    A = Σ_k w_k (r_k − μ_k) / Σ_l w_l σ_l,

bounded by the RC advantage: |A_DVAO| <= |A_sum| (equality when the heads are perfectly
positively correlated). A head constant in a group (σ_k = 0) gets weight 0 there; a group where
every head is constant gets advantage 0 (the summary leaves it open; GRPO does the same).
`beta` is the note author's extension ŵ_k ∝ w_k σ_k^β, not the paper's: β = 0 gives AC.

Heads come from the reward-head matrix: `weights` maps head names to w_k (default: equal weights
on every head of the batch); they are normalised to sum 1. A head a sample lacks (NaN) counts 0
for it; a group none of whose valid samples has any of the heads (a domain without them) uses its
scalar reward as its one head (= GRPO with the population std). Set `weights` to the domain's head
weights to make RC the domain's own reward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_rl.algos.advantages import kept, valid_mask
from mcore_rl.algos.multi_reward import group_index, group_moments, head_column, need
from mcore_rl.algos.registry import register


def dvao_combine(
    heads: torch.Tensor, weights: torch.Tensor, group_ids: torch.Tensor, ok: torch.Tensor, beta: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [N] float64, valid samples of each sample's group [N]) for a finite head matrix [N, n]
    and weights [n] (>= 0, summing to 1), over the `ok` samples of each group."""
    inverse, k = group_index(group_ids)
    num = torch.zeros(heads.shape[0], dtype=torch.float64)
    den = torch.zeros(k, dtype=torch.float64)
    count = torch.zeros(k, dtype=torch.float64).index_add_(0, inverse, ok.double())
    for j in range(heads.shape[1]):
        _, mu, var = group_moments(heads[:, j], inverse, k, ok)
        sigma = var.sqrt()
        share = weights[j] * sigma.pow(beta)  # 0^0 = 1: beta = 0 is AC, constant heads have A_k = 0
        a_k = torch.where(
            sigma[inverse] > 0, (heads[:, j].double() - mu[inverse]) / sigma[inverse].clamp_min(1e-300), torch.zeros(())
        )
        num = num + share[inverse] * a_k
        den = den + share
    adv = torch.where(den[inverse] > 0, num / den[inverse].clamp_min(1e-300), torch.zeros(()))
    return adv, count[inverse]


@register("advantage", "dvao")
def dvao(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    normalize_std: bool = True,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: torch.Tensor | None = None,
    head_names: Sequence[str] = (),
    weights: dict[str, float] | None = None,
    beta: float = 1.0,
) -> torch.Tensor:
    """DVAO advantages [N] over the heads named in `weights` (default: all of the batch's heads,
    equally). (`normalize_std`, `domain_ids`: part of the advantage signature only.)"""
    need(beta >= 0, "beta", f"must be >= 0, got {beta}")
    if weights is not None:
        need(
            isinstance(weights, dict) and len(weights) > 0,
            "weights",
            f"must map head names to weights (e.g. {{correct: 0.7, format: 0.3}}), got {weights!r}",
        )
        for name, w in weights.items():
            need(
                isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0,
                "weights",
                f"the weight of head {name!r} must be a number >= 0, got {w!r}",
            )
        need(sum(weights.values()) > 0, "weights", "must not all be 0")
    ok = valid_mask(rewards, group_ids, valid)
    n = rewards.shape[0]
    names = list(weights) if weights is not None else list(head_names)
    head_w = torch.tensor(
        [float(weights[h]) for h in names] if weights is not None else [1.0] * len(names), dtype=torch.float64
    )
    cols = [head_column(reward_heads, head_names, h, n) for h in names]
    mat = torch.stack(cols, 1) if cols else torch.zeros(n, 0, dtype=torch.float64)
    inverse, k = group_index(group_ids)
    present = (~mat.isnan()).any(1) & ok  # valid samples with at least one of the heads
    group_has = torch.zeros(k, dtype=torch.float64).index_add_(0, inverse, present.double()) > 0
    scalar = ~group_has[inverse]  # groups without any of the heads: the scalar reward alone
    with_heads, count = dvao_combine(
        torch.nan_to_num(mat, nan=0.0), head_w / head_w.sum() if names else head_w, group_ids, ok, beta
    )
    alone, _ = dvao_combine(rewards.double()[:, None], torch.ones(1, dtype=torch.float64), group_ids, ok, beta)
    return kept(torch.where(scalar, alone, with_heads), count, ok)
