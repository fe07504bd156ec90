"""MIPU — "The Mirage of Optimizing Training Policies: Monotonic Inference Policies as the Real
Objective for LLM RL" (TJU & Alibaba, 2026), arXiv:2606.29526.

What matters is the improvement of the *inference* policy μ (the engine), not of the trainer's π.

Step 1 (decoupled update): the PPO clip acts only on r = π_θ/π_k (π_k: the trainer's recomputed
log-probs of the pre-update weights) and the whole term is multiplied by the constant, truncated
mismatch weight w̄ = min(π_k/μ_k, w_max), w_max = 2, ε = 0.2. Clipping π_θ/μ_k directly would let
the pre-update mismatch trigger the clip even when r ≈ 1. Whether w̄ and r are per token or per
sequence is unclear in the summary; both are offered (`level`), per token by default.

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

import math
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

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
    is_clip_high: float | None = None,
    is_level: str | None = None,
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
    metrics.update(
        {
            "mismatch/is_weight_mean": masked_mean(weights, mask),
            "mismatch/is_weight_max": weights.max() if weights.numel() else torch.zeros(()),
            "mismatch/clipfrac": masked_mean((ratio > w_max).float(), mask),
            "mismatch/maskfrac": torch.zeros(()),
        }
    )
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
    dual_clip: float | None = None,
    agg: str = "token-mean",
    norm_length: int | None = None,
) -> LossOutput:
    """Eq. 7 as a loss: -w̄ · min(r Â, clip(r, 1-ε, 1+ε) Â), r = π_θ/π_k, w̄ = min(π_k/μ_k, w_max).

    No gradient reaches π_k or μ_k (both are constants), only π_θ through r. The learner computes
    the same thing in two parts: `step1_correction` once per batch, `ppo_clip` per micro-batch."""
    w = step1_correction(old_logp, rollout_logp, mask, w_max, level).weights
    out = ppo_clip(
        logp,
        old_logp,
        advantages,
        mask,
        clip_low,
        clip_high,
        dual_clip,
        is_weights=w,
        agg=agg,
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
    policy_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> float:
    """T̂_post of a validation batch sampled from the synced candidate: the groups' GRPO
    advantages Â (mean/std normalised) over the `valid` samples, then `t_hat_post` over those
    (unusable samples, e.g. reward errors, count nowhere; none valid: 0, no evidence either way)."""
    ok = torch.ones(rewards.shape, dtype=torch.bool, device=rewards.device) if valid is None else valid.bool()
    if not bool(ok.any()):
        return 0.0
    adv = grpo(rewards, group_ids, valid=ok)
    return t_hat_post(policy_logp[ok], rollout_logp[ok], mask[ok], adv[ok])


# --- how noisy T̂_post is (docs/mismatch_correction.md: the decision on an 8 × 8 batch is close to a coin flip)
#
# The samples of a group share its advantages' mean and std, so they are not independent; the
# groups are (independent prompts, independent sampling seeds). Per group g with n_g valid
# samples, s_g = -Σ_{i∈g} ρ_i Â_i (= -Σ (ρ_i - 1) Â_i, since GRPO's Â sums to 0 over a group),
# and T̂_post = Σ s_g / Σ n_g, a ratio of sums over K i.i.d. groups. Its standard error by the
# delta method (the cluster-robust "ratio estimator" SE):
#     SE² = K/(K-1) · Σ_g (s_g - T̂ n_g)² / (Σ_g n_g)²,
# with equal n_g = G this is sd_g(s_g/G)/√K: SE falls as 1/√(number of groups). A group whose
# rewards are all equal has Â ≡ 0 and s_g = 0: it adds to K (pulling T̂ and SE towards 0) and
# carries no evidence.


@dataclass
class TPostEstimate:
    """T̂_post with its group-level standard error and the per-group terms it came from."""

    t_post: float
    se: float  # inf with fewer than 2 groups (no spread to estimate)
    group_sums: torch.Tensor  # [K] s_g = -Σ_{i∈g} ρ_i Â_i (float64)
    group_counts: torch.Tensor  # [K] n_g valid samples
    informative_groups: int  # groups with a non-zero advantage (non-constant rewards)


def t_post_groups(
    policy_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    group_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s_g, n_g) per group, ordered by group id: s_g = -Σ_{i∈g} ρ_i Â_i."""
    rho = sequence_ratio(policy_logp, rollout_logp, mask).double()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    k = int(inverse.max()) + 1 if inverse.numel() else 0
    sums = torch.zeros(k, dtype=torch.float64).index_add_(0, inverse.cpu(), -(rho * advantages.double()).cpu())
    counts = torch.zeros(k, dtype=torch.float64).index_add_(
        0, inverse.cpu(), torch.ones(inverse.numel(), dtype=torch.float64)
    )
    return sums, counts


def ratio_se(sums: torch.Tensor, counts: torch.Tensor) -> tuple[float, float]:
    """(Σ s_g / Σ n_g, its delta-method standard error over the K groups); SE = inf for K < 2."""
    total = float(counts.sum())
    if total <= 0:
        return 0.0, float("inf")
    t = float(sums.sum()) / total
    k = sums.numel()
    if k < 2:
        return t, float("inf")
    resid = sums.double() - t * counts.double()
    return t, math.sqrt(k / (k - 1) * float((resid**2).sum())) / total


def validation_estimate(
    policy_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> TPostEstimate:
    """`validation_t_post` (the same number) with its standard error from the group terms."""
    ok = torch.ones(rewards.shape, dtype=torch.bool, device=rewards.device) if valid is None else valid.bool()
    if not bool(ok.any()):
        empty = torch.zeros(0, dtype=torch.float64)
        return TPostEstimate(0.0, float("inf"), empty, empty, 0)
    adv = grpo(rewards, group_ids, valid=ok)
    sums, counts = t_post_groups(policy_logp[ok], rollout_logp[ok], mask[ok], adv[ok], group_ids[ok])
    _, se = ratio_se(sums, counts)
    t = t_hat_post(policy_logp[ok], rollout_logp[ok], mask[ok], adv[ok])  # the decision's number, as before
    _, inverse = torch.unique(group_ids[ok], return_inverse=True)
    informative = torch.zeros(sums.numel(), dtype=torch.bool).index_fill_(0, inverse.cpu()[adv[ok].cpu() != 0], True)
    return TPostEstimate(t, se, sums, counts, int(informative.sum()))


def flip_probability(t_post: float, se: float, c: float, z: float = 0.0) -> float:
    """Normal approximation of how often a fresh validation batch would reach the other decision
    if the truth were T̂_post: Φ(-|T̂ + c + z·SE| / SE) for the threshold -c - z·SE (0.5 at the
    threshold, → 0 far from it; SE = inf: 0.5, SE = 0: 0)."""
    margin = t_post + c + (z * se if math.isfinite(se) else 0.0)
    if not math.isfinite(se):
        return 0.5
    if se <= 0:
        return 0.0 if margin != 0 else 0.5
    return 0.5 * math.erfc(abs(margin) / se / math.sqrt(2.0))


def bootstrap_flip_rate(
    sums: torch.Tensor,
    counts: torch.Tensor,
    c: float,
    num_resamples: int = 200,
    seed: int = 0,
    rule: str = "plain",
    z: float = 0.0,
) -> float:
    """Fraction of group bootstrap resamples (K groups drawn with replacement, seeded) whose
    accept/reject differs from the observed batch's (with the same `rule`; "se" re-estimates SE
    on each resample)."""
    k = sums.numel()
    if k == 0 or num_resamples <= 0:
        return float("nan")
    t, se = ratio_se(sums, counts)
    observed = decide(t, se, c, rule, z)
    g = torch.Generator().manual_seed(int(seed))
    idx = torch.randint(0, k, (num_resamples, k), generator=g)
    s, n = sums.double()[idx], counts.double()[idx]
    tb = s.sum(1) / n.sum(1).clamp_min(1e-12)
    if rule == "se" and k >= 2:
        resid = s - tb[:, None] * n
        seb = torch.sqrt(k / (k - 1) * (resid**2).sum(1)) / n.sum(1).clamp_min(1e-12)
        acc = tb >= -c - z * seb
    else:
        acc = tb >= -c
    return float((acc != observed).double().mean())


@register("mipu", "tolerance")
def tolerance(step: int, c_start: float = 1e-3, c_end: float = 0.0, anneal_steps: int = 100) -> float:
    """c_t = c_start + min(t, anneal_steps)/anneal_steps · (c_end - c_start)."""
    if anneal_steps <= 0:
        return c_end
    return c_start + min(step, anneal_steps) / anneal_steps * (c_end - c_start)


def accept(t_post: float, c: float) -> bool:
    """The update is kept if T̂_post ≥ -c (NaN is rejected)."""
    return bool(t_post >= -c)


DECISION_RULES = ("plain", "se")


def decide(t_post: float, se: float, c: float, rule: str = "plain", z: float = 2.0) -> bool:
    """Accept or reject. "plain": the paper's T̂_post ≥ -c. "se": reject only when T̂_post is
    below -c by more than z standard errors (T̂_post ≥ -c - z·SE), i.e. only on evidence that
    the engine's policy got worse than the trainer's by more than c; SE = inf never rejects."""
    if rule == "plain":
        return accept(t_post, c)
    if rule == "se":
        if math.isnan(t_post) or math.isnan(se):
            return False
        return bool(t_post >= -c - z * se)
    raise ValueError(f"unknown MIPU decision rule {rule!r}; known: {', '.join(DECISION_RULES)}")


@dataclass
class MIPUDecision:
    step: int
    t_post: float
    tolerance: float
    accepted: bool
    se: float = float("nan")  # standard error of T̂_post (group level)
    flip_prob: float = float("nan")  # normal approximation, `flip_probability`
    bootstrap_flip: float = float("nan")  # `bootstrap_flip_rate`, when the groups were given

    def metrics(self) -> dict[str, float]:
        out = {"mipu/t_post": self.t_post, "mipu/tolerance": self.tolerance, "mipu/accepted": float(self.accepted)}
        if not math.isnan(self.se):  # decided on an estimate with its SE
            out.update({"mipu/t_post_se": self.se, "mipu/flip_prob": self.flip_prob})
        if not math.isnan(self.bootstrap_flip):
            out["mipu/bootstrap_flip_rate"] = self.bootstrap_flip
        return out


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
    advances the annealing clock t (the summary leaves it open; default: every decision counts).
    `rule`/`z` choose the decision (`decide`: "plain" is the paper's); given the validation
    estimate (`validation_estimate`), `decide` also reports SE, flip probability and a seeded
    bootstrap flip rate over `bootstrap` resamples of the groups (0: not computed).
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
        rule: str = "plain",
        z: float = 2.0,
        bootstrap: int = 0,
    ) -> None:
        if rule not in DECISION_RULES:
            raise ValueError(f"unknown MIPU decision rule {rule!r}; known: {', '.join(DECISION_RULES)}")
        self._snapshot_fn, self._restore_fn, self._resync_fn = snapshot, restore, resync
        self.c_start, self.c_end, self.anneal_steps = c_start, c_end, anneal_steps
        self.count_rejected = count_rejected
        self.rule, self.z, self.bootstrap = rule, z, bootstrap
        self.t = 0
        self.accepted = 0
        self.rejected = 0
        self._snap: Any = None

    def begin(self) -> None:
        """Take the pre-update snapshot (call before the first optimizer step of the update)."""
        self._snap = self._snapshot_fn()

    def decide(self, t_post: float | TPostEstimate) -> MIPUDecision:
        """Accept or roll back on T̂_post (a float: no SE, only the plain rule can use it)."""
        if self._snap is None:
            raise RuntimeError("MIPUController.decide() without begin(): no snapshot to roll back to")
        est = t_post if isinstance(t_post, TPostEstimate) else None
        t = t_post.t_post if isinstance(t_post, TPostEstimate) else float(t_post)
        se = est.se if est is not None else float("nan")
        if self.rule == "se" and est is None:
            raise ValueError("MIPU's 'se' decision rule needs the estimate with its SE (validation_estimate)")
        c = tolerance(self.t, self.c_start, self.c_end, self.anneal_steps)
        ok = decide(t, se, c, self.rule, self.z)
        z = self.z if self.rule == "se" else 0.0
        decision = MIPUDecision(
            self.t, t, c, ok, se, flip_probability(t, se, c, z) if est is not None else float("nan")
        )
        if est is not None and self.bootstrap > 0:
            decision.bootstrap_flip = bootstrap_flip_rate(
                est.group_sums,
                est.group_counts,
                c,
                self.bootstrap,
                seed=self.accepted + self.rejected,
                rule=self.rule,
                z=self.z,
            )
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
    step: int,
    base_lr: float,
    trigger_step: int | None,
    decay_period: int,
    floor_ratio: float = 0.1,
    factor: float = 0.5,
    min_lr: float | None = None,
) -> float:
    """η0 before the trigger; from the trigger on η0 · factor^(floor((t - trigger)/decay_period) + 1),
    floored at `min_lr` (default floor_ratio · η0). The first decay happens at the trigger itself (the
    instability signal is a reason to act at once). `optimizer.lr_decay_style: step` is this schedule."""
    if trigger_step is None or step < trigger_step:
        return base_lr
    if decay_period <= 0:
        raise ValueError(f"decay_period must be > 0, got {decay_period}")
    decays = (step - trigger_step) // decay_period + 1
    return max(base_lr * factor**decays, floor_ratio * base_lr if min_lr is None else min_lr)
