"""SEED — "Self-Evolving On-Policy Distillation for Agentic Reinforcement Learning" (THU, ZJU,
Tongji, 2026): gated self-distillation.

The teacher is the policy itself with privileged context (a hindsight skill inserted into the
history): ℓ^skill = log π_θ(a | h̃) is scored with the skill (stop-gradient), ℓ^θ = log π_θ(a | h)
without. The loss is a sigmoid-gated likelihood term on the sampled tokens,
    L_opd = E[m · g · (sg[ℓ^skill] - ℓ^θ)],   g = σ(β · sg[ℓ^skill - ℓ^θ]),
so ∇L_opd = -E[m g ∇ℓ^θ]: tokens the skill makes likelier are pulled up harder. It is added to the
GRPO loss with λ_opd (the loss's `coef` in the config; the paper's 0.01 when it gives none), so it still moves the
policy when a group's advantages are all 0. Here `teacher_logp` holds ℓ^skill (the privileged-context
teacher of `train/teachers.py`) and `student_logp` is ℓ^θ.
"""

from __future__ import annotations

import torch

from mcore_rl.algos.distill.base import DistillBatch, DistillTerms, default_coef, phase
from mcore_rl.algos.policy_loss import aggregate, masked_mean
from mcore_rl.algos.registry import register


def seed_gate(teacher_logp: torch.Tensor, student_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """g = σ(β · sg[ℓ^skill - ℓ^θ]) ∈ (0, 1), without gradient."""
    with torch.no_grad():
        return torch.sigmoid(beta * (teacher_logp.detach() - student_logp.detach()))


@register("distill", "seed")
@phase("loss")
@default_coef(0.01)  # λ_opd
def seed(batch: DistillBatch, beta: float = 5.0) -> DistillTerms:
    """Loss Σ_t m g (sg[ℓ^skill] - ℓ^θ), aggregated like the policy loss; β (the paper's β_opd = 5)
    is the gate's sharpness."""
    skill = batch.teacher_logp.detach()
    g = seed_gate(skill, batch.student_logp, beta)
    per_token = g * (skill - batch.student_logp)
    loss_sum, _ = aggregate(per_token, batch.mask, batch.agg, batch.norm_length)
    return DistillTerms(
        loss_sum=loss_sum,
        metrics={
            "gate_mean": masked_mean(g, batch.mask),
            "shift_mean": masked_mean(skill - batch.student_logp.detach(), batch.mask),
        },
    )
