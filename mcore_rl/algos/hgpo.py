"""HGPO: "Hierarchy-of-Groups Policy Optimization for Long-Horizon Agentic Tasks" (NTU & SEU, 2026),
arXiv:2602.22817.

GiGPO compares the steps that acted in the same current state; with a memory of past steps in the
prompt, two such steps may still have seen different histories. HGPO puts each step in K+1 nested
groups: level k holds the steps of the rollout group whose last k+1 states (the current one and k
before it, `C_k` = states[max(t-k, 0) : t+1], states only) are identical, so G_0 ⊇ G_1 ⊇ … ⊇ G_K
(level 0 is GiGPO's anchor-state group). At each level the step's discounted return is normalised
within its group, and the levels are averaged with weights w_k ∝ (k+1)^α:

    A^H = Σ_k w_k (R_t − mean_{G_k} R) / std_{G_k}.

A level whose group holds one valid step is undefined and left out; the weights are renormalised
over the levels left (the summary leaves this open; with it, steps whose whole history is shared
get exactly their level-0 advantage). A step with no defined level gets 0. The std is Bessel's + eps
(as GiGPO here), or 1 with `algorithm.advantage_std_normalize: false`. For t < k, C_k is the whole
prefix s_0..s_t, so two steps share a level-k group then only if their whole histories match.

Defaults: K (`levels`) = 4 and α = 1, the paper's; γ is not given: 0.95, GiGPO's. The paper trains
on A^H alone ("adding the trajectory-level advantage hurts"): `episode_weight` (default 0) adds
that much of the episode-level GRPO advantage; with `levels: 0, episode_weight: 1` HGPO is GiGPO.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from mcore_rl.algos.advantages import valid_mask
from mcore_rl.algos.multi_reward import need
from mcore_rl.algos.registry import register
from mcore_rl.algos.step_credit import (
    StepBatch,
    check_discount,
    dense_ids,
    episode_advantage,
    episodes,
    normalized_within,
    steps_of,
    step_returns,
)


def level_weights(levels: int, alpha: float) -> torch.Tensor:
    """[K+1] float64: w_k = (k+1)^α / Σ_j (j+1)^α."""
    w = torch.arange(1, levels + 2, dtype=torch.float64) ** alpha
    return w / w.sum()


def context_groups(group_ids: torch.Tensor, steps: StepBatch, k: int) -> torch.Tensor:
    """[N] long: the level-k group of each step — same rollout group and same states s_{t-k}..s_t (the
    whole prefix for t < k). A step whose window misses a step of its episode (not in the batch)
    matches no other."""
    gid, key, st = group_ids.tolist(), steps.state_key.tolist(), steps.step.tolist()
    contexts: list[Hashable] = [("single", i) for i in range(len(gid))]
    for ix in episodes(group_ids, steps):
        if steps.episode[ix[0]] < 0:
            continue
        at = {st[i]: key[i] for i in ix}
        for i in ix:
            window = range(max(st[i] - k, 0), st[i] + 1)
            if all(t in at for t in window):
                contexts[i] = (gid[i], tuple(at[t] for t in window))
    return dense_ids(contexts)


@register("advantage", "hgpo")
def hgpo(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    normalize_std: bool = True,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: torch.Tensor | None = None,
    head_names: Sequence[str] = (),
    steps: StepBatch | None = None,
    levels: int = 4,
    alpha: float = 1.0,
    gamma: float = 0.95,
    episode_weight: float = 0.0,
    eps: float = 1e-6,
) -> torch.Tensor:
    """A^H (+ `episode_weight` × the episode-level advantage) per step sample, [N] float32."""
    need(levels >= 0, "levels", f"must be >= 0, got {levels}")
    need(alpha >= 0, "alpha", f"must be >= 0, got {alpha}")
    need(episode_weight >= 0, "episode_weight", f"must be >= 0, got {episode_weight}")
    check_discount(gamma)
    s = steps_of(steps, rewards)
    ok = valid_mask(rewards, group_ids, valid)
    returns = step_returns(rewards, group_ids, s, gamma)
    weights = level_weights(levels, alpha)
    num = torch.zeros(rewards.shape[0], dtype=torch.float64)
    den = torch.zeros(rewards.shape[0], dtype=torch.float64)
    for k in range(levels + 1):
        adv, defined = normalized_within(returns, context_groups(group_ids, s, k), ok, normalize_std, eps)
        num = num + torch.where(defined, weights[k] * adv, torch.zeros(()))
        den = den + torch.where(defined, weights[k], torch.zeros(()))
    out = torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros((), dtype=torch.float64))
    if episode_weight:
        out = out + episode_weight * episode_advantage(rewards, group_ids, s, valid, normalize_std, eps)
    return out.to(torch.float32)
