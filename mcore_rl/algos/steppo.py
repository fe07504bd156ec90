"""StepPO: "StepPO: Step-Aligned Policy Optimization for Agentic Reinforcement Learning" (USTC, 2026),
arXiv:2604.18401 — the step-level GAE, as a pure function; not an estimator a config can pick yet.

StepPO models an episode as a step-level MDP (the state: the whole interaction so far; the action:
one complete model turn), reads a learned critic V_φ at the last state token before each action,
and runs GAE over steps: δ_t = r_t + γ V(s_{t+1}) − V(s_t) (V = 0 after the last step), Â_t = δ_t +
γλ Â_{t+1}, broadcast to every action token of the step (`advantages.to_tokens`: 0 on the state's
tokens). Its ratio is the geometric mean of the step's token ratios, clipped per step: on step-wise
samples (one action each) that is `algorithm.policy_loss: gspo` (`policy_loss.sequence_log_ratio`).

What is missing for training with it: the critic. This trainer has no value model for the policy:
`models/value_head.py` puts a value head on a megatron-core decoder for reward models, but nothing
builds a second such model in the RL run, trains it with a value loss (the summary does not give
StepPO's), or reads it at position len(prompt_ids) − 1 of each step sample, which is the step's last
state token. With those values, `step_gae` gives StepPO's advantages; until then `algorithm.advantage`
does not list it. GAGPO (`gagpo.py`) is the same recursion with the group's mean return per state
as a critic-free value.

Defaults: the paper compares γ 0.99 and 0.95 and gives no λ; γ = 0.99, λ = 0.95 here (PPO's usual λ).
"""

from __future__ import annotations

import torch

from mcore_rl.algos.multi_reward import need
from mcore_rl.algos.step_credit import StepBatch, check_discount, gae


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
