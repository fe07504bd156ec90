"""ALP — "Just Enough Thinking" (Stanford & SynthLabs, 2025): a length penalty scaled by the group's solve rate.

Easy prompts (solved by most of their K rollouts) should be answered briefly, hard ones may think
long. ALP makes the reward group-aware:

    r = r_task − β · N · max(p_solved, 1/K),   p_solved = the share of the group's K rollouts that are correct,

floored at 1/K so an unsolved prompt still pays a slight penalty. N is the response length in
tokens, divided by `length_scale` if given (the summary is unclear whether the paper's N is the length
or the length over the budget; with `length_scale` = the budget, N = |y| / max_tokens). With a 0/1
task reward r_task is the paper's accuracy term; with a richer reward the penalty is subtracted
from it. K counts the group's valid samples; invalid samples keep their reward.

A sample is correct when `correct_head` (None: the scalar reward) is >= `solved_threshold`; a
missing head value (NaN) is not correct. Registered as kind "reward_shaping" (see `multi_reward.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_rl.algos.advantages import valid_mask
from mcore_rl.algos.multi_reward import group_index, group_moments, head_column, need
from mcore_rl.algos.registry import register
from mcore_rl.algos.thresholds import at_least


def alp_penalty(
    correct: torch.Tensor, lengths: torch.Tensor, group_ids: torch.Tensor, ok: torch.Tensor, beta: float
) -> torch.Tensor:
    """β · N · max(p_solved, 1/K) per sample [N] float64 (0 where not ok)."""
    inverse, k = group_index(group_ids)
    count, p_solved, _ = group_moments((correct & ok).double(), inverse, k, ok)
    rate = torch.maximum(p_solved, 1.0 / count.clamp_min(1))
    return torch.where(ok, beta * lengths.double() * rate[inverse], torch.zeros(()))


@register("reward_shaping", "alp")
def alp(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: torch.Tensor | None = None,
    head_names: Sequence[str] = (),
    lengths: torch.Tensor | None = None,
    seq_logp: torch.Tensor | None = None,
    beta: float = 1e-7,
    correct_head: str | None = None,
    solved_threshold: float = 1.0,
    length_scale: float | None = None,
) -> torch.Tensor:
    """The rewards minus ALP's penalty [N] float32. β = 1e-7 with N in tokens is the paper's larger
    setting (16K-token contexts); short-answer tasks need a larger β."""
    need(beta >= 0, "beta", f"must be >= 0, got {beta}")
    need(length_scale is None or length_scale > 0, "length_scale", f"must be null or > 0, got {length_scale}")
    ok = valid_mask(rewards, group_ids, valid)
    n = rewards.shape[0]
    if lengths is None or lengths.shape != (n,):
        got = None if lengths is None else tuple(lengths.shape)
        raise ValueError(f"alp needs the response lengths [{n}], got {got}")
    score = rewards.double() if correct_head is None else head_column(reward_heads, head_names, correct_head, n)
    correct = at_least(score, solved_threshold)  # NaN: not correct
    size = lengths.double() / (length_scale or 1.0)
    return (rewards.double() - alp_penalty(correct, size, group_ids, ok, beta)).to(torch.float32)
