"""Entropy bonus: subtract α·H(π_θ(·|s_t)) from the loss to keep exploration alive.

H is the full-vocabulary entropy per position (`train.logprobs` computes it without
materialising the logits); it is a loss *term*, so it comes back as (sum, count) like the others.
"""

from __future__ import annotations


import torch

from mcore_rl.algos.policy_loss import aggregate
from mcore_rl.algos.registry import register


@register("entropy", "bonus")
def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    agg: str = "token-mean",
    norm_length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(-coef · Σ H, count) to be added to the loss: minimising it raises the entropy."""
    total, count = aggregate(entropy, mask, agg, norm_length)
    return -coef * total, count
