"""MIPU — "The Mirage of Optimizing Training Policies: Monotonic Inference Policies as the Real
Objective for LLM RL" (TJU & Alibaba, 2026); spec in `reference/seed_C.md`.

What matters is the improvement of the *inference* policy μ (the engine), not of the trainer's π.

Step 1 (decoupled update): the PPO clip acts only on r = π_θ/π_k (π_k: the trainer's recomputed
log-probs of the pre-update weights) and the whole term is multiplied by the constant, truncated
mismatch weight w̄ = min(π_k/μ_k, w_max), w_max = 2, ε = 0.2. Clipping π_θ/μ_k directly would let
the pre-update mismatch trigger the clip even when r ≈ 1. Whether w̄ and r are per token or per
sequence is unclear in the notes; both are offered (`level`), per token by default.

Step 2 (accept/reject): after the candidate weights are synced to the engine, sample a validation
batch from it (μ_{k+1}), recompute π_{k+1} on it and form
  T̂_post = -mean_i(ρ_i Â_i),   ρ_i = exp((1/T_i) Σ_t log π_{k+1}/μ_{k+1})  (length-normalised),
with Â the group-relative advantages of the validation groups. Accept if T̂_post ≥ -c_t, with c_t
annealed linearly from c_start to c_end over the first 100 steps; otherwise restore the trainer's
parameters and optimizer state bit-identically and re-sync the engine to the restored weights.
`MIPUController` holds that protocol; the loop supplies snapshot/restore/re-sync as callables.

LR-decay baseline (Beyond Precision, NUS & Fudan 2026): constant LR η0 until an instability
trigger, then halve it every `decay_period` steps down to 0.1·η0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from mcore_rl.algos.advantages import grpo
from mcore_rl.algos.mismatch import LOG_RATIO_CLAMP, Correction, mismatch_metrics, tis_weights
from mcore_rl.algos.policy_loss import LossOutput, masked_mean, ppo_clip
from mcore_rl.algos.registry import register

# ---------------------------------------------------------------------------------- Step 1


def truncated_mismatch_weight(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    w_max: float = 2.0,
    level: str = "token",
) -> torch.Tensor:
    """w̄ = min(π_k/μ_k, w_max) per token (or per sequence), a constant of the step."""
    return tis_weights(old_logp, rollout_logp, mask, level=level, clip_high=w_max, clip_low=0.0)


@register("mismatch", "mipu")
def step1_correction(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    is_clip_high: Optional[float] = None,
    is_level: Optional[str] = None,
    **unused: Any,
) -> Correction:
    """Step 1 as a mismatch correction (the registry's signature): weights w̄ = min(π_k/μ_k, w_max)
    with w_max = `is_clip_high` (default 2), loss mask unchanged. Paired with the PPO clip on
    r = π_θ/π_k (the `ppo_clip` policy loss with these `is_weights`) it is Eq. 7 (`step1_loss`).
    MIPU has no other parameters; `unused` takes the other presets' fields."""
    w_max = 2.0 if is_clip_high is None else is_clip_high
    weights = truncated_mismatch_weight(train_logp, rollout_logp, mask, w_max, is_level or "token")
    ratio = torch.exp((train_logp - rollout_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    metrics = mismatch_metrics(train_logp, rollout_logp, mask)
    metrics.update({
        "mismatch/is_weight_mean": masked_mean(weights, mask),
        "mismatch/is_weight_max": weights.max() if weights.numel() else torch.zeros(()),
        "mismatch/clipfrac": masked_mean((ratio > w_max).float(), mask),
        "mismatch/maskfrac": torch.zeros(()),
    })
    return Correction(weights, mask, metrics)


def step1_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    w_max: float = 2.0,
    level: str = "token",
    dual_clip: Optional[float] = None,
    agg: str = "token-mean",
    norm_length: Optional[int] = None,
) -> LossOutput:
    """Eq. 7 as a loss: -w̄ · min(r Â, clip(r, 1-ε, 1+ε) Â), r = π_θ/π_k, w̄ = min(π_k/μ_k, w_max).

    No gradient reaches π_k or μ_k (both are constants), only π_θ through r. The learner computes
    the same thing in two parts: `step1_correction` once per batch, `ppo_clip` per micro-batch."""
    w = step1_correction(old_logp, rollout_logp, mask, w_max, level).weights
    out = ppo_clip(
        logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip, is_weights=w, agg=agg,
        norm_length=norm_length,
    )
    with torch.no_grad():
        out.metrics["mipu/w_mean"] = masked_mean(w, mask)
        out.metrics["mipu/w_truncated_frac"] = masked_mean(
            (torch.exp((old_logp - rollout_logp).float().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) > w_max).float(),
            mask,
        )
        out.metrics.update(mismatch_metrics(old_logp, rollout_logp, mask))
    return out


# ---------------------------------------------------------------------------------- Step 2


def sequence_ratio(policy_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ρ_i = exp((1/T_i) Σ_t (log π - log μ)), [N]."""
    m = mask.float()
    d = ((policy_logp.float() - rollout_logp.float()) * m).sum(-1) / m.sum(-1).clamp_min(1)
    return torch.exp(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


@register("mipu", "t_hat_post")
def t_hat_post(
    policy_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor
) -> float:
    """T̂_post = -mean_i(ρ_i Â_i) over the validation sequences (equal-size groups make this the
    mean over groups of the 1/G group sums). With ρ ≡ 1 and zero-mean group advantages it is 0;
    in general it is minus the covariance of ρ and Â."""
    rho = sequence_ratio(policy_logp, rollout_logp, mask)
    return float(-(rho * advantages.float()).mean())


def validation_t_post(
    policy_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor,
    group_ids: torch.Tensor, valid: Optional[torch.Tensor] = None,
) -> float:
    """T̂_post of a validation batch sampled from the synced candidate: the groups' GRPO
    advantages Â (mean/std normalised) over the `valid` samples, then `t_hat_post` over those
    (unusable samples, e.g. reward errors, count nowhere; none valid: 0, no evidence either way)."""
    ok = torch.ones(rewards.shape, dtype=torch.bool, device=rewards.device) if valid is None else valid.bool()
    if not bool(ok.any()):
        return 0.0
    adv = grpo(rewards, group_ids, valid=ok)
    return t_hat_post(policy_logp[ok], rollout_logp[ok], mask[ok], adv[ok])


@register("mipu", "tolerance")
def tolerance(step: int, c_start: float = 1e-3, c_end: float = 0.0, anneal_steps: int = 100) -> float:
    """c_t = c_start + min(t, anneal_steps)/anneal_steps · (c_end - c_start)."""
    if anneal_steps <= 0:
        return c_end
    return c_start + min(step, anneal_steps) / anneal_steps * (c_end - c_start)


def accept(t_post: float, c: float) -> bool:
    """The update is kept if T̂_post ≥ -c (NaN is rejected)."""
    return bool(t_post >= -c)


@dataclass
class MIPUDecision:
    step: int
    t_post: float
    tolerance: float
    accepted: bool

    def metrics(self) -> dict[str, float]:
        return {"mipu/t_post": self.t_post, "mipu/tolerance": self.tolerance, "mipu/accepted": float(self.accepted)}


class MIPUController:
    """The accept/reject gate around one update, with the loop's own snapshot/restore/re-sync.

    Per RL step::

        ctrl.begin()                 # snapshot trainer state (e.g. optimizer.snapshot())
        ... optimizer steps, weight sync to the engine ...
        t = t_hat_post(...)          # on a validation batch sampled from the synced engine
        decision = ctrl.decide(t)    # on reject: restore(snapshot), then resync()

    `restore` must put back parameters *and* optimizer state (and LR schedule) — the project's
    `ModelParallelAdamW.snapshot()/restore()` does, bit-identically. `resync` must push the
    restored weights to the engine(s). In an async pipeline, rollouts produced by the rejected
    weights must be discarded by the caller. `count_rejected` chooses whether a rejected step
    advances the annealing clock t (the notes leave it open; default: every decision counts).
    """

    def __init__(
        self,
        snapshot: Callable[[], Any],
        restore: Callable[[Any], None],
        resync: Callable[[], None],
        c_start: float = 1e-3,
        c_end: float = 0.0,
        anneal_steps: int = 100,
        count_rejected: bool = True,
    ) -> None:
        self._snapshot_fn, self._restore_fn, self._resync_fn = snapshot, restore, resync
        self.c_start, self.c_end, self.anneal_steps = c_start, c_end, anneal_steps
        self.count_rejected = count_rejected
        self.t = 0
        self.accepted = 0
        self.rejected = 0
        self._snap: Any = None

    def begin(self) -> None:
        """Take the pre-update snapshot (call before the first optimizer step of the update)."""
        self._snap = self._snapshot_fn()

    def decide(self, t_post: float) -> MIPUDecision:
        if self._snap is None:
            raise RuntimeError("MIPUController.decide() without begin(): no snapshot to roll back to")
        c = tolerance(self.t, self.c_start, self.c_end, self.anneal_steps)
        ok = accept(t_post, c)
        decision = MIPUDecision(self.t, float(t_post), c, ok)
        if ok:
            self.accepted += 1
        else:
            self.rejected += 1
            self._restore_fn(self._snap)
            self._resync_fn()
        if ok or self.count_rejected:
            self.t += 1
        self._snap = None
        return decision

    def metrics(self) -> dict[str, float]:
        total = self.accepted + self.rejected
        return {"mipu/reject_rate": self.rejected / total if total else 0.0}

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "accepted": self.accepted, "rejected": self.rejected}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t, self.accepted, self.rejected = int(state["t"]), int(state["accepted"]), int(state["rejected"])


# ---------------------------------------------------------------------------------- LR-decay baseline


def lr_decay_baseline(
    step: int, base_lr: float, trigger_step: Optional[int], decay_period: int, floor_ratio: float = 0.1
) -> float:
    """η0 before the trigger; then η0 · 0.5^floor((t - trigger)/decay_period), floored at
    floor_ratio · η0 (the first halving happens `decay_period` steps after the trigger)."""
    if trigger_step is None or step < trigger_step:
        return base_lr
    if decay_period <= 0:
        raise ValueError(f"decay_period must be > 0, got {decay_period}")
    halvings = (step - trigger_step) // decay_period
    return max(base_lr * 0.5**halvings, floor_ratio * base_lr)
