"""RLUF — "Reinforcement Learning from User Feedback" (Meta GenAI, 2025, arXiv:2505.14946): a binary reward model of
user feedback, P[Love] = Pr(love reaction | context, response), trained with binary cross-entropy,
optimised together with other reward models (helpfulness, safety), each with its own prompt set in
one run, as a weighted combination (0.7 / 0.3 / w_love; w_love 0, 0.1 or 0.3).

What the trainer takes from it:

* the P[Love] model is `mcore-rl rm-train` with `reward_model.objective: binary`, used as a
  `reward_model` head; its score is a logit, P[Love] = σ(logit) (`probability_heads`);
* each prompt set is a domain (`data.domains`), each with its reward model as a head (a `key`
  names each head: `{name: reward_model, key: love, options: {model_dir: ...}}`), so a prompt of
  the love set is scored by the love model only;
* `rluf` (kind "reward_shaping") is the combination r = Σ_h w_h · v_h over the heads a sample has
  (a head its domain lacks is NaN and left out, not renormalised: w_love = 0 gives the baseline
  reward exactly); a sample with none of the heads keeps its reward;
* `two_proportion_z`: the paper's A/B test of love rates.

The CRAFT optimiser (iterative best-of-N with a KL penalty) is the advantage "craft" (`craft.py`),
paired with the policy loss "reinforce" and `algorithm.kl_coef`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from mcore_rl.algos.advantages import valid_mask
from mcore_rl.algos.multi_reward import head_column, need
from mcore_rl.algos.registry import register


def two_proportion_z(p_treatment: float, p_control: float, n: int) -> float:
    """z = (p̂_t − p̂_c) / sqrt(p̂(1 − p̂)(1/N + 1/N)), p̂ = (p̂_t + p̂_c)/2, N samples per arm."""
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    pooled = (p_treatment + p_control) / 2
    spread = math.sqrt(pooled * (1 - pooled) * (2 / n))
    if spread == 0:
        raise ValueError("the pooled rate is 0 or 1: the z statistic is undefined")
    return (p_treatment - p_control) / spread


def combine(heads: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_h w_h v_h per sample [N] from heads [N, H] (NaN heads left out; NaN where none is there)."""
    present = ~heads.isnan()
    total = (weights.double() * torch.nan_to_num(heads.double())).sum(1)
    return torch.where(present.any(1), total, torch.nan)


@register("reward_shaping", "rluf")
def rluf(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: torch.Tensor | None = None,
    head_names: Sequence[str] = (),
    lengths: torch.Tensor | None = None,
    seq_logp: torch.Tensor | None = None,
    weights: Mapping[str, float] | None = None,
    probability_heads: Sequence[str] = (),
) -> torch.Tensor:
    """The rewards [N] float32 replaced by the weighted sum of the heads in `weights` ({head: w});
    the heads of `probability_heads` (a binary RM's logits) enter as σ(v). (`domain_ids`,
    `lengths`, `seq_logp`: part of the reward-shaping signature only.)"""
    need(
        isinstance(weights, Mapping) and len(weights) > 0,
        "weights",
        f"must map reward heads to their weights, e.g. {{helpful: 0.7, safe: 0.3, love: 0.1}}, got {weights!r}",
    )
    assert isinstance(weights, Mapping)
    bad = {h: w for h, w in weights.items() if not (isinstance(w, (int, float)) and math.isfinite(w))}
    need(not bad, "weights", f"must be finite numbers, got {bad}")
    need(
        isinstance(probability_heads, (list, tuple)) and all(h in weights for h in probability_heads),
        "probability_heads",
        f"must list heads of `weights` (binary RMs' logits, read as σ), got {probability_heads!r}",
    )
    n = rewards.shape[0]
    names = list(weights)
    cols = torch.stack([head_column(reward_heads, head_names, h, n) for h in names], 1)
    for k, h in enumerate(names):
        if h in probability_heads:
            cols[:, k] = torch.sigmoid(cols[:, k])
    out = combine(cols, torch.tensor([float(weights[h]) for h in names], dtype=torch.float64))
    keep = valid_mask(rewards, group_ids, valid) & ~out.isnan()
    return torch.where(keep, out, rewards.double()).to(torch.float32)
