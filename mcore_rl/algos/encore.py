"""ENCORE — "ENCORE: Entropy-guided Reward Composition for Multi-head Safety Reward Models" (Harvard,
NYU, UCLA & MIT, 2025): a training-free composition of a multi-head (multi-rule) reward model.

Each head k's scores over a set of responses have an empirical distribution over their distinct
values (no density estimate: the scores are discrete), and its entropy

    H(ψ_k) = −Σ_z p(z) log p(z)

says how decisive the head is. Heads are weighted by w = softmax(−H / τ) and composed as
r = Σ_k w_k ψ_k (the paper's summary does not write the aggregation; the weighted sum is the natural reading).
Low-entropy heads weigh more; τ → ∞ gives uniform weights, τ → 0 all the weight on the
lowest-entropy heads (ties split).

Choices:

* **Constant heads.** A head with one value everywhere has H = 0, so the formula would give it the
  largest weight although it separates nothing. With `exclude_constant` (default) such a head gets
  weight 0; if every head is constant, the weights are uniform.
* **Where the entropies come from.** The paper computes them once, over the RM's training set:
  pass them as `entropies` ({head: H}: `tools/encore_entropies.py` runs `head_entropies` over the
  RM's scores on its training data). Without them, each batch's own scores are used (a per-batch estimate).
* **Continuous heads.** A learned RM's heads are real numbers, every value distinct, so each is
  rounded to `decimals` places before counting (None: the values as they are).
* A sample without a head (NaN: its domain has none) is composed from the heads it has, their
  weights renormalised; a sample with none keeps its reward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from mcore_rl.algos.advantages import valid_mask
from mcore_rl.algos.multi_reward import head_column, need
from mcore_rl.algos.registry import register


def score_entropy(scores: torch.Tensor, decimals: int | None = None) -> float:
    """H of the empirical distribution of `scores`' distinct values (NaN ignored; 0 when empty)."""
    s = scores[~scores.isnan()].double()
    if decimals is not None:
        s = torch.round(s, decimals=decimals)
    if s.numel() == 0:
        return 0.0
    _, counts = torch.unique(s, return_counts=True)
    p = counts.double() / s.numel()
    return float(-(p * p.log()).sum())


def encore_weights(entropies: torch.Tensor, tau: float, informative: torch.Tensor | None = None) -> torch.Tensor:
    """w = softmax(−H / τ) over the informative heads (others 0); uniform when none is informative."""
    ent = entropies.double()
    ok = torch.ones_like(ent, dtype=torch.bool) if informative is None else informative.bool()
    if not bool(ok.any()):
        return torch.full_like(ent, 1.0 / ent.numel())
    logits = torch.where(ok, -ent / tau, torch.full_like(ent, -math.inf))
    return torch.softmax(logits, 0)


def head_entropies(scores: Mapping[str, torch.Tensor], decimals: int | None = None) -> dict[str, float]:
    """{head: H} of each head's scores (e.g. the RM's scores on its training set), for `entropies`."""
    return {name: score_entropy(s, decimals) for name, s in scores.items()}


def compose(heads: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_k w_k ψ_k per sample [N] from heads [N, K]; NaN heads left out, the rest renormalised (NaN
    where a sample has none)."""
    present = ~heads.isnan()
    w = weights.double().expand_as(heads) * present
    total = w.sum(1)
    return torch.where(total > 0, (w * torch.nan_to_num(heads.double())).sum(1) / total, torch.nan)


@register("reward_shaping", "encore")
def encore(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: torch.Tensor | None = None,
    head_names: Sequence[str] = (),
    lengths: torch.Tensor | None = None,
    seq_logp: torch.Tensor | None = None,
    heads: Sequence[str] = (),
    tau: float = 1.0,
    entropies: Mapping[str, float] | None = None,
    decimals: int | None = 2,
    exclude_constant: bool = True,
) -> torch.Tensor:
    """The rewards [N] float32 replaced by the entropy-weighted sum of `heads` (see the module
    docstring). (`domain_ids`, `lengths`, `seq_logp`: part of the reward-shaping signature only.)"""
    need(
        isinstance(heads, (list, tuple)) and len(heads) >= 2 and all(isinstance(h, str) and h for h in heads),
        "heads",
        f"must list at least two reward heads to compose, got {heads!r}",
    )
    need(len(set(heads)) == len(heads), "heads", f"lists a head twice: {list(heads)}")
    need(isinstance(tau, (int, float)) and tau > 0, "tau", f"must be > 0 (the softmax temperature), got {tau!r}")
    need(decimals is None or (isinstance(decimals, int) and decimals >= 0), "decimals", f"must be >= 0, got {decimals}")
    if entropies is not None:
        need(isinstance(entropies, Mapping), "entropies", f"must map head names to entropies, got {entropies!r}")
        missing = [h for h in heads if h not in entropies]
        need(not missing, "entropies", f"has no entropy for head(s) {missing}")
        bad = [h for h in heads if not (isinstance(entropies[h], (int, float)) and entropies[h] >= 0)]
        need(not bad, "entropies", f"must be numbers >= 0, got {[entropies[h] for h in bad]}")
    n = rewards.shape[0]
    ok = valid_mask(rewards, group_ids, valid)
    cols = torch.stack([head_column(reward_heads, head_names, h, n) for h in heads], 1)  # [N, K]
    if entropies is not None:
        ent = torch.tensor([float(entropies[h]) for h in heads], dtype=torch.float64)
    else:
        ent = torch.tensor([score_entropy(cols[ok, k], decimals) for k in range(len(heads))], dtype=torch.float64)
    informative = ent > 0 if exclude_constant else None
    composed = compose(cols, encore_weights(ent, float(tau), informative))
    keep = ok & ~composed.isnan()
    return torch.where(keep, composed, rewards.double()).to(torch.float32)
