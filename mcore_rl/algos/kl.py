"""KL(π_θ || π_ref) estimators from samples of π_θ (Schulman, "Approximating KL divergence"),
used as a reward penalty or as a loss term.

With d = log π_ref(y) - log π_θ(y) and y ~ π_θ:
- k1 = -d                         unbiased, high variance, can be negative;
- k2 = d² / 2                     biased (its expectation is an f-divergence close to KL for
                                  nearby policies), low variance, ≥ 0;
- k3 = e^d - 1 - d                unbiased and ≥ 0 (the "low_var_kl" of verl / GRPO paper).
As a loss, ∇k1 = ∇log π_θ, ∇k2 = -d ∇log π_θ, ∇k3 = (1 - e^d) ∇log π_θ.
"""

from __future__ import annotations


import torch

from mcore_rl.algos.policy_loss import aggregate
from mcore_rl.algos.registry import get, register

LOG_RATIO_CLAMP = 20.0


@register("kl", "k1")
def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


@register("kl", "k2")
def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp).square()


@register("kl", "k3")
def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.expm1(d) - d


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimator `kind` ∈ {k1, k2, k3}."""
    return get("kl", kind)(logp, ref_logp)


def kl_penalized_rewards(
    rewards: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    kind: str = "k1",
) -> torch.Tensor:
    """KL as a reward penalty: r_i - β Σ_t kl_t over the response (per-sequence rewards [N]).

    No gradient flows (it shapes the reward before advantages are computed). k1 summed over the
    response is the sequence-level KL estimate log π_θ(y)/π_ref(y), the InstructGPT penalty."""
    with torch.no_grad():
        kl = kl_estimate(logp.detach(), ref_logp.detach(), kind) * mask.to(logp.dtype)
        return rewards - coef * kl.sum(-1).to(rewards.dtype)


def kl_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "k3",
    agg: str = "token-mean",
    norm_length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL as a loss term: (sum, count) of the per-token estimator under `agg` (see
    `policy_loss.aggregate`); multiply the sum by β and add it to the policy loss's sum."""
    return aggregate(kl_estimate(logp, ref_logp.detach(), kind), mask, agg, norm_length)
