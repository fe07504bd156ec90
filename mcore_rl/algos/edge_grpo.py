"""EDGE-GRPO's EDA — "EDGE-GRPO: Entropy-Driven GRPO with Guided Error Correction for Advantage Diversity"
(Beihang, 2025).

GRPO gives every response of a group the same |A| for the same reward, whether it was written
confidently or by guessing. Entropy-Driven Advantage (EDA) divides each response's advantage by its
group-normalised mean token entropy:

    P_i = (1/|o_i|) Σ_t H_t,      P̂_i = P_i / mean_{j in group} P_j,      Â_i = A_i / P̂_i,

so confident (low-entropy) responses get larger magnitudes and uncertain ones smaller, with no sign
change. EDA is invariant to scaling all P_i by one constant and is the identity when all P_i are equal.
(The paper's other half, GEC — repairing wrong responses in the rollout — is not built here.)

Choices where the summary is unclear (docs/design.md#paper-methods):
* H_t is π_old's full-vocabulary entropy (the learner's, without a gradient; the paper writes π_θ):
  EDA only rescales the advantage, so no gradient should flow through it.
* The group mean runs over the group's valid samples with at least one response token.
* P̂ = 0 (a zero-entropy response in a group with entropy): the division would be infinite, so P̂
  is floored at 1 / `max_scale` (default 10: |Â| <= 10 |A|). The floor acts on P̂, so scale
  invariance and the group mean of the unfloored P̂ (= 1) are untouched.
* A group whose mean entropy is 0 (every response deterministic), a group with a single valid
  sample, and invalid samples get P̂ = 1: there is nothing to compare, Â = A.

Works on per-token advantages [N, T] (it composes with other advantage shaping): each response's
tokens are divided by its P̂. Registered as kind "advantage_shaping" (see `multi_reward.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_rl.algos.advantages import valid_mask
from mcore_rl.algos.multi_reward import group_index, group_moments, need
from mcore_rl.algos.registry import register


def response_entropy(entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """P_i: each response's mean token entropy over its mask [N] float64 (0 without tokens)."""
    m = mask.double()
    return (entropy.detach().double() * m).sum(-1) / m.sum(-1).clamp_min(1)


def scaled_entropy(p: torch.Tensor, group_ids: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """P̂_i = P_i / (the mean P of i's group over its `ok` samples) [N] float64; 1 where that mean
    is 0 and for samples that are not ok."""
    inverse, k = group_index(group_ids)
    _, mean, _ = group_moments(p, inverse, k, ok)
    g = mean[inverse]
    return torch.where(ok & (g > 0), p / torch.where(g > 0, g, torch.ones_like(g)), torch.ones_like(p))


@register("advantage_shaping", "edge_eda")
def edge_eda(
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
    max_scale: float = 10.0,
) -> torch.Tensor:
    """A / max(P̂, 1/max_scale) per response, on its tokens [N, T] (0 outside `mask`)."""
    need(max_scale >= 1, "max_scale", f"must be >= 1 (|Â| <= max_scale·|A|), got {max_scale}")
    if entropy is None or entropy.shape != advantages.shape:
        got = None if entropy is None else tuple(entropy.shape)
        raise ValueError(f"edge_eda needs the per-token entropy {tuple(advantages.shape)}, got {got}")
    if group_ids is None:
        raise ValueError("edge_eda needs the group ids: the entropy is normalised within each group")
    p = response_entropy(entropy, mask)
    ok = valid_mask(p, group_ids, valid) & (mask.sum(-1) > 0)
    scale = scaled_entropy(p, group_ids, ok).clamp_min(1.0 / max_scale)
    return (advantages.double() / scale[:, None]).to(advantages.dtype) * mask.to(advantages.dtype)
