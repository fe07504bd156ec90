"""PAPO (USTC & Shanghai AI Lab & HKU & Oxford & Wuhan, 2026): decoupled advantage normalisation of an
outcome reward and a rubric (process) reward.

Adding a rubric score to the outcome reward before normalising lets a well-written wrong answer
outrank a terse right one (reward hacking); multiplying them kills the signal of all-correct groups.
PAPO normalises the two separately and adds them:

    A_out  = (r_out − μ_out) / max(σ_out, ε)                  over the group (population std),
    A_proc = (r_proc − μ_C) / max(σ_C, ε)   on the correct subset C = {r_out = 1}, if |C| >= 2,
    A_proc = 0                              for wrong responses, and for everyone if |C| < 2,
    A      = A_out + A_proc.

So the outcome keeps its direction (a wrong response's advantage is exactly its A_out) and an
all-correct group still learns from the rubric.

Heads: `outcome_head` (None: the scalar reward) and `process_head` (default "rubric", e.g. the
DR-Rubric judge's 3-level score). A sample is correct when its outcome is >= `correct_threshold`
(1.0: the 0/1 outcome of the paper). A correct sample without a process score (NaN: the judge was
not called or failed) is left out of C and gets A_proc = 0; a missing outcome counts as 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_rl.algos.advantages import kept, valid_mask
from mcore_rl.algos.multi_reward import group_index, group_moments, head_column, need
from mcore_rl.algos.registry import register
from mcore_rl.algos.thresholds import at_least


def papo_parts(
    r_out: torch.Tensor,
    r_proc: torch.Tensor,
    group_ids: torch.Tensor,
    ok: torch.Tensor,
    correct_threshold: float = 1.0,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A_out, A_proc, valid samples of each sample's group), each [N] float64. `r_proc` may be
    NaN where there is no process score."""
    inverse, k = group_index(group_ids)
    count, mu, var = group_moments(r_out, inverse, k, ok)
    a_out = (r_out.double() - mu[inverse]) / var.sqrt().clamp_min(eps)[inverse]
    correct = ok & at_least(r_out, correct_threshold) & ~r_proc.isnan()
    c_count, c_mu, c_var = group_moments(r_proc, inverse, k, correct)
    a_proc = (r_proc.double() - c_mu[inverse]) / c_var.sqrt().clamp_min(eps)[inverse]
    a_proc = torch.where(correct & (c_count[inverse] >= 2), a_proc, torch.zeros(()))
    return a_out, a_proc, count[inverse]


@register("advantage", "papo")
def papo(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    normalize_std: bool = True,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: torch.Tensor | None = None,
    head_names: Sequence[str] = (),
    outcome_head: str | None = None,
    process_head: str = "rubric",
    correct_threshold: float = 1.0,
    eps: float = 1e-6,
) -> torch.Tensor:
    """A_out + A_proc [N]. (`normalize_std`, `domain_ids`: part of the advantage signature only.)"""
    need(eps > 0, "eps", f"must be > 0 (it guards the all-correct group's σ_out = 0), got {eps}")
    need(
        isinstance(process_head, str) and bool(process_head),
        "process_head",
        f"must name a reward head, got {process_head!r}",
    )
    ok = valid_mask(rewards, group_ids, valid)
    n = rewards.shape[0]
    r_out = (
        rewards.double()
        if outcome_head is None
        else torch.nan_to_num(head_column(reward_heads, head_names, outcome_head, n), nan=0.0)
    )
    r_proc = head_column(reward_heads, head_names, process_head, n)
    a_out, a_proc, count = papo_parts(r_out, r_proc, group_ids, ok, correct_threshold, eps)
    return kept(a_out + a_proc, count, ok)
