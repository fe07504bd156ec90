"""StepPO: "StepPO: Step-Aligned Policy Optimization for Agentic Reinforcement Learning" (USTC, 2026),
arXiv:2604.18401 — the step-level GAE over a learned critic, `algorithm.advantage: steppo`.

StepPO models an episode as a step-level MDP (the state: the whole interaction so far; the action:
one complete model turn), reads a learned critic V_φ at the last state token before each action,
and runs GAE over steps: δ_t = r_t + γ V(s_{t+1}) − V(s_t) (V = 0 after the last step), Â_t = δ_t +
γλ Â_{t+1}, broadcast to every action token of the step (`advantages.to_tokens`: 0 on the state's
tokens). On step-wise samples (one sample per step, `steps`) the last state token is the last prompt
token, column 0 of the critic's `ValueBatch` (position len(prompt_ids) − 1). Its ratio is the
geometric mean of the step's token ratios, clipped per step: on step-wise samples (one action each)
that is `algorithm.policy_loss: gspo` (`policy_loss.sequence_log_ratio`).

The critic (`train/critic.py`) learns R_t = Â_t + V(s_t) at that one position per step (the step's
λ-return) with PPO's clipped value loss (`critic.value_loss`; the paper's summary does not give its
critic loss). The advantages are whitened over the batch's valid steps, as PPO whitens GAE's (not
given either; mean-only with `algorithm.advantage_std_normalize: false`).

Defaults: the paper compares γ 0.99 and 0.95 and gives no λ; γ = 0.99, λ = 0.95 here (PPO's usual λ).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_rl.algos.advantages import valid_mask
from mcore_rl.algos.critic import ValueBatch, reads_critic, whiten
from mcore_rl.algos.multi_reward import need
from mcore_rl.algos.registry import register
from mcore_rl.algos.step_credit import StepBatch, check_discount, gae, steps_of


def step_gae(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    steps: StepBatch,
    values: torch.Tensor,
    gamma: float = 0.99,
    lam: float = 0.95,
) -> torch.Tensor:
    """[N] float64: Â_t per step sample from the critic's values [N] at each step's last state token
    (rewards: the step's `effective_step_rewards`; V after an episode's last step is 0)."""
    check_discount(gamma)
    need(0.0 <= lam <= 1.0, "lam", f"must be in [0, 1], got {lam}")
    steps.check(rewards.shape[0])
    if values.shape != rewards.shape:
        raise ValueError(f"values {tuple(values.shape)} must be [{rewards.shape[0]}] (one per step sample)")
    return gae(rewards, group_ids, steps, values, gamma, lam)


def state_values(values: ValueBatch | None, n: int) -> torch.Tensor:
    """[N]: the critic at each step's last state token (the value grid's column 0)."""
    if values is None:
        raise ValueError("steppo reads the critic's values (algorithm.critic), and none were given")
    values.check(n)
    return values.values[:, 0].double()


def steppo_targets(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    values: ValueBatch,
    steps: StepBatch | None = None,
    valid: torch.Tensor | None = None,
    gamma: float = 0.99,
    lam: float = 0.95,
    **_options: object,  # the estimator's other options (eps)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's targets: each valid step's λ-return at its last state token (column 0)."""
    v = state_values(values, rewards.shape[0])
    ret = step_gae(rewards, group_ids, steps_of(steps, rewards), v, gamma, lam) + v
    ok = valid_mask(rewards, group_ids, valid)
    returns = torch.zeros_like(values.values, dtype=torch.float32)
    mask = torch.zeros_like(values.values, dtype=torch.float32)
    returns[:, 0] = ret.float()
    mask[:, 0] = ok.float()
    return returns, mask


@reads_critic(steppo_targets)
@register("advantage", "steppo")
def steppo(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    normalize_std: bool = True,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: torch.Tensor | None = None,
    head_names: Sequence[str] = (),
    steps: StepBatch | None = None,
    values: ValueBatch | None = None,
    gamma: float = 0.99,
    lam: float = 0.95,
    eps: float = 1e-6,
) -> torch.Tensor:
    """StepPO's step advantages [N] float32, whitened over the batch's valid steps (0 for invalid
    ones)."""
    v = state_values(values, rewards.shape[0])
    a_hat = step_gae(rewards, group_ids, steps_of(steps, rewards), v, gamma, lam)
    ok = valid_mask(rewards, group_ids, valid)
    return whiten(a_hat, ok, normalize_std, eps).to(torch.float32)
