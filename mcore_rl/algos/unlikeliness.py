"""Unlikeliness reward — "Rewarding the Unlikely: Lifting GRPO Beyond Distribution Sharpening" (CMU, 2025).

GRPO mostly raises correct responses the model already finds likely (distribution sharpening), so
pass@1 improves and large-N pass@N does not: that needs the rare correct responses (probability
around 1/N) raised. Before the GRPO normalisation each correct sample's reward is scaled down by
its likelihood rank in its group, so the most likely correct responses get the least:

    r_i = R_i · (1 − β_rank · (G − rank_i) / G),   rank 1 = the most likely of the group, β_rank = 0.25;

wrong samples keep their reward (0 for the paper's 0/1 verifier).

Chosen where the summary is unclear (docs/design.md#paper-methods):
* **1-based rank**, as in the formula: the most likely correct sample gets 1 − β(G−1)/G (0.78125 at
  G = 8), the least likely 1; every correct reward lies in [1 − β, 1] times R.
* Ranked among all G **valid** samples of the group, correct and wrong (G = their count), by π_old's
  **summed response log-prob** (`seq_logp`, raw, not length-normalised, as the summary gives it).
* **Ties** (e.g. identical responses) share the mean of the ranks they span, so equal responses
  get equal rewards whatever their order in the batch.
* A sample is correct when its reward is >= `correct_threshold` (1.0); invalid samples keep their
  reward and rank nowhere.
The paper's other knobs (2–3 PPO epochs, KL coefficient 0.1) are `algorithm.ppo_epochs` and
`algorithm.kl_coef`. Registered as kind "reward_shaping": it composes with any group estimator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_rl.algos.advantages import valid_mask
from mcore_rl.algos.multi_reward import group_index, need
from mcore_rl.algos.registry import register
from mcore_rl.algos.thresholds import at_least


def likelihood_ranks(
    seq_logp: torch.Tensor, group_ids: torch.Tensor, ok: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each ok sample's 1-based rank within its group's ok samples by descending `seq_logp`, ties
    sharing their mean rank; that group's ok count), both [N] float64, 0 where not ok."""
    inverse, k = group_index(group_ids)
    rank = torch.zeros(seq_logp.shape, dtype=torch.float64)
    size = torch.zeros(seq_logp.shape, dtype=torch.float64)
    lp = seq_logp.double()
    for g in range(k):
        idx = ((inverse == g) & ok).nonzero().flatten()
        if idx.numel() == 0:
            continue
        x = lp[idx]
        above = (x[None, :] > x[:, None]).sum(1).double()  # strictly more likely samples
        equal = (x[None, :] == x[:, None]).sum(1).double()  # itself included
        rank[idx] = above + (equal + 1) / 2
        size[idx] = float(idx.numel())
    return rank, size


@register("reward_shaping", "unlikeliness")
def unlikeliness(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: torch.Tensor | None = None,
    head_names: Sequence[str] = (),
    lengths: torch.Tensor | None = None,
    seq_logp: torch.Tensor | None = None,
    beta_rank: float = 0.25,
    correct_threshold: float = 1.0,
) -> torch.Tensor:
    """The rewards with each correct sample's scaled by 1 − β_rank·(G − rank)/G [N] float32."""
    need(0 <= beta_rank <= 1, "beta_rank", f"must be in [0, 1] (rewards stay >= 0), got {beta_rank}")
    ok = valid_mask(rewards, group_ids, valid)
    n = rewards.shape[0]
    if seq_logp is None or seq_logp.shape != (n,):
        got = None if seq_logp is None else tuple(seq_logp.shape)
        raise ValueError(f"unlikeliness ranks by π_old's sequence log-probs [{n}], got {got}")
    rank, size = likelihood_ranks(seq_logp, group_ids, ok)
    factor = 1.0 - beta_rank * (size - rank) / size.clamp_min(1)
    correct = ok & at_least(rewards, correct_threshold)
    return torch.where(correct, rewards.double() * factor, rewards.double()).to(torch.float32)
