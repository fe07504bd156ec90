"""POPD / TOPD — "Are Full Rollouts Necessary for On-Policy Distillation?" (CASIA, 2026).

Token-level OPD (γ = 0: each token's weight is its own log-ratio r_t = log π_T(y_t) - log π_θ(y_t),
no return-to-go, whose variance grows as O(T³) for noisy teachers) on a *prefix* of each rollout:
only the first H tokens are generated and distilled, because later teacher signal is unreliable
once the student drifts off the teacher's distribution.

* POPD grows the horizon on a step schedule, H_k = min(T, H_0 + ΔH·⌊k/Δk⌋);
* TOPD fixes it, H = ⌊ρ·T_max⌋ (ρ = 0.25 or 0.10 in the paper).

The horizon is not an option of the loss: it is `distill.horizon` in the config, because it also
cuts generation (the rollout manager asks for at most H new tokens) and the learner masks every
distillation term beyond it. This module holds the schedules (used by both) and the loss, which is
registered as "popd" and, for the fixed horizon, also as "topd".
"""

from __future__ import annotations

import math

import torch

from mcore_rl.algos.distill.base import DistillBatch, DistillTerms, phase
from mcore_rl.algos.policy_loss import masked_mean
from mcore_rl.algos.registry import register


def popd_horizon(step: int, h0: int, delta_h: int, delta_k: int, t_max: int) -> int:
    """POPD's growing horizon H_k = min(T, H_0 + ΔH·⌊k/Δk⌋) at training step k."""
    if delta_k < 1:
        raise ValueError(f"delta_k must be >= 1, got {delta_k}")
    return min(t_max, h0 + delta_h * (step // delta_k))


def topd_horizon(rho: float, t_max: int) -> int:
    """TOPD's fixed horizon ⌊ρ·T_max⌋ (at least one token); the epsilon keeps ⌊0.29·100⌋ = 29."""
    if not 0 < rho <= 1:
        raise ValueError(f"rho must be in (0, 1], got {rho}")
    return max(1, math.floor(rho * t_max + 1e-9))


def horizon_tokens(
    schedule: str,
    step: int,
    t_max: int,
    rho: float | None = None,
    tokens: int | None = None,
    h0: int = 0,
    delta_h: int = 0,
    delta_k: int = 1,
) -> int | None:
    """The horizon at `step` of schedule "none" (None: no cut), "fixed" (TOPD: `tokens`, or ρ·T_max)
    or "growing" (POPD)."""
    if schedule == "none":
        return None
    if schedule == "fixed":
        if tokens is not None:
            return min(tokens, t_max)
        if rho is None:
            raise ValueError('horizon schedule "fixed": needs tokens or rho')
        return topd_horizon(float(rho), t_max)
    if schedule == "growing":
        return popd_horizon(step, h0, delta_h, delta_k, t_max)
    raise ValueError(f"unknown horizon schedule {schedule!r}; expected none, fixed or growing")


def horizon_mask(num_positions: int, horizon: int | None) -> torch.Tensor:
    """[T] float: 1 on positions < H (all of them without a horizon)."""
    pos = torch.arange(num_positions)
    return (pos < (num_positions if horizon is None else horizon)).float()


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Â_t = Σ_{k≥t} γ^{k-t} r_k over the masked tokens of each row ([N, T]); γ=0 is r_t, γ=1 the
    suffix sum (the sequence-level OPD weight)."""
    r = rewards * mask.to(rewards.dtype)
    if gamma == 0.0:
        return r
    out = torch.zeros_like(r)
    acc = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        acc = r[:, t] + gamma * acc
        out[:, t] = acc
    return out * mask.to(rewards.dtype)


@register("distill", "popd")
@phase("advantage")
def popd(batch: DistillBatch, gamma: float = 0.0) -> DistillTerms:
    """Token advantage Σ_{k≥t} γ^{k-t} (log π_T(y_k) - log π_old(y_k)) on the distilled tokens
    (γ = 0, the paper's token-level form, by default). The horizon arrives as `batch.mask`."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    with torch.no_grad():
        m = batch.mask.to(batch.old_logp.dtype)
        r = batch.teacher_logp.detach() - batch.old_logp.detach()
        adv = discounted_returns(r, m, gamma)
        return DistillTerms(token_advantage=adv, metrics={"log_ratio": masked_mean(r, m), "distilled_tokens": m.sum()})


register("distill", "topd")(popd)  # TOPD: the same loss with `distill.horizon.schedule: fixed`
