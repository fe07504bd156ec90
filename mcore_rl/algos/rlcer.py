"""RLCER — "Reinforcing Chain-of-Thought Reasoning with Self-Evolving Rubrics" (Seed & NUS & USTC,
2026): rewarding the chain of thought with rubrics whose validity is measured on the rollouts.

An outcome reward says nothing about the CoT. RLCER has the policy (as a *Rubricator*) propose K
rubrics (criterion, signed score) for a question, a frozen *Verifier* decide per rollout whether
the CoT satisfies each (v_k ∈ {0, 1}^N over the N rollouts), and keeps only rubrics that tell right
from wrong: corr(v_k, z) > α (α = 0.2, strict) and std(v_k) > 0, z the rollouts' correctness. Then

    r_cot = minmax( Σ_{valid k} v_k · s_k )  over the question's rollouts, in [0, 1],
    r^Rea = r_outcome (±1) + r_cot  ∈ [-1, 2]            (RQ1's rubric-only variant: r_cot alone),
    r^Rub = K_valid / K + 1(format correct)  ∈ [0, 2].

Choices where the summary is unclear (docs/design.md#paper-methods):

* corr is **Pearson** over the question's valid rollouts. When z is constant (all right or all
  wrong) it is undefined, and **no rubric is valid** there (nothing to tell apart); a rubric whose
  verdict or score is missing (NaN) on some valid rollout of the group is left out for that group.
* min-max runs over the **question's rollouts** (the group). A constant sum (no valid rubric, or all
  satisfy the same ones) gives r_cot = 0, so the reward is the plain ±1 outcome there.
* The rubricator's output format (`parse_rubrics`): one rubric per line, "N. (score) criterion",
  score a signed number; the format is correct when there is at least one rubric, every non-empty
  line is one, and no criterion repeats (the summary's comment on duplicate rubrics).

What reaches the trainer: reward shaping "rlcer" computes r^Rea for each sample from the reward
heads `<prefix>_v<k>` (the verifier's verdict on rubric k) and `<prefix>_w<k>` (rubric k's signed
score); `recipes/judge_heads.py` writes them from the "rubric" judge reward's verdicts and the
prompt's `rubric_scores`. So the Reasoner side trains with the verifier judge over given rubrics
(a file's `rubric` + `rubric_scores`). Not built: the Rubricator role — a second rollout of the same
policy conditioned on a Reasoner CoT, whose rubrics feed the verifier and whose own reward is
`rubricator_reward` — needs two-pass, two-stream rollouts the rollout manager does not have.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from mcore_rl.algos.advantages import valid_mask
from mcore_rl.algos.multi_reward import group_index, head_column, need
from mcore_rl.algos.registry import register
from mcore_rl.algos.thresholds import at_least


def pearson(v: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of each row of v [K, N] with z [N], float64; NaN where either is constant."""
    v, z = v.double(), z.double()
    dv, dz = v - v.mean(-1, keepdim=True), z - z.mean()
    num = (dv * dz).sum(-1)
    den = (dv * dv).sum(-1).sqrt() * (dz * dz).sum().sqrt()
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.full((), float("nan"), dtype=torch.float64))


def rubric_validity(v: torch.Tensor, z: torch.Tensor, alpha: float = 0.2) -> torch.Tensor:
    """[K] bool: corr(v_k, z) > α and std(v_k) > 0 (v [K, N] verdicts, z [N] correctness; a
    constant z makes every rubric invalid)."""
    corr = pearson(v, z)
    return ~corr.isnan() & (corr > alpha) & (v.double().std(-1, unbiased=False) > 0)


def minmax(x: torch.Tensor) -> torch.Tensor:
    """Min-max to [0, 1]; a constant vector gives 0."""
    x = x.double()
    lo, hi = x.min(), x.max()
    return (x - lo) / (hi - lo) if hi > lo else torch.zeros_like(x)


def cot_rewards(v: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """r_cot [N] = minmax(Σ_{valid k} v_k s_k) over the N rollouts of one question."""
    raw = (v.double() * (scores.double() * valid.double())[:, None]).sum(0)
    return minmax(raw)


def reasoner_rewards(
    correct: torch.Tensor, v: torch.Tensor, scores: torch.Tensor, alpha: float = 0.2, cot_only: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(r^Rea [N], valid rubrics [K]) for one question: ±1 outcome + r_cot (or r_cot alone)."""
    valid = rubric_validity(v, correct, alpha)
    cot = cot_rewards(v, scores, valid)
    outcome = torch.where(correct.bool(), 1.0, -1.0).double()
    return (cot if cot_only else outcome + cot), valid


def rubricator_reward(valid: Sequence[bool], format_ok: bool) -> float:
    """r^Rub = K_valid / K + 1(format correct) in [0, 2] (0 valid-fraction for K = 0)."""
    k = len(valid)
    return (sum(bool(x) for x in valid) / k if k else 0.0) + (1.0 if format_ok else 0.0)


_RUBRIC_LINE = re.compile(r"\s*\d+[.)]\s*\(\s*([-+]?\d+(?:\.\d+)?)\s*\)\s*(\S.*?)\s*")


def parse_rubrics(text: str) -> tuple[list[tuple[str, float]], bool]:
    """The rubrics of a Rubricator reply, "N. (score) criterion" per line, and whether its format
    is correct (at least one rubric, every non-empty line one, no criterion twice)."""
    rubrics, ok = [], True
    for line in text.splitlines():
        if not line.strip():
            continue
        m = _RUBRIC_LINE.fullmatch(line)
        if m is None:
            ok = False
            continue
        rubrics.append((m.group(2), float(m.group(1))))
    seen = [c.casefold() for c, _ in rubrics]
    return rubrics, ok and bool(rubrics) and len(set(seen)) == len(seen)


def rubric_columns(
    reward_heads: torch.Tensor | None, head_names: Sequence[str], prefix: str, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(verdicts [N, K], scores [N, K]) from the heads `<prefix>_v<k>` / `<prefix>_w<k>`, NaN where a
    sample lacks rubric k (K = 0 when the batch has none)."""
    pat = re.compile(rf"{re.escape(prefix)}_v(\d+)")
    ks = [int(m.group(1)) for h in head_names if (m := pat.fullmatch(h))]
    k = max(ks) + 1 if ks else 0
    if not k:
        return torch.zeros(n, 0, dtype=torch.float64), torch.zeros(n, 0, dtype=torch.float64)
    v = torch.stack([head_column(reward_heads, head_names, f"{prefix}_v{i}", n) for i in range(k)], 1)
    w = torch.stack([head_column(reward_heads, head_names, f"{prefix}_w{i}", n) for i in range(k)], 1)
    return v, w


@register("reward_shaping", "rlcer")
def rlcer(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: torch.Tensor | None = None,
    head_names: Sequence[str] = (),
    lengths: torch.Tensor | None = None,
    seq_logp: torch.Tensor | None = None,
    prefix: str = "rlcer",
    alpha: float = 0.2,
    correct_threshold: float = 0.5,
    outcome_head: str | None = None,
    cot_only: bool = False,
) -> torch.Tensor:
    """The Reasoner's reward [N] float32: ±1 outcome + the group's min-max-normalised signed sum of
    the valid rubrics each sample satisfies (validity per group). Invalid samples keep their reward."""
    need(-1.0 <= alpha < 1.0, "alpha", f"must be in [-1, 1) (a correlation threshold), got {alpha}")
    need(isinstance(prefix, str) and bool(prefix), "prefix", f"must be a non-empty head-name prefix, got {prefix!r}")
    ok = valid_mask(rewards, group_ids, valid)
    n = rewards.shape[0]
    outcome = rewards.double() if outcome_head is None else head_column(reward_heads, head_names, outcome_head, n)
    correct = at_least(outcome, correct_threshold)
    out = torch.where(correct, 1.0, -1.0).double() * (0.0 if cot_only else 1.0)
    v_all, w_all = rubric_columns(reward_heads, head_names, prefix, n)
    inverse, k = group_index(group_ids)
    for g in range(k):
        members = torch.nonzero((inverse == g) & ok).flatten()
        if not members.numel() or not v_all.shape[1]:
            continue
        v, w = v_all[members].T, w_all[members].T  # [K, n_g]
        rubric = ~(v.isnan().any(1) | w.isnan().any(1))  # the group's rubrics, judged on all its rollouts
        if not rubric.any():
            continue
        r, _ = reasoner_rewards(correct[members], v[rubric], w[rubric][:, 0], alpha, cot_only)
        out[members] = r
    return torch.where(ok, out, rewards.double()).to(torch.float32)
