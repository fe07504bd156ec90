"""Reverse-KL on-policy distillation as an advantage term (K1), as slime and NeMo-RL do it.

The student samples y ~ π_old; each sampled token gets the advantage
    A_t = -(log π_old(y_t) - log π_T(y_t)),
the negated K1 estimate of KL(π_old || π_T) at that token. A policy gradient with this advantage
descends the reverse KL to the teacher (mode seeking: the student is pushed off tokens the
teacher finds unlikely). It is computed once per batch, without gradient; the learner adds
`coef · A_t` to the RL advantage (slime: Â_t = A_t − λ(log π_θ − log π_T)), or uses it alone.
"""

from __future__ import annotations


import torch

from mcore_rl.algos.distill.base import DistillBatch, DistillTerms, phase
from mcore_rl.algos.policy_loss import masked_mean
from mcore_rl.algos.registry import register


@register("distill", "reverse_kl")
@phase("advantage")
def reverse_kl(batch: DistillBatch, clip: float | None = None) -> DistillTerms:
    """Token advantage log π_T(y_t) - log π_old(y_t) on the distilled tokens (0 elsewhere);
    `clip` bounds |A_t| (off by default, as in slime)."""
    with torch.no_grad():
        log_ratio = batch.teacher_logp.detach() - batch.old_logp.detach()
        adv = log_ratio if clip is None else log_ratio.clamp(-clip, clip)
        m = batch.mask.to(adv.dtype)
        return DistillTerms(
            token_advantage=adv * m,
            metrics={"k1": masked_mean(-log_ratio, m), "teacher_logp": masked_mean(batch.teacher_logp, m)},
        )
