"""A learned critic V_φ as an input of the advantage, and the loss it is trained with.

Advantages that read a critic (`gae`: PPO's token-level GAE, `steppo`: StepPO's step-level GAE) are
kind "advantage" functions with one more keyword input, `values`, a `ValueBatch`: V of the state
before each response token, read from the critic at the position whose label is that token (the
same grid as π's log-probs: column 0 is the last prompt token, a step sample's last state token).
The learner builds the critic (`train/critic.py`) only for an estimator whose signature names the
input (`takes_values`), and trains it on what the estimator says the values should have been:
`@reads_critic(targets)` attaches a function with the estimator's inputs and options that returns
the returns R [N, T] and where they count [N, T] (`critic_targets`).

The critic's loss is PPO's clipped value loss ("Proximal Policy Optimization Algorithms",
arXiv:1707.06347; the clipping as in OpenAI baselines' ppo2), per value position:
    L = c · max((V − R)², (V_old + clip(V − V_old, −ε, ε) − R)²)
with V_old the values the advantages were computed with, ε `algorithm.critic.value_clip` (None:
unclipped) and c `algorithm.critic.loss_coef` (0.5: the usual ½). Summed over the positions; the
learner divides by their global count, as it does the policy loss over tokens.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

VALUES_INPUT = "values"  # the name of the input in an estimator's signature
TARGETS_ATTR = "critic_targets"

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class ValueBatch:
    """The critic's values over a batch's sequence view: `values` [N, T] is V of the state before
    response token t (0 off the response), `mask` [N, T] 1 on the response tokens the learner
    trains (`Sample.trainable`; a multi-turn sample's observation tokens are 0)."""

    values: torch.Tensor
    mask: torch.Tensor

    def check(self, n: int) -> None:
        if self.values.ndim != 2 or self.values.shape[0] != n or self.values.shape != self.mask.shape:
            raise ValueError(
                f"values {tuple(self.values.shape)} and mask {tuple(self.mask.shape)} must be equal [{n}, T]"
            )


def takes_values(fn: Callable) -> bool:
    """Does `fn` read the critic (does its signature name the `values` input)?"""
    return VALUES_INPUT in inspect.signature(fn).parameters


def reads_critic(targets: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Callable[[F], F]:
    """Mark an advantage estimator with the critic's training targets: `targets(rewards, group_ids,
    *, values, valid, steps, **options)` -> (returns [N, T] float, mask [N, T] float), called with
    the estimator's inputs and `algorithm.advantage_options`."""

    def mark(fn: F) -> F:
        if not takes_values(fn):
            raise TypeError(f"{fn.__name__}: a critic-reading estimator must name the `values` input")
        setattr(fn, TARGETS_ATTR, targets)
        return fn

    return mark


def critic_targets(fn: Callable) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The targets function `reads_critic` attached to `fn`."""
    targets = getattr(fn, TARGETS_ATTR, None)
    if targets is None:
        raise TypeError(f"{getattr(fn, '__name__', fn)} reads `values` but has no @reads_critic targets")
    return targets


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    coef: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss summed over `mask`: (loss_sum, count, {"clipfrac": share of the
    positions where the clipped term was the larger one})."""
    m = mask.to(values.dtype)
    err = (values - returns) ** 2
    if clip is None:
        per = err
        clipped = torch.zeros_like(err, dtype=torch.bool)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        err_clip = (v_clip - returns) ** 2
        per = torch.maximum(err, err_clip)
        clipped = err_clip > err
    count = m.sum()
    clipfrac = (clipped.to(m.dtype) * m).sum().detach() / count.clamp_min(1)
    return coef * (per * m).sum(), count.detach(), {"clipfrac": clipfrac}


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var[R − V] / Var[R] over the masked positions (NaN when the returns do not vary)."""
    m = mask.bool()
    if int(m.sum()) < 2:
        return float("nan")
    r, v = returns[m].double(), values[m].double()
    var = r.var(unbiased=False)
    if float(var) == 0.0:
        return float("nan")
    return float(1.0 - (r - v).var(unbiased=False) / var)


def whiten(advantages: torch.Tensor, mask: torch.Tensor, normalize_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """Advantages minus their mean over `mask` (and divided by that std + eps if `normalize_std`),
    0 off the mask: PPO's batch normalisation of GAE advantages. float64."""
    m = mask.bool()
    out = torch.zeros_like(advantages, dtype=torch.float64)
    if int(m.sum()) == 0:
        return out
    a = advantages.double()
    sel = a[m]
    centred = sel - sel.mean()
    if normalize_std:
        centred = centred / (sel.std(unbiased=sel.numel() > 1) + eps)
    out[m] = centred
    return out
