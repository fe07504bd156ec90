"""Helpers shared by the distillation modules: which tokens count, the RL advantage per token, and
the loss sum aggregated like the policy loss.

Padding and teacher-less tokens may hold anything (0, -inf, NaN): every function first replaces
them by 0 with `torch.where` before any exp/log, so neither their values nor their gradients can
leak into the result.
"""

from __future__ import annotations


import torch

from mcore_rl.algos.advantages import grpo
from mcore_rl.algos.distill.base import DistillBatch
from mcore_rl.algos.policy_loss import aggregate


def valid_tokens(batch: DistillBatch, *tensors: torch.Tensor | None) -> torch.Tensor:
    """Bool [n, T]: on the mask and finite in every given per-token tensor."""
    ok = batch.mask > 0
    for t in tensors:
        if t is not None:
            ok = ok & torch.isfinite(t)
    return ok


def detached(x: torch.Tensor) -> torch.Tensor:
    """x without gradient, in at least fp32 (advantage-phase arithmetic; fp64 stays fp64)."""
    return x.detach().to(torch.promote_types(x.dtype, torch.float32))


def zero_where_not(ok: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x on `ok`, exactly 0 elsewhere (gradient only flows to the `ok` entries)."""
    return torch.where(ok, x, torch.zeros((), dtype=x.dtype, device=x.device))


def rl_token_advantages(batch: DistillBatch, like: torch.Tensor) -> torch.Tensor:
    """The RL advantage per token [n, T] (detached): `batch.advantages` broadcast from [n] if
    needed, or, when the learner passed none, GRPO's group-standardised advantage of
    `batch.rewards` within `batch.group_ids` (what these papers build on)."""
    adv = batch.advantages
    if adv is None:
        if batch.rewards is None or batch.group_ids is None:
            raise ValueError(
                "this distillation method needs the RL advantage: DistillBatch.advantages, "
                "or rewards and group_ids to compute GRPO's"
            )
        adv = grpo(batch.rewards, batch.group_ids)
    adv = adv.detach().to(like.dtype)
    if adv.shape == like.shape:
        return adv
    if adv.ndim == 1 and adv.shape[0] == like.shape[0]:
        return adv[:, None].expand_as(like)
    raise ValueError(f"advantages {tuple(adv.shape)} must be [n] or [n, T] = {tuple(like.shape)}")


def require(batch: DistillBatch, name: str, method: str) -> torch.Tensor:
    value = getattr(batch, name)
    if value is None:
        raise ValueError(f"distill {method!r} needs DistillBatch.{name}")
    return value


def loss_sum(values: torch.Tensor, weight: torch.Tensor, batch: DistillBatch) -> torch.Tensor:
    """Σ of per-token `values` × `weight` ([n, T]; 0 where a token takes no part), aggregated with
    the policy loss's mode over `batch.mask`, so per-sequence modes divide by the same token
    counts as the policy loss and the sum can be added to it before the one shared division."""
    w = weight.to(values.dtype)
    v = zero_where_not(w != 0, values * w)
    total, _ = aggregate(v, batch.mask, batch.agg, batch.norm_length)
    return total


def masked_mean(values: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """Detached mean over `ok` (0 when nothing is), for metrics."""
    v = zero_where_not(ok, values.detach().float())
    return v.sum() / ok.sum().clamp_min(1)
