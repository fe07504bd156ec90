"""Entropy Adv. — "Reasoning with Exploration: An Entropy Perspective" (RUC & Microsoft & SJTU, AAAI 2026).

An entropy regulariser β·E[H_t] adds its own gradient β·∇H_t, which spikes the entropy. The paper
instead adds a *detached*, clipped entropy bonus to the advantage, so the policy-gradient direction
∇log π_θ is only re-weighted, never joined by a new one:

    ψ(H_t) = min(α · H_t.detach(), |A_t| / κ),     A_t^shaped = A_t + ψ(H_t).

The clip keeps the sign: for A_t < 0, A_t + ψ <= A_t (1 − 1/κ) < 0, and A_t = 0 stays 0. It turns a
per-response GRPO advantage into a per-token one (high-entropy "forking" tokens get more credit).

Choices where the summary is unclear (docs/design.md#paper-methods):
* H_t is π_old's full-vocabulary entropy (the learner computes it with π_old's log-probs, without
  a gradient; the summary leaves π_θ vs π_old open). The function detaches it anyway, so a caller that
  passes π_θ's entropy gets no entropy gradient either.
* κ is not given by the paper (only κ > 1): default κ = 2, i.e. the bonus is at most half of |A_t|.
* α = 0.4 is the paper's GRPO setting (0.1 with PPO); a tiny negative entropy (round-off) counts as 0.

Registered as kind "advantage_shaping" (see `multi_reward.py`); the learner logs the shaped
advantages' mean |A| (`advantage/shaped_abs_mean`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_rl.algos.multi_reward import need
from mcore_rl.algos.registry import register


def entropy_bonus(advantages: torch.Tensor, entropy: torch.Tensor, alpha: float, kappa: float) -> torch.Tensor:
    """ψ = min(α · H.detach(), |A| / κ) per token, >= 0 (no gradient through H)."""
    h = entropy.detach().clamp_min(0).to(advantages.dtype)
    return torch.minimum(alpha * h, advantages.abs() / kappa)


@register("advantage_shaping", "entropy_adv")
def entropy_adv(
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    rewards: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: torch.Tensor | None = None,
    head_names: Sequence[str] = (),
    entropy: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    alpha: float = 0.4,
    kappa: float = 2.0,
) -> torch.Tensor:
    """A_t + min(α·H_t, |A_t|/κ) on the response tokens [N, T] (0 outside `mask`)."""
    need(alpha >= 0, "alpha", f"must be >= 0, got {alpha}")
    need(kappa > 1, "kappa", f"must be > 1 (the clip |A|/κ keeps a negative advantage negative), got {kappa}")
    if entropy is None or entropy.shape != advantages.shape:
        got = None if entropy is None else tuple(entropy.shape)
        raise ValueError(f"entropy_adv needs the per-token entropy {tuple(advantages.shape)}, got {got}")
    return (advantages + entropy_bonus(advantages, entropy, alpha, kappa)) * mask.to(advantages.dtype)
