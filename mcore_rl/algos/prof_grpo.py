"""PROF-GRPO — "Beyond Correctness: Harmonizing Process and Outcome Rewards through RL Training"
(Amazon, 2025): a process reward model used as a *consistency filter*, never as a reward.

Blending a PRM score into the reward gets hacked (length explosion, entropy collapse). PROF instead
over-samples n responses per prompt and trains (GRPO) on m < n of them: the ones whose process
agrees with their outcome. With the outcome r^o ∈ {-1, +1} and the PRM's step scores r^h over H
steps, the process–outcome consistency is (Eq. 1)

    r^pro = [ mean_h r^h − λ · 1(H = 1 or H >= H_λ) ] · r^o,

the step penalty λ subtracted *before* the multiplication (so a wrong 1-step answer's r^pro rises
by λ). Each group is split into correct G+ and wrong G−; k+ + k− = m maximising k+·k− under
k+ <= |G+|, k− <= |G−| (balanced, the short side kept whole). G+ keeps its top-k+ by r^pro; G−
keeps k− at random (variant "pos", PROF-POS) or by r^pro (variant "both", PROF-BOTH).

Choices where the summary is unclear or wrong (docs/design.md#paper-methods):

* **Sign of PROF-BOTH.** The notes say "keep the lowest r^pro" among wrong answers, which under
  Eq. 1 would keep the wrong answers with the *best* PRM score. The paper's abstract says it
  "retains correct responses with higher averaged process values and incorrect responses with
  lower averaged process values", so both groups keep their **highest** r^pro (for G−: the lowest
  mean PRM score, less the step penalty) — the consistent ones.
* **Inputs as reward heads.** `prm_head` (default "prm") holds each response's mean PRM step score
  (1/H Σ_h r^h) and `steps_head` (None: no step penalty; e.g. "prm_steps") its step count H, both
  written by the PRM reward of the domain. Give those heads **weight 0** in `data.domains[*].rewards`: a head's value
  enters `Sample.reward` with its weight, and PROF's point is that the PRM is never in the reward.
  This filter only returns a keep-mask; it changes no reward. The outcome is the scalar reward
  (or `outcome_head`), correct when >= `correct_threshold` (0.5: a 0/1 or a ±1 verifier).
* **Missing scores.** A sample without a PRM score (NaN: the PRM failed, or the domain has none)
  ranks below every scored one of its side; without a step count, no step penalty applies.
  Ties (and a batch with no PRM at all) are broken by a seeded random order, so with no PRM the
  filter is balanced random sub-sampling (the paper's Filter-Random, balanced).
* **Randomness.** PROF-POS's draw is seeded by (`seed`, group id): deterministic, resumable, and a
  function of the group's sample positions only — never of the PRM scores.
* A group with at most m valid samples is kept whole (nothing to filter). Invalid samples stay
  out and are not counted in n. λ is not given by the summary (default 0); H_λ = 30.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_rl.algos.advantages import valid_mask
from mcore_rl.algos.multi_reward import group_index, head_column, need
from mcore_rl.algos.registry import register
from mcore_rl.algos.thresholds import at_least

VARIANTS = ("pos", "both")


def consistency(
    prm_mean: torch.Tensor, steps: torch.Tensor, outcome_sign: torch.Tensor, step_penalty: float, max_steps: int
) -> torch.Tensor:
    """Eq. 1: r^pro = [mean PRM − λ·1(H = 1 or H >= H_λ)] · r^o, [N] float64 (NaN where no PRM score;
    a NaN step count means no penalty)."""
    penalised = (steps == 1) | (steps >= max_steps)  # False for NaN
    return (prm_mean.double() - step_penalty * penalised.double()) * outcome_sign.double()


def balanced_counts(n_pos: int, n_neg: int, m: int) -> tuple[int, int]:
    """(k+, k−): k+ + k− = m maximising k+·k− with k+ <= n_pos, k− <= n_neg (everything when
    n_pos + n_neg <= m). For odd m the extra one goes to the wrong side, so a group with fewer than
    floor(m/2) correct keeps them all and fills up with wrong ones."""
    if n_pos + n_neg <= m:
        return n_pos, n_neg
    k_pos = min(n_pos, max(m // 2, m - n_neg))
    return k_pos, m - k_pos


def _priority(seed: int, group: int, size: int) -> torch.Tensor:
    """A seeded random order of a group's positions (tie-breaks and PROF-POS's draw)."""
    gen = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(group)) % (2**63))
    return torch.rand(size, generator=gen, dtype=torch.float64)


def _top(idx: torch.Tensor, score: torch.Tensor, tie: torch.Tensor, k: int) -> torch.Tensor:
    """The k of `idx` with the highest `score` (NaN lowest), ties by the higher `tie`."""
    if k <= 0:
        return idx[:0]
    s = torch.nan_to_num(score[idx], nan=-torch.inf)
    order = sorted(range(idx.numel()), key=lambda j: (-float(s[j]), -float(tie[j])))
    return idx[torch.tensor(order[:k], dtype=torch.long)]


def prof_keep(
    r_pro: torch.Tensor,
    correct: torch.Tensor,
    group_ids: torch.Tensor,
    ok: torch.Tensor,
    m: int,
    variant: str = "pos",
    seed: int = 0,
) -> torch.Tensor:
    """The keep-mask [N] bool: per group, the balanced top-k+ correct by r^pro and k− wrong (random
    for "pos", top by r^pro for "both"); groups with <= m ok samples are kept whole."""
    inverse, k = group_index(group_ids)
    keep = torch.zeros(r_pro.shape[0], dtype=torch.bool)
    for g in range(k):
        members = torch.nonzero((inverse == g) & ok).flatten()
        if members.numel() <= m:
            keep[members] = True
            continue
        gid = int(group_ids[members[0]])
        tie = torch.zeros(r_pro.shape[0], dtype=torch.float64)
        tie[members] = _priority(seed, gid, members.numel())
        pos, neg = members[correct[members]], members[~correct[members]]
        k_pos, k_neg = balanced_counts(pos.numel(), neg.numel(), m)
        keep[_top(pos, r_pro, tie, k_pos)] = True
        neg_score = r_pro if variant == "both" else torch.zeros_like(r_pro)  # "pos": the random order alone
        keep[_top(neg, neg_score, tie, k_neg)] = True
    return keep


@register("sample_filter", "prof_grpo")
def prof_grpo(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: torch.Tensor | None = None,
    head_names: Sequence[str] = (),
    lengths: torch.Tensor | None = None,
    seq_logp: torch.Tensor | None = None,
    keep: int = 8,
    variant: str = "pos",
    prm_head: str = "prm",
    steps_head: str | None = None,
    step_penalty: float = 0.0,
    max_steps: int = 30,
    outcome_head: str | None = None,
    correct_threshold: float = 0.5,
    seed: int = 0,
) -> torch.Tensor:
    """Keep-mask [N] bool: m = `keep` samples per group, balanced between correct and wrong and
    chosen by process–outcome consistency (`variant` "pos" = PROF-POS, "both" = PROF-BOTH).
    (`domain_ids`, `lengths`, `seq_logp`: part of the sample-filter signature only.)"""
    need(keep >= 1, "keep", f"must be >= 1 (m, the responses kept per group), got {keep}")
    need(variant in VARIANTS, "variant", f"must be one of {', '.join(VARIANTS)}, got {variant!r}")
    need(isinstance(prm_head, str) and bool(prm_head), "prm_head", f"must name a reward head, got {prm_head!r}")
    need(step_penalty >= 0, "step_penalty", f"must be >= 0 (λ), got {step_penalty}")
    need(step_penalty == 0 or bool(steps_head), "step_penalty", "needs steps_head (the head holding each step count)")
    need(max_steps >= 2, "max_steps", f"must be >= 2 (H_λ; a 1-step response is penalised anyway), got {max_steps}")
    ok = valid_mask(rewards, group_ids, valid)
    n = rewards.shape[0]
    outcome = rewards.double() if outcome_head is None else head_column(reward_heads, head_names, outcome_head, n)
    correct = at_least(outcome, correct_threshold)  # NaN: wrong
    steps = (
        head_column(reward_heads, head_names, steps_head, n)
        if steps_head
        else torch.full((n,), float("nan"), dtype=torch.float64)
    )
    sign = torch.where(correct, torch.ones(()), -torch.ones(()))
    r_pro = consistency(head_column(reward_heads, head_names, prm_head, n), steps, sign, step_penalty, max_steps)
    return prof_keep(r_pro, correct, group_ids, ok, keep, variant, seed)
