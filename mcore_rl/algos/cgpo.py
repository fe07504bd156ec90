"""CGPO — "The Perfect Blend: Redefining RLHF with Mixture of Judges" (Meta GenAI & FAIR, 2024).

Multi-task RLHF where each task has its reward and its judges (constraints: format, refusal,
code runs, …). What the trainer takes from it:

* **mixture of judges** (`cgpo_judges`, kind "reward_shaping"): a sample that violates any judge
  of its domain gets reward exactly 0 before the advantage — a reward model cannot pay for a
  broken constraint. The others keep their reward, or with `calibrate` the calibrated reward
  R = σ(r(s, a) − r(s, ā)) ∈ (0, 1) against a reference response ā. The notes do not define ā;
  `reference_head` names a head holding r(s, ā) (e.g. the reward model's score of the reference
  answer), and without it ā is the group's average response (r(s, ā) = the mean reward of the
  group's valid samples). Judges are reward heads; a judge passes when its head is >=
  `pass_threshold` (exactly at it included, at the heads' precision), and a judge a sample's
  domain does not have (NaN) does not apply to it.
* **per-task weights** (`weight_domains`): the update is Σ_l ρ_l ḡ_l. The clipped policy losses are
  positively homogeneous in the advantage, so scaling domain l's advantages by ρ_l scales its
  gradient by ρ_l, and ρ_l = 0 removes it exactly (`algorithm.domain_advantage_weights`).
* **CODPO pairs** (`codpo_pairs`): chosen = the best judge-passing sample of a group, rejected = the
  worst failing one. The trainer has no DPO loss, so nothing calls it yet.
Of the three constrained optimisers, CRRAFT is the advantage "craft" (`craft.py`: the best of
each group after these judges, reward-weighted SFT through the "reinforce" loss); CRPG and CODPO
are not implemented: the PPO-style policy losses of `policy_loss.py` take the place of CRPG's
policy-gradient update.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from mcore_rl.algos.advantages import valid_mask
from mcore_rl.algos.multi_reward import group_index, group_moments, head_column, need
from mcore_rl.algos.registry import register
from mcore_rl.algos.thresholds import at_least


def violations(
    reward_heads: torch.Tensor | None,
    head_names: Sequence[str],
    judges: Sequence[str],
    n: int,
    pass_threshold: float,
) -> torch.Tensor:
    """[N] bool: the samples that fail at least one judge that applies to them.

    A score exactly at `pass_threshold` passes, compared at the scores' precision (`thresholds`:
    the learner's head matrix is float32, where a judge's 0.7 is 0.69999999)."""
    bad = torch.zeros(n, dtype=torch.bool)
    for judge in judges:
        col = head_column(reward_heads, head_names, judge, n)
        bad |= ~col.isnan() & ~at_least(col, pass_threshold)
    return bad


def calibrated(reward: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """R_calib = σ(r(s, a) − r(s, ā)): in (0, 1), 0.5 when the sample is as good as the reference."""
    return torch.sigmoid(reward - reference)


@register("reward_shaping", "cgpo_judges")
def cgpo_judges(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: torch.Tensor | None = None,
    head_names: Sequence[str] = (),
    lengths: torch.Tensor | None = None,
    seq_logp: torch.Tensor | None = None,
    judges: Sequence[str] = (),
    pass_threshold: float = 0.5,
    calibrate: bool = False,
    reward_head: str | None = None,
    reference_head: str | None = None,
) -> torch.Tensor:
    """The rewards [N] float32 with every judge violation set to 0 (and the rest calibrated if
    asked). `reward_head` is r(s, a) for the calibration (None: the scalar reward)."""
    need(
        isinstance(judges, (list, tuple)) and len(judges) > 0 and all(isinstance(j, str) and j for j in judges),
        "judges",
        f"must list the reward heads that are judges (constraints), got {judges!r}",
    )
    need(reference_head is None or calibrate, "reference_head", "is only used with calibrate: true")
    need(reward_head is None or calibrate, "reward_head", "is only used with calibrate: true")
    ok = valid_mask(rewards, group_ids, valid)
    n = rewards.shape[0]
    out = rewards.double()
    if calibrate:
        score = out if reward_head is None else head_column(reward_heads, head_names, reward_head, n)
        if reference_head is not None:
            ref = head_column(reward_heads, head_names, reference_head, n)
        else:
            inverse, k = group_index(group_ids)
            _, mean, _ = group_moments(score, inverse, k, ok & ~score.isnan())
            ref = mean[inverse]
        out = torch.where(ok, calibrated(score, ref), out)
    bad = violations(reward_heads, head_names, judges, n, pass_threshold) & ok
    return torch.where(bad, torch.zeros(()), out).to(torch.float32)


def weight_domains(
    advantages: torch.Tensor, domain_ids: torch.Tensor, domain_names: Sequence[str], weights: Mapping[str, float]
) -> torch.Tensor:
    """Advantages [N] (or [N, T]) scaled by their domain's ρ (domains not in `weights`: 1)."""
    if not weights:
        return advantages
    rho = torch.tensor([float(weights.get(d, 1.0)) for d in domain_names], dtype=advantages.dtype)
    scale = rho[domain_ids] if len(domain_names) else torch.ones(advantages.shape[0], dtype=advantages.dtype)
    return advantages * (scale if advantages.ndim == 1 else scale[:, None])


def codpo_pairs(
    scores: torch.Tensor, passed: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group (in sorted group-id order): (chosen [K], rejected [K]) sample indices — chosen the
    highest-scoring judge-passing sample, rejected the lowest-scoring failing one; -1 where a group
    has no passing (or no failing) valid sample."""
    ok = valid_mask(scores, group_ids, valid)
    inverse, k = group_index(group_ids)
    chosen = torch.full((k,), -1, dtype=torch.long)
    rejected = torch.full((k,), -1, dtype=torch.long)
    for g in range(k):
        idx = torch.nonzero((inverse == g) & ok).flatten()
        win, lose = idx[passed[idx]], idx[~passed[idx]]
        if win.numel():
            chosen[g] = win[scores[win].argmax()]
        if lose.numel():
            rejected[g] = lose[scores[lose].argmin()]
    return chosen, rejected
