"""SDAR, "Self-Distilled Agentic Reinforcement Learning" (LongCat & THU, 2026): GRPO plus a gated
self-distillation loss,

    L = L_GRPO + λ_SDAR · Agg(g_t · (log π_T(y_t) − log π_θ(y_t))),   g_t = sg[σ(β · Δ_t)]

with π_T the same model given privileged context (retrieved skills) and Δ_t = log π_T − log π_θ
on the sampled token. The gradient is −λ·Agg(g_t ∇ log π_θ): a weighted maximum-likelihood push
toward tokens the teacher endorses more than the student does, while tokens the teacher rejects
(Δ_t < 0) are mostly gated off ("asymmetric trust"). The gate is stop-gradient: without it a
self-referential term β Δ g (1 − g) appears and destabilises training.

Phase "loss": computed per micro-batch on the differentiable student log-probs, aggregated like
the policy loss, and added to it. λ_SDAR is the loss entry's `coef`, the one weight every
distillation term has; an entry without `coef` gets the paper's 0.01 (`@default_coef`). The
function has no weight of its own, so nothing multiplies λ a second time.
"""

from __future__ import annotations

import torch

from mcore_rl.algos.distill._common import loss_sum, masked_mean, require, valid_tokens, zero_where_not
from mcore_rl.algos.distill.base import DistillBatch, DistillTerms, default_coef, phase
from mcore_rl.algos.registry import register

GATES = ("gap", "entropy", "soft_or")


def sdar_gate(gap: torch.Tensor, beta: float = 5.0) -> torch.Tensor:
    """The default gap gate σ(β Δ): 0.5 at Δ = 0, in (0, 1), slope at most β/4."""
    return torch.sigmoid(beta * gap)


@register("distill", "sdar")
@phase("loss")
@default_coef(0.01)  # λ_SDAR
def sdar(batch: DistillBatch, *, beta: float = 5.0, gate: str = "gap") -> DistillTerms:
    """loss_sum = Σ_agg g_t (log π_T − log π_θ), g_t and π_T detached (the learner multiplies it
    by the entry's coef = λ_SDAR, 0.01 when the entry gives none).

    Gates: "gap" σ(βΔ) (the default and the paper's best), "entropy" σ(β h_t) and "soft_or"
    σ(β[1 − (1 − h_t)(1 − Δ_t)]), h_t the student's entropy (`batch.student_entropy`). The default
    β = 5 is the paper's. A token whose teacher log-prob is not finite gets g_t → 0 in the limit
    and contributes nothing."""
    if gate not in GATES:
        raise ValueError(f"distill 'sdar': unknown gate {gate!r}; expected one of {', '.join(GATES)}")
    ok = valid_tokens(batch, batch.student_logp, batch.teacher_logp)
    student = zero_where_not(ok, batch.student_logp)
    teacher = zero_where_not(ok, batch.teacher_logp.detach().to(student.dtype))
    gap_live = teacher - student
    with torch.no_grad():
        gap = gap_live.detach()
        if gate == "gap":
            g = sdar_gate(gap, beta)
        else:
            h = zero_where_not(ok, require(batch, "student_entropy", "sdar").detach().to(gap.dtype))
            g = torch.sigmoid(beta * (h if gate == "entropy" else 1.0 - (1.0 - h) * (1.0 - gap)))
        g = zero_where_not(ok, g)
    total = loss_sum(gap_live, g, batch)
    metrics = {
        "sdar/gate_mean": masked_mean(g, ok),
        "sdar/gate_open_frac": masked_mean((g > 0.5).float(), ok),
        "sdar/gap_mean": masked_mean(gap, ok),
    }
    return DistillTerms(loss_sum=total, metrics=metrics)
