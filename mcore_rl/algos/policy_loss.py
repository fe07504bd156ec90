"""Clipped policy-gradient losses (PPO with DAPO's clip-higher and dual-clip, GSPO) and the ways
per-token losses are averaged into one number.

Losses are returned as a `LossOutput` holding a *sum* and the *count* it is to be divided by, not
a mean: megatron-core's schedules (with `calculate_per_token_loss`) add the sums and counts of all
micro-batches and data-parallel ranks and divide once, which makes the global mean exact however
the batch was split. Every aggregation mode below is expressed that way; all terms of one loss
(policy, KL, entropy) must use the same mode so that they share the count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mcore_rl.algos.registry import register

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LOG_RATIO_CLAMP = 20.0


@dataclass
class LossOutput:
    """`loss_sum / count` is the loss; `metrics` are detached masked token means (floats as 0-d
    tensors), for logging."""

    loss_sum: torch.Tensor
    count: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def loss(self) -> torch.Tensor:
        return self.loss_sum / self.count.clamp_min(1)


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", norm_length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) of per-token `values` [N, T] under `mask`, for one of `AGG_MODES`:

    - `token-mean`: every token weighs the same (DAPO's token-level loss; long answers weigh more);
    - `seq-mean-token-mean`: mean over each sequence's tokens, then over sequences (GRPO paper,
      GSPO); a sequence weighs the same whatever its length;
    - `seq-mean-token-sum`: sum over each sequence's tokens, then mean over sequences;
    - `seq-mean-token-sum-norm`: like the previous one divided by a constant length `norm_length`
      (default T, the padded length) — Dr.GRPO's unbiased form.
    Sequences without any masked-in token are not counted by the sequence modes.
    """
    m = mask.to(values.dtype)
    if mode == "token-mean":
        return (values * m).sum(), m.sum().detach()
    per_seq_tokens = m.sum(-1)
    has_tokens = (per_seq_tokens > 0).to(values.dtype)
    seq_sum = (values * m).sum(-1)
    if mode == "seq-mean-token-mean":
        total = (seq_sum / per_seq_tokens.clamp_min(1)).sum()
    elif mode == "seq-mean-token-sum":
        total = seq_sum.sum()
    elif mode == "seq-mean-token-sum-norm":
        total = seq_sum.sum() / float(norm_length or values.shape[-1])
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {', '.join(AGG_MODES)}")
    return total, has_tokens.sum().detach()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp_min(1)


def _token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if advantages.shape == like.shape:
        return advantages.to(like.dtype)
    if advantages.ndim == 1 and advantages.shape[0] == like.shape[0]:
        return advantages[:, None].to(like.dtype).expand_as(like)
    raise ValueError(f"advantages {tuple(advantages.shape)} must be [N] or [N, T] = {tuple(like.shape)}")


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO loss max(-A·r, -A·clip(r, 1-ε_low, 1+ε_high)), optionally dual-clipped.

    Dual clip (Ye et al. 2020): for A < 0 the loss is also capped at -c·A (c > 1), so a huge
    ratio on a bad token cannot blow up the step. Returns (loss, clipped, dual_clipped) masks."""
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    dual = torch.zeros_like(clipped)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        cap = -advantages * dual_clip
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
    return loss, clipped, dual


def _finish(
    loss: torch.Tensor,
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    clipped: torch.Tensor,
    dual: torch.Tensor,
    mask: torch.Tensor,
    is_weights: torch.Tensor | None,
    agg: str,
    norm_length: int | None,
    prefix: str,
) -> LossOutput:
    if is_weights is not None:
        loss = loss * is_weights.detach()
    total, count = aggregate(loss, mask, agg, norm_length)
    with torch.no_grad():
        lr = log_ratio.detach()
        metrics = {
            f"{prefix}/clipfrac": masked_mean(clipped.float(), mask),
            f"{prefix}/dual_clipfrac": masked_mean(dual.float(), mask),
            f"{prefix}/ratio_mean": masked_mean(ratio.detach(), mask),
            # k3 estimate of KL(π_old || π_θ) from π_old samples: r - 1 - log r
            f"{prefix}/approx_kl": masked_mean(torch.expm1(lr) - lr, mask),
        }
    return LossOutput(total, count, metrics)


@register("policy_loss", "ppo_clip")
def ppo_clip(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    is_weights: torch.Tensor | None = None,
    agg: str = "token-mean",
    norm_length: int | None = None,
) -> LossOutput:
    """PPO clipped surrogate with token ratio r = π_θ/π_old.

    `clip_high > clip_low` is DAPO's clip-higher (0.2 / 0.28). `is_weights` ([N, T], treated as
    constants) multiply the per-token loss — the hook for TIS/MIS/IcePop corrections and MIPU's
    truncated π_old/μ weight. `old_logp=None` means on-policy (π_old = sg(π_θ))."""
    old = logp.detach() if old_logp is None else old_logp.detach()
    log_ratio = (logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = _token_advantages(advantages, logp)
    loss, clipped, dual = clipped_surrogate(ratio, adv, clip_low, clip_high, dual_clip)
    return _finish(loss, ratio, log_ratio, clipped, dual, mask, is_weights, agg, norm_length, "pg")


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Length-normalised sequence log-ratio (1/|y|) Σ_t (log π_θ - log π_old), [N]."""
    m = mask.to(logp.dtype)
    return ((logp - old_logp) * m).sum(-1) / m.sum(-1).clamp_min(1)


@register("policy_loss", "gspo")
def gspo(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: float | None = None,
    is_weights: torch.Tensor | None = None,
    agg: str = "seq-mean-token-mean",
    norm_length: int | None = None,
) -> LossOutput:
    """GSPO (Zheng et al. 2025): the ratio is the sequence's geometric mean
    s_i = exp((1/|y_i|) Σ_t log π_θ/π_old), clipped at the sequence level (defaults 3e-4 / 4e-4).

    Written as GSPO-token, s_{i,t} = sg(s_i) · π_θ(y_t)/sg(π_θ(y_t)): every token's value is s_i,
    and with one advantage per sequence and `seq-mean-token-mean` the gradient equals that of the
    sequence-level objective. Per-token advantages are allowed (then it is GSPO-token proper)."""
    old = logp.detach() if old_logp is None else old_logp.detach()
    seq_lr = sequence_log_ratio(logp.detach(), old, mask)
    log_ratio = (seq_lr[:, None] + logp - logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = _token_advantages(advantages, logp)
    loss, clipped, dual = clipped_surrogate(ratio, adv, clip_low, clip_high, dual_clip)
    return _finish(loss, ratio, log_ratio, clipped, dual, mask, is_weights, agg, norm_length, "pg")


@register("policy_loss", "reinforce")
def reinforce(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    is_weights: torch.Tensor | None = None,
    agg: str = "token-mean",
    norm_length: int | None = None,
) -> LossOutput:
    """Plain REINFORCE, −A·log π_θ per token, times the mismatch-correction `is_weights`: no ratio
    to π_old and no clip (`clip_low`, `clip_high`, `dual_clip` are part of the signature only), as
    W-REINFORCE's paper trains. Its gradient equals PPO's at π_θ = π_old; on later epochs or
    mini-batches of the same rollout batch it does not correct for π_θ having moved (use one
    mini-batch and one epoch for the paper's setting). The ratio is still logged."""
    old = logp.detach() if old_logp is None else old_logp.detach()
    log_ratio = (logp.detach() - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    adv = _token_advantages(advantages, logp)
    loss = -adv * logp
    none = torch.zeros_like(mask, dtype=torch.bool)
    return _finish(loss, torch.exp(log_ratio), log_ratio, none, none, mask, is_weights, agg, norm_length, "pg")
