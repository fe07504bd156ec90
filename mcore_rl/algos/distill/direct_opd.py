"""Direct-OPD — "Weak-to-Strong Generalization via Direct On-Policy Distillation" (Seed, 2026).

The student distils a teacher's *RL-induced shift*, not its policy: the token reward is
r_t(v) = log π_T(v|s_t) - log π_Tref(v|s_t), the post-RL teacher against its own pre-RL reference,
on the student's own prefixes. The objective is E_{y∼π_θ}[Δ_T(y|x)] − α·KL(π_θ ‖ π_S); its gradient
is the analytic (Rao-Blackwellised) top-k policy gradient Σ_{v∈S_t} A^w_t(v) ∇log π_θ(v|s_t) with
stop-gradient weights A^w_t(v) = sg(p̄_t(v) r_t(v)), p̄_t the student's probabilities renormalised
on S_t, minus α ∇KL to the student's starting weights π_S (the learner's reference model,
`algorithm.reference_model`).

The KL is part of this term, not the learner's `algorithm.kl_coef` (validation refuses a second,
fixed KL beside it; `adaptive: false` fixes α instead): α adapts from batch to batch
with the sign of the batch's student-weighted shift mean r̄_m = mean_t Σ_{v∈S_t} p̄_t(v) r_t(v),
α_{m+1} = clip(α_m (1 + ε·sign(r̄_m)), α_min, α_max) (ε = 0.01, [0.5, 2.5]; α₀ is not given: 1).
`AdaptiveKL` is that controller, the term's state: r̄_m is measured once per rollout batch at π_old
(`start_batch`), batch m trains with α_m, and α with the last r̄ is saved in the checkpoints, so a
resumed run continues with the same weights. The KL is estimated on the sampled tokens with the
learner's estimators (`kl_estimator`, k3 by default) and aggregated like the policy loss.

Candidate set: the paper takes S_t = the student's top-k. Here S_t is the teacher's top-k ids
(`TeacherScores.topk_ids`, with the reference teacher's log-probs of the same ids in
`ref_topk_logp`), because scores for candidate ids come from the teacher engines and the ids must
be fixed before the student's forward; the estimator is the same on any fixed candidate set.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mcore_rl.algos.distill.base import (
    TOPK_FIELDS,
    DistillBatch,
    DistillTerms,
    needs,
    own_kl,
    phase,
    stateful,
)
from mcore_rl.algos.kl import kl_estimate
from mcore_rl.algos.policy_loss import aggregate, masked_mean
from mcore_rl.algos.registry import register

KL_ESTIMATORS = ("k1", "k2", "k3")


def sequence_shift(teacher_logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Δ_T(y|x) = Σ_t r_t(y_t) = log π_T(y|x) - log π_Tref(y|x), per sequence [N]."""
    return ((teacher_logp - ref_logp) * mask.to(teacher_logp.dtype)).sum(-1)


def adapt_alpha(
    alpha: float, shift_mean: float, eps: float = 0.01, alpha_min: float = 0.5, alpha_max: float = 2.5
) -> float:
    """α_{m+1} = clip(α_m (1 + ε·sign(r̄_m)), α_min, α_max): a positive mean shift strengthens the
    anchor, a negative one weakens it."""
    sign = (shift_mean > 0) - (shift_mean < 0)
    return min(max(alpha * (1.0 + eps * sign), alpha_min), alpha_max)


def shift_weights(
    student_topk_logp: torch.Tensor, teacher_topk_logp: torch.Tensor, ref_topk_logp: torch.Tensor
) -> torch.Tensor:
    """A^w_t(v) = sg(p̄_t(v) · r_t(v)) on the candidate set, [N, T, k]."""
    with torch.no_grad():
        p_bar = torch.softmax(student_topk_logp.detach(), dim=-1)
        return p_bar * (teacher_topk_logp.detach() - ref_topk_logp.detach())


def _topk_inputs(batch: DistillBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    need = {
        "student_topk_logp": batch.student_topk_logp,
        "teacher_topk_logp": batch.teacher_topk_logp,
        "teacher_ref_topk_logp": batch.teacher_ref_topk_logp,
    }
    missing = [k for k, v in need.items() if v is None]
    if missing:
        raise ValueError(
            f"direct_opd needs {', '.join(missing)} (set distill.top_k > 0 and a teacher with a reference)"
        )
    return batch.student_topk_logp, batch.teacher_topk_logp, batch.teacher_ref_topk_logp  # type: ignore[return-value]  # the check above refused a None; mypy does not narrow through the dict


def batch_shift_mean(batch: DistillBatch) -> float:
    """r̄: the mean over the batch's distilled tokens of Σ_{v∈S_t} p̄_t(v) r_t(v) (0 when none)."""
    s, t, r = _topk_inputs(batch)
    return float(masked_mean(shift_weights(s, t, r).sum(-1), batch.mask))


class AdaptiveKL:
    """Direct-OPD's KL weight α across batches (the term's `@stateful` state).

    `start_batch` applies the previous batch's r̄ (α_m = clip(α_{m−1}(1 + ε·sign r̄_{m−1}))) and
    keeps this batch's for the next, so batch m trains with α_m whether or not the run was resumed
    in between. `adaptive=False` keeps α = α₀."""

    def __init__(
        self,
        alpha: float = 1.0,
        adaptive: bool = True,
        eps: float = 0.01,
        alpha_min: float = 0.5,
        alpha_max: float = 2.5,
    ) -> None:
        bad = [
            (k, v)
            for k, v in (("alpha", alpha), ("eps", eps), ("alpha_min", alpha_min), ("alpha_max", alpha_max))
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0)
        ]
        if bad:
            raise ValueError(f"distill 'direct_opd': options.{bad[0][0]} must be a number >= 0, got {bad[0][1]!r}")
        if alpha_min > alpha_max:
            raise ValueError(f"distill 'direct_opd': options.alpha_min ({alpha_min}) is above alpha_max ({alpha_max})")
        if not isinstance(adaptive, bool):
            raise ValueError(f"distill 'direct_opd': options.adaptive must be true or false, got {adaptive!r}")
        self.alpha = float(alpha)
        self.adaptive, self.eps, self.alpha_min, self.alpha_max = (
            adaptive,
            float(eps),
            float(alpha_min),
            float(alpha_max),
        )
        self.last_shift: float | None = None  # r̄ of the last batch, applied at the next one

    def start_batch(self, batch: DistillBatch) -> dict[str, torch.Tensor]:
        """One rollout batch at π_old: α for this batch, and r̄ kept for the next. Metrics."""
        shift = batch_shift_mean(batch)
        if self.adaptive and self.last_shift is not None:
            self.alpha = adapt_alpha(self.alpha, self.last_shift, self.eps, self.alpha_min, self.alpha_max)
        self.last_shift = shift
        return {
            "alpha": torch.tensor(self.alpha, dtype=torch.float64),
            "shift_mean": torch.tensor(shift, dtype=torch.float64),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "last_shift": self.last_shift}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.alpha = float(state["alpha"])
        self.last_shift = None if state["last_shift"] is None else float(state["last_shift"])


@register("distill", "direct_opd")
@phase("loss")
@needs(*TOPK_FIELDS, "teacher_ref_topk_logp", "student_ref_logp")
@own_kl
@stateful(AdaptiveKL)
def direct_opd(
    batch: DistillBatch,
    *,
    alpha: float = 1.0,
    adaptive: bool = True,
    eps: float = 0.01,
    alpha_min: float = 0.5,
    alpha_max: float = 2.5,
    kl_estimator: str = "k3",
    state: AdaptiveKL | None = None,
) -> DistillTerms:
    """Loss Σ_t [−Σ_{v∈S_t} A^w_t(v) log π_θ(v|s_t) + α·KL_t(π_θ ‖ π_S)], aggregated like the policy loss.

    α is `state.alpha` (the learner's `AdaptiveKL`, which `alpha`, `adaptive`, `eps`, `alpha_min`
    and `alpha_max` configure) or, called without a state, `alpha` itself. `alpha: 0` drops the
    KL; otherwise `batch.student_ref_logp` (π_S's log-probs of the sampled tokens) is required."""
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(
            f"distill 'direct_opd': options.kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, "
            f"got {kl_estimator!r}"
        )
    student_topk, teacher_topk, ref_topk = _topk_inputs(batch)
    w = shift_weights(student_topk, teacher_topk, ref_topk)
    per_token = -(w * student_topk).sum(-1)
    a = float(alpha if state is None else state.alpha)
    metrics = {"shift_mean": masked_mean(w.sum(-1), batch.mask), "alpha": torch.tensor(a, dtype=torch.float64)}
    if a != 0:
        if batch.student_ref_logp is None:
            raise ValueError(
                "distill 'direct_opd' needs DistillBatch.student_ref_logp for its KL to the student's "
                "starting weights (algorithm.reference_model: true), or options.alpha: 0"
            )
        ok = (batch.mask > 0) & torch.isfinite(batch.student_ref_logp) & torch.isfinite(batch.student_logp)
        zero = torch.zeros((), dtype=batch.student_logp.dtype, device=batch.student_logp.device)
        kl = torch.where(
            ok,
            kl_estimate(
                torch.where(ok, batch.student_logp, zero),
                torch.where(ok, batch.student_ref_logp.to(zero.dtype), zero),
                kl_estimator,
            ),
            zero,
        )
        per_token = per_token + a * kl
        metrics["kl"] = masked_mean(kl.detach(), batch.mask)
    loss_sum, _ = aggregate(per_token, batch.mask, batch.agg, batch.norm_length)
    return DistillTerms(loss_sum=loss_sum, metrics=metrics)
