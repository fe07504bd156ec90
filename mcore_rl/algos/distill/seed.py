"""SEED — "Self-Evolving On-Policy Distillation for Agentic Reinforcement Learning" (THU, ZJU,
Tongji, 2026): gated self-distillation.

The teacher is the policy itself with privileged context (a hindsight skill inserted into the
history): ℓ^skill = log π_θ(a | h̃) is scored with the skill (stop-gradient), ℓ^θ = log π_θ(a | h)
without. The loss is a sigmoid-gated likelihood term on the sampled tokens,
    L_opd = E[m · g · (sg[ℓ^skill] - ℓ^θ)],   g = σ(β · sg[ℓ^skill - ℓ^θ]),
so ∇L_opd = -E[m g ∇ℓ^θ]: tokens the skill makes likelier are pulled up harder. It is added to the
GRPO loss with λ_opd (the loss's `coef` in the config; the paper's 0.01 when it gives none), so it still moves the
policy when a group's advantages are all 0. Here `teacher_logp` holds ℓ^skill (the privileged-context
teacher of `train/teachers.py`) and `student_logp` is ℓ^θ. A token whose ℓ^skill is not finite (no
skill for its sample, padding) takes no part: its value is replaced by 0 before any arithmetic, so
a -inf or NaN there cannot turn the loss into NaN (0 · inf is NaN, and a mask multiplies too late).
On multi-turn episodes the skill is what the environment gives (`privileged/*` in `Sample.info`,
`teachers[i].context: info`).
"""

from __future__ import annotations

import torch

from mcore_rl.algos.distill._common import loss_sum, masked_mean, valid_tokens, zero_where_not
from mcore_rl.algos.distill.base import DistillBatch, DistillTerms, default_coef, phase
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
    ok = valid_tokens(batch, batch.student_logp, batch.teacher_logp)
    student = zero_where_not(ok, batch.student_logp)
    skill = zero_where_not(ok, batch.teacher_logp.detach().to(student.dtype))
    g = zero_where_not(ok, seed_gate(skill, student, beta))
    return DistillTerms(
        loss_sum=loss_sum(skill - student, g, batch),
        metrics={
            "gate_mean": masked_mean(g, ok),
            "shift_mean": masked_mean(skill - student.detach(), ok),
        },
    )
