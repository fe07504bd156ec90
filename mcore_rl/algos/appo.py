"""APPO: "APPO: Agentic Procedural Policy Optimization" (USTC & Alibaba, 2026).

Tree rollouts: N root rollouts per prompt; every token of a root gets a branching score, the
z-scored (within its rollout) clipped future ratio Ω times the z-scored token entropy; the top-B
tokens of each root are branch points, and the current policy continues from each one's prefix with
what is left of the prompt's budget of M rollouts. This module holds the pure parts:

* `future_log_ratio`: G_i = Σ_{i'≥i} γ^{i'−i} log ρ_{i'} by the backward recursion
  G_i = log ρ_i + γ G_{i+1} (the paper writes γ^{i'−1} for Ω; γ^{i'−i}, as for Â^ftu, is taken);
* `branching_scores` and `branch_points` (top-B per rollout), `allot_branches` (the M − N branches
  over the points);
* the dual-group advantage (`appo`, kind "advantage"): GRPO within the init set and within the branch
  set of each prompt separately (its optional input `branches` says which samples are branches);
* the (1 + b·Â^ftu) scaling of the advantage in the PPO loss (`appo_loss`, kind "policy_loss"):
  Â^ftu = clip(exp(G_i), 1 − ε', 1 + ε') with ρ = π_θ/π_old, so it is 1 on the first update of a
  batch (π_θ = π_old) and moves only on later minibatches or epochs. It is a weight, not a path
  for the gradient (detached), and positive, so it never flips an advantage's sign.

Choices where the paper is open (docs/step_credit.md, "APPO"): a factor of the score that is
constant over a rollout (Ω when π_θ = π_old, as when the branches are drawn right after the roots)
ranks nothing and is left out of the product (the score is then the other factor's z-score);
branches train like roots (each with its own group's advantage).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_rl.algos.advantages import grpo
from mcore_rl.algos.multi_reward import need
from mcore_rl.algos.policy_loss import LOG_RATIO_CLAMP, LossOutput, ppo_clip
from mcore_rl.algos.registry import register


def future_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """[N, T] float64: G_i = log ρ_i + γ·G_{i+1}, G_{T+1} = 0, over the masked tokens (a token off
    the mask contributes log ρ = 0 and passes its successor's G on, discounted)."""
    lr = log_ratio.double() * mask.double()
    out = torch.zeros_like(lr)
    following = torch.zeros_like(lr[:, 0])
    for i in range(lr.shape[1] - 1, -1, -1):
        following = lr[:, i] + gamma * following
        out[:, i] = following
    return out


def future_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, gamma: float, clip: float) -> torch.Tensor:
    """[N, T] float64: clip(exp(G_i), 1 − ε', 1 + ε') — Ω clipped, which is also Â^ftu."""
    g = future_log_ratio(log_ratio, mask, gamma).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return g.exp().clamp(1.0 - clip, 1.0 + clip)


def zscore_rows(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(z-score of each row over its masked entries, [N, T] float64, 0 off the mask; whether the row
    varies [N] bool — a row with fewer than 2 entries or a constant one has z ≡ 0)."""
    m = mask.double()
    x = values.double()
    count = m.sum(1, keepdim=True)
    mean = (x * m).sum(1, keepdim=True) / count.clamp_min(1)
    var = (((x - mean) * m) ** 2).sum(1, keepdim=True) / count.clamp_min(1)
    std = var.sqrt()
    varies = (count[:, 0] > 1) & (std[:, 0] > 1e-12 * (1.0 + mean[:, 0].abs()))
    z = torch.where(varies[:, None], (x - mean) / std.clamp_min(1e-300), torch.zeros_like(x))
    return z * m, varies


def branching_scores(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    entropy: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    clip: float = 0.2,
) -> torch.Tensor:
    """[N, T] float64: BS_i = Z(clip(Ω_i)) · Z(H_i), each z-score within its rollout (row) over the
    masked tokens; a factor constant over a row is left out (1) there (module docstring)."""
    check_options(gamma, clip)
    z_omega, omega_varies = zscore_rows(future_ratio(logp - old_logp, mask, gamma, clip), mask)
    z_h, h_varies = zscore_rows(entropy, mask)
    one = mask.double()
    return torch.where(omega_varies[:, None], z_omega, one) * torch.where(h_varies[:, None], z_h, one)


def branch_points(scores: torch.Tensor, mask: torch.Tensor, b: int) -> torch.Tensor:
    """[N, B] long: each row's B masked positions of highest score, best first (ties: the earlier
    position); -1 where a row has fewer than B masked positions."""
    need(b >= 1, "branch_points", f"must be >= 1, got {b}")
    n, t = scores.shape
    pos = torch.arange(t, dtype=torch.float64)
    # ties go to the earlier position: subtract a tiny multiple of the position before ranking
    key = torch.where(mask.bool(), scores.double() - 1e-9 * pos / max(t, 1), torch.full_like(pos, -torch.inf))
    k = min(b, t)
    vals, idx = key.topk(k, dim=1) if t else (torch.empty(n, 0), torch.empty(n, 0, dtype=torch.long))
    idx = torch.where(torch.isfinite(vals), idx, torch.full_like(idx, -1))
    if k < b:
        idx = torch.cat([idx, torch.full((n, b - k), -1, dtype=torch.long)], dim=1)
    return idx


def allot_branches(points: torch.Tensor, budget: int) -> list[tuple[int, int]]:
    """The `budget` (M − N) branches over the branch points `points` [N, B] (-1: none): (root,
    position) pairs, dealt round-robin in rank order (every root's best point, then every root's
    second best, ...), so each point gets ⌊budget / #points⌋ or one more. Empty if no point."""
    rows, ranks = points.shape
    order = [(n, int(points[n, r])) for r in range(ranks) for n in range(rows) if int(points[n, r]) >= 0]
    if not order:
        return []
    return [order[j % len(order)] for j in range(budget)]


def check_options(gamma: float, clip: float) -> None:
    need(0.0 < gamma <= 1.0, "gamma", f"must be in (0, 1], got {gamma}")
    need(0.0 < clip < 1.0, "clip", f"must be in (0, 1), got {clip}")


@register("advantage", "appo")
def appo(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    normalize_std: bool = True,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: torch.Tensor | None = None,
    head_names: Sequence[str] = (),
    branches: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """APPO's dual-group advantage Â^base, [N] float32: GRPO within each group's init set and,
    separately, within its branch set (`branches` [N] bool; None: no branches, plain GRPO)."""
    if branches is None:
        branches = torch.zeros_like(group_ids, dtype=torch.bool)
    need(branches.shape == group_ids.shape, "branches", f"{tuple(branches.shape)} must be {tuple(group_ids.shape)}")
    sets = group_ids.long() * 2 + branches.long()
    return grpo(rewards, sets, normalize_std=normalize_std, valid=valid, eps=eps)


@register("policy_loss", "appo")
def appo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    is_weights: torch.Tensor | None = None,
    agg: str = "token-mean",
    norm_length: int | None = None,
    *,
    ftu_coef: float = 0.1,
    gamma: float = 1.0,
    clip: float = 0.2,
) -> LossOutput:
    """PPO's clipped surrogate on Â = Â^base · (1 + b·Â^ftu) (b `ftu_coef`; Â^ftu from the detached
    π_θ/π_old with `gamma` and `clip` ε'). With π_θ = π_old, Â = Â^base · (1 + b)."""
    check_options(gamma, clip)
    need(ftu_coef >= 0.0, "ftu_coef", f"must be >= 0, got {ftu_coef}")
    old = logp.detach() if old_logp is None else old_logp.detach()
    ftu = future_ratio(logp.detach() - old, mask, gamma, clip).to(logp.dtype)
    adv = advantages if advantages.shape == logp.shape else advantages[:, None].expand_as(logp)
    scaled = adv.to(logp.dtype) * (1.0 + ftu_coef * ftu)
    return ppo_clip(logp, old_logp, scaled, mask, clip_low, clip_high, dual_clip, is_weights, agg, norm_length)
