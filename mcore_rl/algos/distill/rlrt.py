"""RLRT, "Rebellious Student: Reversing Teacher Signals for Reasoning Exploration with Self-Distilled
RLVR" (Microsoft & KAIST, 2026): GRPO whose token advantages on *correct* rollouts are rescaled by

    A_t = A · [(1 - λ) + λ · clip(w_t, 1 - ε_w, 1 + ε_w)],   w_t = (P_S(y_t) / P_T(y_t))^sign(A)

where P_T is the same model with a correct solution in its prompt (a privileged self-teacher).
Tokens the student likes more than the teacher ("wait", "another") gain weight, tokens the teacher
pushes ("final", "conclude") lose it: the exact inverse of RLSD's weight. Incorrect rollouts keep
the plain GRPO advantage (without this reward gate training collapses, the paper's "RLRT-all").

The weight is an advantage coefficient, computed once per batch without gradient (phase
"advantage"); the function returns the change A_t − A, which the learner adds to the RL advantage.
"""

from __future__ import annotations


import torch

from mcore_rl.algos.distill._common import (
    detached,
    masked_mean,
    require,
    rl_token_advantages,
    valid_tokens,
    zero_where_not,
)
from mcore_rl.algos.distill.base import DistillBatch, DistillTerms, phase
from mcore_rl.algos.registry import register
from mcore_rl.algos.thresholds import at_least


def _signed_log_weight(log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """sign(A) · log_ratio, written so that A = 0 gives 0 even where log_ratio is ±inf."""
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    return torch.where(advantages > 0, log_ratio, torch.where(advantages < 0, -log_ratio, zero))


def rlrt_weight(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_w: float | None = None,
) -> torch.Tensor:
    """w_t = exp(sign(A) · (log P_S − log P_T)), clipped to [1 − ε_w, 1 + ε_w] unless eps_w is None."""
    w = torch.exp(_signed_log_weight(student_logp - teacher_logp, advantages))
    return w if eps_w is None else w.clamp(1.0 - eps_w, 1.0 + eps_w)


def rlsd_weight(student_logp: torch.Tensor, teacher_logp: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """RLSD's weight (P_T / P_S)^sign(A), unclipped: the inverse of RLRT's (for comparison)."""
    return torch.exp(_signed_log_weight(teacher_logp - student_logp, advantages))


@register("distill", "rlrt")
@phase("advantage")
def rlrt(
    batch: DistillBatch,
    *,
    lam: float = 0.5,
    eps_w: float = 1.0,
    success_threshold: float = 1.0,
) -> DistillTerms:
    """token_advantage = A · λ · (clip(w_t) − 1) on the tokens of rollouts with reward ≥
    `success_threshold` (r = 1 for a 0/1 verifier), 0 elsewhere.

    Defaults: the paper's best ε_w is model-dependent (Base 1.0, Instruct 0.5, Thinking 0.2) and
    larger is better for base models, so 1.0; λ is not reported, 0.5 (the summary's worked example).
    `teacher_logp` must come from the privileged self-teacher (prompt + a correct solution)."""
    rewards = require(batch, "rewards", "rlrt")
    with torch.no_grad():
        student = detached(batch.student_logp)
        teacher = detached(batch.teacher_logp)
        correct = at_least(rewards.to(batch.mask.device), success_threshold)
        ok = valid_tokens(batch, student, batch.teacher_logp) & correct[:, None]
        adv = rl_token_advantages(batch, student)
        s, t = zero_where_not(ok, student), zero_where_not(ok, teacher)
        w = rlrt_weight(s, t, adv, eps_w)
        delta = zero_where_not(ok, adv * lam * (w - 1.0))
        metrics = {
            "rlrt/weight_mean": masked_mean(w, ok),
            "rlrt/clip_frac": masked_mean((rlrt_weight(s, t, adv) != w).float(), ok),
            "rlrt/gated_frac": masked_mean(ok.float(), batch.mask > 0),
        }
    return DistillTerms(token_advantage=delta, metrics=metrics)
