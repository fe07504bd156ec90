"""Train–inference mismatch correction: the engine's μ (FP8, other kernels) is not the trainer's π.

Tokens were sampled by the engine, whose per-token log-probs μ ride along with every sample
(docs/design.md#provenance); the trainer recomputes π_old on the same tokens. With the log-ratio
log r_t = log π_old(y_t) - log μ(y_t) (clamped to ±20 as slime/verl do), this module turns r into
constant per-token weights that multiply the policy loss, and into masks that drop tokens or
sequences (formulas and defaults as slime and verl implement them; papers in docs/papers.md):

- TIS (truncated importance sampling): w = clamp(r, low, C), C = 2 — token level (r_t), sequence
  level (Π_t r_t = exp Σ log r_t) or geometric (exp mean_t log r_t); slime, verl, NeMo-RL, Megatron-RL;
- IcePop / MIS (masked importance sampling): w = r inside [0.5, 5], the token masked out
  otherwise (NeMo-RL `icepop`, slime IcePop);
- rejection masks on a token, sequence or geometric-mean ratio with bounds [low, high]; the
  geometric one with tight bounds (0.999 / 1.002) is NeMo-RL's `seq-mask-tis`;
- veto: drop a whole sequence if any of its tokens has r < 1e-4 (slime MIS `rs_veto_threshold`);
- optional normalisation of the weights to mean 1 over the batch's tokens.

`correct()` applies one `MismatchConfig`; presets are registered by name (kind "mismatch").
The metrics are those every step logs: K3 mismatch exp(d) - d - 1 with d = log π - log μ (an
estimate of KL(μ‖π) from μ's samples), mean |log π - log μ|, IS weight mean/max, clip and mask
fractions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.algos.policy_loss import masked_mean
from mcore_rl.algos.registry import register

LOG_RATIO_CLAMP = 20.0
LEVELS = ("token", "sequence", "geometric")


def log_ratio(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log π_old - log μ per token, clamped to ±20, zero off the mask, no gradient."""
    d = (train_logp.detach().float() - rollout_logp.detach().float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return d * mask.float()


def level_log_ratio(lr: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The log-ratio at `level`, broadcast to [N, T]: per token, summed over the sequence, or its
    mean over the sequence's tokens (geometric). Sequence sums are clamped to ±20 too."""
    if level == "token":
        return lr
    m = mask.float()
    if level == "sequence":
        seq = lr.sum(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    elif level == "geometric":
        seq = lr.sum(-1) / m.sum(-1).clamp_min(1)
    else:
        raise ValueError(f"unknown level {level!r}; expected one of {', '.join(LEVELS)}")
    return seq[:, None].expand_as(lr)


def tis_weights(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    clip_high: float = 2.0,
    clip_low: float = 0.0,
) -> torch.Tensor:
    """Truncated IS weights clamp(r, clip_low, clip_high) at `level`, [N, T], constants."""
    r = torch.exp(level_log_ratio(log_ratio(train_logp, rollout_logp, mask), mask, level))
    return r.clamp(clip_low, clip_high) * mask.float()


def ratio_mask(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    low: float = 0.5,
    high: float = 5.0,
) -> torch.Tensor:
    """Keep mask [N, T]: the ratio at `level` lies in [low, high] (whole sequences for the
    sequence and geometric levels). MIS / IcePop at token level; `geometric` with bounds like
    0.999 / 1.002 is the geometric sequence mask."""
    r = torch.exp(level_log_ratio(log_ratio(train_logp, rollout_logp, mask), mask, level))
    return ((r >= low) & (r <= high)).float() * mask.float()


def veto_mask(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, threshold: float = 1e-4
) -> torch.Tensor:
    """Keep mask [N, T] that drops every sequence with any (masked-in) token ratio < `threshold`:
    such a token means μ sampled something π considers nearly impossible."""
    lr = log_ratio(train_logp, rollout_logp, mask)
    bad = ((lr < math.log(threshold)) & (mask > 0)).any(-1, keepdim=True)
    return (~bad).float() * mask.float()


def icepop_weights(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, low: float = 0.5, high: float = 5.0
) -> torch.Tensor:
    """IcePop: w_t = r_t · 1[low ≤ r_t ≤ high] (token level)."""
    r = torch.exp(log_ratio(train_logp, rollout_logp, mask))
    return r * ratio_mask(train_logp, rollout_logp, mask, "token", low, high)


@dataclass(frozen=True)
class MismatchConfig:
    """One correction: IS weights (`is_mode`) plus optional rejection (`mask_level`) and veto.

    is_mode: "none" (w = 1), "tis" (clamp(r, is_clip_low, is_clip_high) at `is_level`) or
    "icepop" (w = r where r ∈ [mask_low, mask_high] at `is_level`, token masked otherwise).
    mask_level: None, or the level at which tokens/sequences outside [mask_low, mask_high] are
    masked out (independently of `is_mode`).
    """

    is_mode: str = "tis"
    is_level: str = "token"
    is_clip_low: float = 0.0
    is_clip_high: float = 2.0
    mask_level: str | None = None
    mask_low: float = 0.5
    mask_high: float = 5.0
    veto_threshold: float | None = None
    batch_normalize: bool = False

    def __post_init__(self) -> None:
        if self.is_mode not in ("none", "tis", "icepop"):
            raise ValueError(f"is_mode must be 'none', 'tis' or 'icepop', got {self.is_mode!r}")
        if self.is_level not in LEVELS:
            raise ValueError(f"is_level must be one of {LEVELS}, got {self.is_level!r}")
        if self.mask_level is not None and self.mask_level not in LEVELS:
            raise ValueError(f"mask_level must be None or one of {LEVELS}, got {self.mask_level!r}")
        if not 0 <= self.is_clip_low <= self.is_clip_high:
            raise ValueError(f"need 0 <= is_clip_low <= is_clip_high, got {self.is_clip_low}, {self.is_clip_high}")
        if not 0 <= self.mask_low <= self.mask_high:
            raise ValueError(f"need 0 <= mask_low <= mask_high, got {self.mask_low}, {self.mask_high}")


@dataclass
class Correction:
    """`weights` multiply the per-token policy loss; `mask` replaces the loss mask."""

    weights: torch.Tensor
    mask: torch.Tensor
    metrics: dict[str, torch.Tensor]


def correct(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, cfg: MismatchConfig = MismatchConfig()
) -> Correction:
    """Weights, new loss mask and metrics for one batch (no gradient flows through any of them)."""
    m = mask.float()
    lr = log_ratio(train_logp, rollout_logp, m)
    raw = torch.exp(level_log_ratio(lr, m, cfg.is_level))
    keep = m.clone()
    clipped = torch.zeros_like(m)
    if cfg.is_mode == "tis":
        weights = raw.clamp(cfg.is_clip_low, cfg.is_clip_high)
        clipped = ((raw > cfg.is_clip_high) | (raw < cfg.is_clip_low)).float() * m
    elif cfg.is_mode == "icepop":
        weights = raw
        keep = keep * ratio_mask(train_logp, rollout_logp, m, cfg.is_level, cfg.mask_low, cfg.mask_high)
    else:
        weights = torch.ones_like(m)
    if cfg.mask_level is not None:
        keep = keep * ratio_mask(train_logp, rollout_logp, m, cfg.mask_level, cfg.mask_low, cfg.mask_high)
    vetoed = torch.zeros(m.shape[0], device=m.device)
    if cfg.veto_threshold is not None:
        v = veto_mask(train_logp, rollout_logp, m, cfg.veto_threshold)
        vetoed = ((m.sum(-1) > 0) & (v.sum(-1) == 0)).float()
        keep = keep * v
    weights = weights * keep
    if cfg.batch_normalize and keep.sum() > 0:
        weights = weights / masked_mean(weights, keep)
    metrics = mismatch_metrics(train_logp, rollout_logp, m)
    metrics.update(weight_metrics(weights, keep, m, clipped))
    metrics["mismatch/veto_frac"] = vetoed.sum() / (m.sum(-1) > 0).float().sum().clamp_min(1)
    return Correction(weights.detach(), keep, metrics)


def mismatch_metrics(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """K3 = mean exp(d) - d - 1 and mean |d| with d = log π - log μ, over masked-in tokens."""
    d = log_ratio(train_logp, rollout_logp, mask)
    return {
        "mismatch/k3": masked_mean(torch.expm1(d) - d, mask),
        "mismatch/abs_logp_diff": masked_mean(d.abs(), mask),
    }


def weight_metrics(
    weights: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor, clipped: torch.Tensor
) -> dict[str, torch.Tensor]:
    """IS weight mean/max over kept tokens, truncated fraction and masked-out fraction of tokens."""
    kept = keep > 0
    return {
        "mismatch/is_weight_mean": masked_mean(weights, keep),
        "mismatch/is_weight_max": weights[kept].max() if bool(kept.any()) else weights.new_zeros(()),
        "mismatch/clipfrac": masked_mean(clipped, mask),
        "mismatch/maskfrac": 1.0 - keep.sum() / mask.sum().clamp_min(1),
    }


# Presets. Each is `fn(train_logp, rollout_logp, mask, **overrides) -> Correction`; overrides are
# MismatchConfig fields.
PRESETS: dict[str, MismatchConfig] = {
    "none": MismatchConfig(is_mode="none"),
    "tis": MismatchConfig(),  # token TIS, C = 2 (slime --use-tis, verl token, Megatron-RL)
    "seq_tis": MismatchConfig(is_level="sequence"),  # verl sequence-level IS, C = 2
    "icepop": MismatchConfig(is_mode="icepop"),  # token r·1[0.5 ≤ r ≤ 5]
    "mis": MismatchConfig(is_mode="icepop"),  # masked IS, token level (same bounds)
    "seq_mis": MismatchConfig(is_mode="tis", is_level="sequence", mask_level="sequence"),
    # NeMo-RL seq-mask-tis: mask sequences whose geometric-mean ratio leaves [0.999, 1.002];
    # token IS untruncated.
    "seq_mask_tis": MismatchConfig(
        is_mode="tis", is_clip_high=float("inf"), mask_level="geometric", mask_low=0.999, mask_high=1.002
    ),
    # slime mis.yaml: token level, "truncate" mode = clamp(r, 0, 2), veto 1e-4, batch-normalised.
    "slime_mis": MismatchConfig(is_mode="tis", veto_threshold=1e-4, batch_normalize=True),
}


def _make_preset(cfg: MismatchConfig) -> Callable[..., Correction]:
    def fn(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, **overrides: Any) -> Correction:
        return correct(train_logp, rollout_logp, mask, dataclasses.replace(cfg, **overrides))

    fn.__doc__ = f"`correct()` with {cfg}"
    return fn


for _name, _cfg in PRESETS.items():
    register("mismatch", _name)(_make_preset(_cfg))
