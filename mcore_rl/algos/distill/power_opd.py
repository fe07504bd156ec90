"""PowerOPD — "Stabilizing On-Policy Distillation with Bounded Power Transformation" (EIT Ningbo,
HK PolyU, SJTU, 2026).

Sampled-token OPD with the log-ratio token reward log π_T - log π_θ replaced by the bounded,
sign-consistent power difference r^α_t = sg[π_T(y_t)^α - π_θ(y_t)^α] ∈ [-1, 1] (a Box-Cox transform
of both probabilities, then the difference; the 1/α is absorbed into the learning rate). The log
ratio is unbounded below, so a few tokens the teacher finds near-impossible dominate vanilla OPD's
gradient; the power difference cannot. As α → 0, (p^α - q^α)/α → log p - log q recovers OPD.
The paper sweeps α from 0.1 to 500 (larger was better); the default here is 1.
"""

from __future__ import annotations

import torch

from mcore_rl.algos.distill.base import DistillBatch, DistillTerms, phase
from mcore_rl.algos.policy_loss import masked_mean
from mcore_rl.algos.registry import register


def power_reward(
    teacher_logp: torch.Tensor, student_logp: torch.Tensor, alpha: float, normalize: bool = False
) -> torch.Tensor:
    """π_T^α - π_θ^α from log-probs, as expm1(α log p) - expm1(α log q) (exact for tiny α);
    divided by α when `normalize` (then α → 0 gives the log-ratio). No gradient."""
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    with torch.no_grad():
        r = torch.expm1(alpha * teacher_logp.detach()) - torch.expm1(alpha * student_logp.detach())
        return r / alpha if normalize else r


@register("distill", "power_opd")
@phase("advantage")
def power_opd(batch: DistillBatch, alpha: float = 1.0, normalize: bool = False) -> DistillTerms:
    """Token advantage sg[π_T(y_t)^α - π_old(y_t)^α] on the distilled tokens."""
    m = batch.mask.to(batch.old_logp.dtype)
    r = power_reward(batch.teacher_logp, batch.old_logp, alpha, normalize) * m
    return DistillTerms(
        token_advantage=r, metrics={"reward_mean": masked_mean(r, m), "reward_abs_mean": masked_mean(r.abs(), m)}
    )
