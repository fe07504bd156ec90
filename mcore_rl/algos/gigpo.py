"""GiGPO: "Group-in-Group Policy Optimization for LLM Agent Training" (arXiv:2505.10978).

Two advantages, added: the episode-level one, GRPO over the group's G episodes (each episode once),
and the step-level one, over *anchor-state groups*: the steps of the group's episodes that acted in
an identical environment state (the same `state_key`, from any episode and any turn) are compared
by their discounted returns R_t = Σ_{u>=t} γ^{u-t} r_u:

    A(step) = A^E(episode) + ω · (R_t − mean_{G(s_t)} R) / F_norm,

F_norm the set's std (Bessel's, + eps) or 1 (`algorithm.advantage_std_normalize`), for both terms.
An anchor state that only one valid step visited has no baseline: its step term is 0, so when no
two steps share a state GiGPO is episode-level GRPO (with each episode counted once). The anchor
groups need no extra rollout: the G episodes start from the same state, so their first steps
always share it, and a deterministic environment revisits states across episodes.

Defaults: ω (`step_weight`) = 1 and γ = 0.95, the paper's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_rl.algos.multi_reward import need
from mcore_rl.algos.registry import register
from mcore_rl.algos.step_credit import (
    StepBatch,
    check_discount,
    episode_advantage,
    normalized_within,
    steps_of,
    state_groups,
    step_returns,
)
from mcore_rl.algos.advantages import valid_mask


def anchor_step_advantage(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    steps: StepBatch,
    valid: torch.Tensor | None,
    normalize_std: bool,
    gamma: float,
    eps: float,
) -> torch.Tensor:
    """[N] float64: GiGPO's step-level advantage A^S (0 where the step's anchor state has fewer than 2
    valid steps, and for invalid samples)."""
    ok = valid_mask(rewards, group_ids, valid)
    returns = step_returns(rewards, group_ids, steps, gamma)
    adv, shared = normalized_within(returns, state_groups(group_ids, steps), ok, normalize_std, eps)
    return torch.where(shared, adv, torch.zeros((), dtype=torch.float64))


@register("advantage", "gigpo")
def gigpo(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    normalize_std: bool = True,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: torch.Tensor | None = None,
    head_names: Sequence[str] = (),
    steps: StepBatch | None = None,
    step_weight: float = 1.0,
    gamma: float = 0.95,
    eps: float = 1e-6,
) -> torch.Tensor:
    """A^E + ω·A^S per step sample ([N] float32); `step_weight` ω = 0 is GRPO over episodes."""
    need(step_weight >= 0, "step_weight", f"must be >= 0, got {step_weight}")
    check_discount(gamma)
    s = steps_of(steps, rewards)
    adv = episode_advantage(rewards, group_ids, s, valid, normalize_std, eps)
    if step_weight:
        adv = adv + step_weight * anchor_step_advantage(rewards, group_ids, s, valid, normalize_std, gamma, eps)
    return adv.to(torch.float32)
