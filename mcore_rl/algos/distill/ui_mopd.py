"""UI-MOPD, "UI-MOPD: Multi-Platform On-Policy Distillation for Continual GUI Agent Learning" (THU &
Xiaomi & HIT & ZJH, 2026): the policy gradient plus β times a sampled-token K3 estimate of
KL(π_θ ‖ π_ref^(i)), π_ref^(i) the teacher of the sample's platform (`teachers[j].domains`: the
routing by domain of `train/teachers.py`), switched off for a whole prompt group that already does
well:

    δ_t = log π_ref(y_t) − log π_θ(y_t),   K3_t = e^δ_t − δ_t − 1 >= 0,
    μ^(i) = 0 if mean_{k in g(i)} R^(k) > τ_KL else 1 (strict: a mean equal to τ keeps the KL),
    L_MOPD = Agg(μ · K3),   ∇_θ K3_t = (1 − e^δ_t) ∇ log π_θ(y_t).

Phase "loss", added to the policy loss with the entry's `coef` (β; the paper's 0.01 when omitted).
The group mean comes from `DistillBatch.group_mean_reward` (the learner's, over the whole group, so a
group split over micro-batches is masked alike), else from `rewards` within `group_ids`. τ_KL is not
given in the paper: `tau_kl: null` (the default) never masks. The paper's mean-only advantage is
`algorithm.advantage_std_normalize: false`; its structured action-match reward is a task's, not this
term's. A token whose teacher log-prob is not finite takes no part.
"""

from __future__ import annotations

import torch

from mcore_rl.algos.distill._common import loss_sum, masked_mean, valid_tokens, zero_where_not
from mcore_rl.algos.distill.base import DistillBatch, DistillTerms, default_coef, group_mean, phase
from mcore_rl.algos.registry import register


def k3(teacher_logp: torch.Tensor, student_logp: torch.Tensor) -> torch.Tensor:
    """e^δ − δ − 1 with δ = teacher − student: >= 0, 0 exactly where they agree (gradient to both)."""
    delta = teacher_logp - student_logp
    return torch.expm1(delta) - delta


def group_mean_rewards(batch: DistillBatch) -> torch.Tensor:
    """[n] the mean reward of each sample's prompt group (the learner's, else over this batch)."""
    if batch.group_mean_reward is not None:
        return batch.group_mean_reward.double()
    if batch.rewards is None or batch.group_ids is None:
        raise ValueError("distill 'ui_mopd' with tau_kl needs the group mean reward (or rewards and group_ids)")
    return group_mean(batch.rewards, batch.group_ids).double()


def kl_gate(batch: DistillBatch, tau_kl: float | None) -> torch.Tensor:
    """[n] μ: 0 for a sample whose group's mean reward is > τ_KL, else 1 (all 1 when τ is None)."""
    n = batch.student_logp.shape[0]
    if tau_kl is None:
        return torch.ones(n, dtype=torch.float64)
    return (group_mean_rewards(batch) <= tau_kl).double()


@register("distill", "ui_mopd")
@phase("loss")
@default_coef(0.01)  # β
def ui_mopd(batch: DistillBatch, *, tau_kl: float | None = None) -> DistillTerms:
    """loss_sum = Σ_agg μ·K3 (the learner multiplies it by the entry's coef = β, 0.01 when omitted)."""
    ok = valid_tokens(batch, batch.student_logp, batch.teacher_logp)
    student = zero_where_not(ok, batch.student_logp)
    teacher = zero_where_not(ok, batch.teacher_logp.detach().to(student.dtype))
    mu = kl_gate(batch, tau_kl).to(student.dtype)
    weight = zero_where_not(ok, mu[:, None].expand_as(student))
    est = k3(teacher, student)
    return DistillTerms(
        loss_sum=loss_sum(est, weight, batch),
        metrics={
            "ui_mopd/k3_mean": masked_mean(est, ok),
            "ui_mopd/kl_on_frac": masked_mean(weight, ok),
        },
    )
