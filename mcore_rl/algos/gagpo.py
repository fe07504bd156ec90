"""GAGPO: "GAGPO: Generalized Advantage Grouped Policy Optimization" (SYSU & Meituan, 2026), arXiv:2605.13217.

Critic-free GAE over identical states. The value of a state is the mean discounted return of the
rollout group's steps that acted in exactly that state (`state_key`), V̄(s) = mean_{G(s)} R̂; the TD
residuals δ_t = r_t + γ V̄(s_{t+1}) − V̄(s_t) (V̄ = 0 after an episode's last step) run through the
GAE recursion Â_t = δ_t + γλ Â_{t+1}, and the step advantages of the rollout group are normalised
together, A = (Â − μ_B) / (σ_B + ε) with the population std (mean-only with
`algorithm.advantage_std_normalize: false`). With λ = 1 the recursion telescopes to Â_t = R̂_t −
V̄(s_t), a state baseline on the step's return; with λ = 0 it is the one-step δ_t. A state only one
step visited has V̄ = R̂ of that step, so when no state repeats every δ and every advantage is 0:
GAGPO learns only from state collisions (deterministic text environments).

The paper's action-level ratio (the geometric mean of the token ratios of one action) is the GSPO
loss here: a step-wise sample is one action, so `algorithm.policy_loss: gspo` with the PPO clip range
is GAGPO's objective (`policy_loss.sequence_log_ratio`). Defaults γ = 0.95, λ = 0.8: the paper's best.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_rl.algos.advantages import valid_mask
from mcore_rl.algos.multi_reward import need
from mcore_rl.algos.registry import register
from mcore_rl.algos.step_credit import (
    StepBatch,
    check_discount,
    gae,
    moments_within,
    normalized_within,
    steps_of,
    state_groups,
    step_returns,
)


def state_values(returns: torch.Tensor, ids: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """[N] float64: V̄ of each step's state, the mean return of the valid steps in it (a state with no
    valid step: the step's own return)."""
    count, mean, _ = moments_within(returns, ids, ok)
    return torch.where(count > 0, mean, returns.double())


def grouped_gae(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    steps: StepBatch,
    valid: torch.Tensor | None,
    gamma: float,
    lam: float,
) -> torch.Tensor:
    """[N] float64: Â_t before normalisation (GAE over the TD residuals of the grouped value proxy)."""
    ok = valid_mask(rewards, group_ids, valid)
    values = state_values(step_returns(rewards, group_ids, steps, gamma), state_groups(group_ids, steps), ok)
    return gae(rewards, group_ids, steps, values, gamma, lam)


@register("advantage", "gagpo")
def gagpo(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    normalize_std: bool = True,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: torch.Tensor | None = None,
    head_names: Sequence[str] = (),
    steps: StepBatch | None = None,
    gamma: float = 0.95,
    lam: float = 0.8,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GAGPO's normalised step advantages, [N] float32 (0 for invalid samples and for rollout groups
    with fewer than 2 valid steps)."""
    check_discount(gamma)
    need(0.0 <= lam <= 1.0, "lam", f"must be in [0, 1], got {lam}")
    s = steps_of(steps, rewards)
    ok = valid_mask(rewards, group_ids, valid)
    a_hat = grouped_gae(rewards, group_ids, s, valid, gamma, lam)
    adv, defined = normalized_within(a_hat, group_ids, ok, normalize_std, eps, bessel=False)
    return torch.where(defined, adv, torch.zeros((), dtype=torch.float64)).to(torch.float32)
