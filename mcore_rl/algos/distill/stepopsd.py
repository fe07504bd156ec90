"""StepOPSD, "Step-Aware Online Preference Distillation for Agent Reinforcement Learning"
(Independent Researcher & Tencent, 2026): after rollout and reward, reshape the GRPO token
advantages with a stale self-teacher given hindsight (a successful peer trajectory of the group):

    w_raw = 2 σ(sign(A) · Δ),  w = clip(w_raw, 1 − α, 1 + α),  Ā = (1 − λ) A + λ · w · A

with Δ = log π_T − log π_S on the sampled token. Ā = Ψ·A with Ψ > 0, so the sign of every token's
advantage is kept: the student never imitates the teacher, the teacher only re-weights the RL
signal (up where it agrees with the advantage's direction). λ decays linearly to 0 (at step 50 by
default), after which the method only diagnoses.

Per-step rescaling (`step_scale: equal_step_mean_abs`, the paper's setting; its formula is not in
the summary, so this is our reading): each row — one step of a step-wise episode — has its
modification δ = Ā − A scaled so that its mean |δ| over its shaped tokens equals the mean of that
over the batch's rows, so a step with a long reply or a confident teacher does not take the whole
shaping. The scaled δ is then held to the unscaled method's bound |δ| ≤ λ·α·|A|, which keeps
Ā = Ψ·A with Ψ ∈ [1 − λα, 1 + λα] (the sign is kept, as without the rescaling).

The teacher is StepOPSD's when it is `teachers: [{kind: privileged, context: peer_episode,
refresh_interval: 10}]`: the policy of up to 10 rollout steps ago, shown the first successful peer
episode of the group (`train/teachers.py`).

The note author marks the paper "use with caution". Its step spans: `mask` marks the tokens to
shape and the others keep A; a domain's `environment.distill_span_tags: ["<action>", "</action>"]`
limits it to the model's tokens inside those tags ("action_only", `agent/spans.py`), else a step
sample's whole reply is shaped. "clean_step_no_observation" is what a conversation sample already
is: its observation tokens are not trained.

`weights: shuffled` is a control arm, not the method: the batch's weights w dealt to its tokens in a
random order (seeded by the rollout step), so the shaping has the method's sizes and keeps every sign
but no longer follows the teacher. The method against it separates the teacher's direction from a
perturbation of the same size (which alone sends a run down another sampled path).
"""

from __future__ import annotations

from typing import Literal

import torch

from mcore_rl.algos.distill._common import detached, masked_mean, rl_token_advantages, valid_tokens, zero_where_not
from mcore_rl.algos.distill.base import DistillBatch, DistillTerms, phase
from mcore_rl.algos.registry import register


def mix_schedule(step: int, lam_mix: float = 0.2, decay_steps: int | None = 50) -> float:
    """λ_mix at `step`: lam_mix at 0, linearly to 0 at decay_steps (constant if decay_steps is None)."""
    if decay_steps is None:
        return lam_mix
    if decay_steps <= 0:
        return 0.0
    return lam_mix * max(0.0, 1.0 - step / decay_steps)


def stepopsd_weight(
    gap: torch.Tensor,
    advantages: torch.Tensor,
    alpha_clip: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_raw, w) = (2σ(sign(A)Δ), clip(w_raw, 1 ± α)); A = 0 gives w_raw = 1 even for Δ = ±inf."""
    zero = torch.zeros((), dtype=gap.dtype, device=gap.device)
    signed = torch.where(advantages > 0, gap, torch.where(advantages < 0, -gap, zero))
    w_raw = 2.0 * torch.sigmoid(signed)
    return w_raw, w_raw.clamp(1.0 - alpha_clip, 1.0 + alpha_clip)


def equal_step_mean_abs(delta: torch.Tensor, ok: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """`delta` [n, T] with each row scaled to the same mean |δ| over its `ok` tokens (the mean over the
    rows that have any), then clamped to ±`bound` per token. Rows with no modification stay 0."""
    okf = ok.to(delta.dtype)
    per_row = (delta.abs() * okf).sum(1) / okf.sum(1).clamp_min(1)
    moved = per_row > 0
    if not bool(moved.any()):
        return delta
    target = per_row[moved].mean()
    scale = torch.where(moved, target / torch.where(moved, per_row, torch.ones_like(per_row)), torch.ones_like(per_row))
    return torch.minimum(torch.maximum(delta * scale[:, None], -bound), bound)


SHUFFLE_SALT = 7_001_003  # the control arm's permutations: seeded by SALT + the rollout step


def shuffled_weights(w: torch.Tensor, ok: torch.Tensor, step: int) -> torch.Tensor:
    """`w` with its values at the `ok` tokens permuted among them (the control arm's weights): the same
    multiset of weights, none tied to its token's teacher; reproducible per rollout step."""
    where = ok.nonzero(as_tuple=True)
    values = w[where]
    order = torch.randperm(values.numel(), generator=torch.Generator().manual_seed(SHUFFLE_SALT + step))
    out = w.clone()
    out[where] = values[order.to(values.device)]
    return out


@register("distill", "stepopsd")
@phase("advantage")
def stepopsd(
    batch: DistillBatch,
    *,
    lam_mix: float = 0.2,
    alpha_clip: float = 0.2,
    decay_steps: int | None = 50,
    step_scale: Literal["equal_step_mean_abs", "none"] = "equal_step_mean_abs",
    weights: Literal["teacher", "shuffled"] = "teacher",
) -> DistillTerms:
    """token_advantage = Ā − A = λ(step) · (w − 1) · A on the masked tokens with a finite teacher
    log-prob, rescaled per step (row) by `step_scale`. Defaults are the paper's (α = 0.2, λ = 0.2 → 0
    at step 50); its best settings were α = 0.05 with λ = 0.2 (ALFWorld) or 0.05 (Search-QA)."""
    with torch.no_grad():
        student = detached(batch.student_logp)
        teacher = detached(batch.teacher_logp)
        ok = valid_tokens(batch, student, teacher)
        adv = rl_token_advantages(batch, student)
        lam = mix_schedule(batch.step, lam_mix, decay_steps)
        gap = zero_where_not(ok, teacher) - zero_where_not(ok, student)
        w_raw, w = stepopsd_weight(gap, adv, alpha_clip)
        if weights == "shuffled":
            w = shuffled_weights(w, ok, batch.step)
        delta = zero_where_not(ok, lam * (w - 1.0) * adv)
        if step_scale == "equal_step_mean_abs":
            delta = zero_where_not(ok, equal_step_mean_abs(delta, ok, lam * alpha_clip * adv.abs()))
        metrics = {
            "stepopsd/lambda": torch.tensor(lam),
            "stepopsd/weight_mean": masked_mean(w, ok),
            "stepopsd/clip_frac": masked_mean((w != w_raw).float(), ok),
            "stepopsd/gap_mean": masked_mean(gap, ok),
        }
    return DistillTerms(token_advantage=delta, metrics=metrics)
