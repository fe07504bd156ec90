"""PPO's token-level GAE over a learned critic ("High-Dimensional Continuous Control Using Generalized
Advantage Estimation", arXiv:1506.02438; as verl's and OpenRLHF's `gae`), `algorithm.advantage: gae`.

Each response token is an action; the state before token t is read from the critic at the position
whose label is t (`critic.ValueBatch`). The sequence's reward arrives at its last trained token:
    δ_t = r_t + γ V_{t+1} − V_t   (V after the last token: 0),   Â_t = δ_t + γλ Â_{t+1},
over the trained tokens only: a multi-turn sample's observation tokens (`Sample.trainable` 0) are
skipped by the recursion, neither discounted nor valued, as verl does for them. The critic learns
R_t = Â_t + V_t at every trained token (the λ-return). The advantages are then whitened over the
batch's valid trained tokens (mean-only with `algorithm.advantage_std_normalize: false`).

Defaults γ = 1.0, λ = 0.95 (OpenRLHF's; verl's λ is 1.0). A single-turn estimator: validation
refuses it on step-wise episodes, where each step would be an episode of its own (`steppo` is the
step-level estimator).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_rl.algos.advantages import valid_mask
from mcore_rl.algos.critic import ValueBatch, reads_critic, whiten
from mcore_rl.algos.multi_reward import need
from mcore_rl.algos.registry import register
from mcore_rl.algos.step_credit import check_discount


def token_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Â [N, T], R = Â + V [N, T]), float64, 0 off `mask`: GAE over each row's masked tokens, the
    row's reward [N] on its last masked token."""
    n, t = values.shape
    v = values.double()
    m = mask.bool()
    r = rewards.double()
    adv = torch.zeros(n, t, dtype=torch.float64)
    next_v = torch.zeros(n, dtype=torch.float64)
    last = torch.zeros(n, dtype=torch.float64)
    seen = torch.zeros(n, dtype=torch.bool)
    for j in reversed(range(t)):
        here = m[:, j]
        reward = torch.where(here & ~seen, r, torch.zeros((), dtype=torch.float64))
        a = reward + gamma * next_v - v[:, j] + gamma * lam * last
        adv[:, j] = torch.where(here, a, torch.zeros((), dtype=torch.float64))
        last = torch.where(here, a, last)
        next_v = torch.where(here, v[:, j], next_v)
        seen |= here
    return adv, (adv + v) * m.double()


def _checked(rewards: torch.Tensor, values: ValueBatch | None, gamma: float, lam: float) -> ValueBatch:
    check_discount(gamma)
    need(0.0 <= lam <= 1.0, "lam", f"must be in [0, 1], got {lam}")
    if values is None:
        raise ValueError("gae reads the critic's values (algorithm.critic), and none were given")
    values.check(rewards.shape[0])
    return values


def gae_targets(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    values: ValueBatch,
    valid: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
    **_options: object,  # the estimator's other options (eps)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's targets: the λ-returns at every trained token of the valid samples."""
    vb = _checked(rewards, values, gamma, lam)
    mask = vb.mask * valid_mask(rewards, group_ids, valid)[:, None].to(vb.mask.dtype)
    _, returns = token_gae(rewards, vb.values, mask, gamma, lam)
    return returns.float(), mask.float()


@reads_critic(gae_targets)
@register("advantage", "gae")
def gae(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    normalize_std: bool = True,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: torch.Tensor | None = None,
    head_names: Sequence[str] = (),
    values: ValueBatch | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-token advantages [N, T] float32, whitened over the valid samples' trained tokens (0
    elsewhere). Group ids play no part: the critic is the baseline."""
    vb = _checked(rewards, values, gamma, lam)
    mask = vb.mask * valid_mask(rewards, group_ids, valid)[:, None].to(vb.mask.dtype)
    adv, _ = token_gae(rewards, vb.values, mask, gamma, lam)
    return whiten(adv, mask, normalize_std, eps).to(torch.float32)
