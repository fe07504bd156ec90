"""W-REINFORCE — "The Surprising Effectiveness of Negative Reinforcement in LLM Reasoning" (Princeton, 2025).

The RLVR loss splits into positive-sample reinforcement (PSR: raise the probability of correct
responses) and negative-sample reinforcement (NSR: lower that of wrong ones). NSR alone keeps the
model's confident priors (its token gradient → 0 as π_y → 1), pushes mass onto the other tokens in
proportion to their probability and stops by itself as π_y → 0; PSR sharpens the distribution and
collapses pass@k for large k. W-REINFORCE keeps both and down-weights PSR:

    L = λ·L_PSR + L_NSR,   L_PSR = −E_x Σ_{y correct} π_θ(y|x),   L_NSR = E_x Σ_{y wrong} π_θ(y|x).

Sampled, that is REINFORCE with a per-sample weight and no baseline, critic or reference model:

    A = +λ for a correct response, −1 for a wrong one,   loss −A · log π_θ(y|x)

(E_{y~π}[−A ∇log π] = −Σ_y A(y) ∇π(y), the gradient of L). λ = 0.1 (robust in [0, 0.2]); λ = 1 is
vanilla REINFORCE with ±1 rewards, which the paper reports to collapse.

Here: the advantage "w_reinforce" (correct ⇔ reward >= `correct_threshold`, 1.0 for the 0/1 and
±1 rewards of the paper; invalid samples get 0). There is no baseline, so a group of one sample
trains too. Pair it with the policy loss "reinforce" (`policy_loss.py`: −A·log π with the mismatch
IS weights, no ratio, no clip), as the paper does; with "ppo_clip" it is the PPO variant the paper
argues keeps the sign structure (clipping only limits magnitude). `pi_form_objective` is the
paper's π-form objective, the reference the sampled form is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_rl.algos.advantages import valid_mask
from mcore_rl.algos.multi_reward import need
from mcore_rl.algos.registry import register
from mcore_rl.algos.thresholds import at_least


@register("advantage", "w_reinforce")
def w_reinforce(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    normalize_std: bool = False,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: torch.Tensor | None = None,
    head_names: Sequence[str] = (),
    lam: float = 0.1,
    correct_threshold: float = 1.0,
) -> torch.Tensor:
    """A = λ where the reward is >= `correct_threshold`, −1 elsewhere, 0 for invalid samples [N]
    float32. (`normalize_std`, `group_ids`' statistics: none; W-REINFORCE has no baseline.)"""
    need(lam >= 0, "lam", f"must be >= 0 (the weight of the positive samples), got {lam}")
    ok = valid_mask(rewards, group_ids, valid)
    correct = at_least(rewards, correct_threshold)
    adv = torch.where(
        correct, torch.full_like(rewards, lam, dtype=torch.float64), torch.full_like(rewards, -1.0, dtype=torch.float64)
    )
    return torch.where(ok, adv, torch.zeros_like(adv)).to(torch.float32)


def pi_form_objective(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, correct: torch.Tensor, lam: float
) -> torch.Tensor:
    """λ·L_PSR + L_NSR in the paper's token-level π form, per sample L = −R·(1/T) Σ_t π_θ(y_t|·) with
    R = +1 (correct, weighted λ) or −1 (wrong); summed over samples. `logits` [N, T, V], `targets`
    [N, T], `mask` [N, T], `correct` [N] bool. An analysis and test reference, not a training loss."""
    probs = torch.softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    m = mask.to(probs.dtype)
    per_seq = (probs * m).sum(-1) / m.sum(-1).clamp_min(1)
    weight = torch.where(correct, torch.full_like(per_seq, lam), torch.full_like(per_seq, -1.0))
    return -(weight * per_seq).sum()
