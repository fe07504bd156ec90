"""Direct-OPD — "Weak-to-Strong Generalization via Direct On-Policy Distillation" (Seed, 2026).

The student distils a teacher's *RL-induced shift*, not its policy: the token reward is
r_t(v) = log π_T(v|s_t) - log π_Tref(v|s_t), the post-RL teacher against its own pre-RL reference,
on the student's own prefixes. The gradient is the analytic (Rao-Blackwellised) top-k policy
gradient Σ_{v∈S_t} A^w_t(v) ∇log π_θ(v|s_t) with stop-gradient weights A^w_t(v) = sg(p̄_t(v) r_t(v)),
p̄_t the student's probabilities renormalised on S_t; a KL to the student's initial weights (the
learner's reference model, `algorithm.kl_coef`) anchors it, with a sign-based adaptive coefficient
(`adapt_alpha`, ε = 0.01, α ∈ [0.5, 2.5]).

Candidate set: the paper takes S_t = the student's top-k. Here S_t is the teacher's top-k ids
(`TeacherScores.topk_ids`, with the reference teacher's log-probs of the same ids in
`ref_topk_logp`), because scores for candidate ids come from the teacher engines and the ids must
be fixed before the student's forward; the estimator is the same on any fixed candidate set.
"""

from __future__ import annotations

import torch

from mcore_rl.algos.distill.base import TOPK_FIELDS, DistillBatch, DistillTerms, needs, phase
from mcore_rl.algos.policy_loss import aggregate, masked_mean
from mcore_rl.algos.registry import register


def sequence_shift(teacher_logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Δ_T(y|x) = Σ_t r_t(y_t) = log π_T(y|x) - log π_Tref(y|x), per sequence [N]."""
    return ((teacher_logp - ref_logp) * mask.to(teacher_logp.dtype)).sum(-1)


def adapt_alpha(alpha: float, shift_mean: float, eps: float = 0.01, alpha_min: float = 0.5,
                alpha_max: float = 2.5) -> float:
    """α_{m+1} = clip(α_m (1 + ε·sign(r̄_m)), α_min, α_max): a positive mean shift strengthens the
    anchor, a negative one weakens it."""
    sign = (shift_mean > 0) - (shift_mean < 0)
    return min(max(alpha * (1.0 + eps * sign), alpha_min), alpha_max)


def shift_weights(student_topk_logp: torch.Tensor, teacher_topk_logp: torch.Tensor,
                  ref_topk_logp: torch.Tensor) -> torch.Tensor:
    """A^w_t(v) = sg(p̄_t(v) · r_t(v)) on the candidate set, [N, T, k]."""
    with torch.no_grad():
        p_bar = torch.softmax(student_topk_logp.detach(), dim=-1)
        return p_bar * (teacher_topk_logp.detach() - ref_topk_logp.detach())


@register("distill", "direct_opd")
@phase("loss")
@needs(*TOPK_FIELDS, "teacher_ref_topk_logp")
def direct_opd(batch: DistillBatch) -> DistillTerms:
    """Loss Σ_t -Σ_{v∈S_t} A^w_t(v) log π_θ(v|s_t), aggregated like the policy loss."""
    need = {"student_topk_logp": batch.student_topk_logp, "teacher_topk_logp": batch.teacher_topk_logp,
            "teacher_ref_topk_logp": batch.teacher_ref_topk_logp}
    missing = [k for k, v in need.items() if v is None]
    if missing:
        raise ValueError(f"direct_opd needs {', '.join(missing)} (set distill.top_k > 0 and a teacher with a reference)")
    w = shift_weights(batch.student_topk_logp, batch.teacher_topk_logp, batch.teacher_ref_topk_logp)
    per_token = -(w * batch.student_topk_logp).sum(-1)
    loss_sum, _ = aggregate(per_token, batch.mask, batch.agg, batch.norm_length)
    return DistillTerms(loss_sum=loss_sum, metrics={"shift_mean": masked_mean(w.sum(-1), batch.mask)})
