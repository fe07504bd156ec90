"""The one signature of the "distill" kind.

    fn(batch: DistillBatch, **options) -> DistillTerms

A function is registered with `@register("distill", name)` and marked with its phase:

* `phase = "advantage"`: called once per rollout batch, before the update, with
  `student_logp = old_logp` (no gradient). It returns `token_advantage` [n, T] (added to the RL
  advantage of each token; alone, with a zero RL advantage, it is pure distillation) and/or
  `token_mask` [n, T] (multiplied into the loss mask: horizons, trust masks, gates).
* `phase = "loss"`: called per micro-batch inside the loss with the differentiable
  `student_logp` (and `student_topk_logp`); it returns `loss_sum`, summed over the tokens that
  count with the same aggregation as the policy loss (`agg`, `norm_length`), so the learner can add
  it to the policy loss before megatron-core divides by the one shared count.

Shapes follow `mcore_rl.algos`: [n, T] per token (right-padded, `mask` 1 on response tokens),
[n, T, k] for the teacher's top-k (ids fixed by the teacher; `student_topk_logp` is the student's
log-prob of those same ids), [n] per sequence.

A term's weight is its loss entry's `coef`; a function marked `@default_coef(w)` (SDAR's and
SEED's λ = 0.01) gets w when the entry gives none, any other 1 (`term_coef`).

A function that keeps state from one batch to the next (AntiSD's entropy gate, Direct-OPD's
adaptive KL weight) is marked `@stateful(Factory)`: the learner creates one state per run with
`make_state(fn, options)` (the factory gets the term's options it takes by name), passes that
object as `state=` on every call, and saves `state.state_dict()` / restores `load_state_dict()`
with its checkpoints. A loss-phase function runs many times per batch and only *reads* its state;
the state moves in `state.start_batch(batch) -> metrics`, which the learner calls once per rollout
batch at π_old, before the update. Functions without the mark are stateless.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Mapping

import torch


@dataclass
class DistillBatch:
    student_logp: torch.Tensor  # [n, T] log π_θ(y_t) (requires grad in the loss phase)
    old_logp: torch.Tensor  # [n, T] log π_old(y_t) of the sampling policy, recomputed by the trainer
    teacher_logp: torch.Tensor  # [n, T] log π_T(y_t) of the teacher
    mask: torch.Tensor  # [n, T] float, 1 on response tokens that count (teacher scored, sample usable)
    teacher_topk_logp: torch.Tensor | None = None  # [n, T, k] teacher log-probs of its top-k ids
    student_topk_logp: torch.Tensor | None = None  # [n, T, k] student log-probs of the same ids
    # a reference teacher (the teacher before its RL, for methods that distil the teacher's shift)
    teacher_ref_logp: torch.Tensor | None = None  # [n, T]
    teacher_ref_topk_logp: torch.Tensor | None = None  # [n, T, k] at the teacher's top-k ids
    rewards: torch.Tensor | None = None  # [n] scalar rewards (for gated methods)
    group_ids: torch.Tensor | None = None  # [n]
    # [n] the mean reward of each sample's whole prompt group (the learner's: a loss-phase micro-batch
    # may hold part of a group; UI-MOPD's τ_KL gate)
    group_mean_reward: torch.Tensor | None = None
    advantages: torch.Tensor | None = None  # [n] or [n, T]: the RL advantage (before distillation)
    step: int = 0  # rollout step (for schedules)
    # per-token entropies of the full distributions (AntiSD's teacher gate, SDAR's entropy gates)
    teacher_entropy: torch.Tensor | None = None  # [n, T] H(π_T(·|s_t))
    student_entropy: torch.Tensor | None = None  # [n, T] H(π_θ(·|s_t))
    # 1 on response tokens the teacher generated (TrOPD's off-policy prefix), 0 on student tokens;
    # no rollout of this trainer generates teacher prefixes yet (UNFILLED_FIELDS)
    teacher_generated: torch.Tensor | None = None  # [n, T]
    # log π_ref(y_t) of the learner's reference model: the student's starting weights
    # (`algorithm.reference_model`), for terms that carry their own KL to it (Direct-OPD)
    student_ref_logp: torch.Tensor | None = None  # [n, T]
    agg: str = "token-mean"
    norm_length: int | None = None


@dataclass
class DistillTerms:
    token_advantage: torch.Tensor | None = None  # [n, T], advantage phase
    token_mask: torch.Tensor | None = None  # [n, T] in [0, 1], advantage phase
    loss_sum: torch.Tensor | None = None  # scalar, loss phase (aggregated like the policy loss)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def group_mean(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[n] float32: the mean finite reward of each sample's group (`DistillBatch.group_mean_reward`)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    k = int(inverse.max()) + 1 if inverse.numel() else 0
    ok = torch.isfinite(rewards)
    r = torch.where(ok, rewards.double(), torch.zeros((), dtype=torch.float64))
    total = torch.zeros(k, dtype=torch.float64).index_add_(0, inverse, r)
    count = torch.zeros(k, dtype=torch.float64).index_add_(0, inverse, ok.double())
    return (total / count.clamp_min(1))[inverse].float()


def phase(kind: str) -> Callable:
    """Decorator: mark a distillation function as an "advantage" or "loss" phase function."""
    if kind not in ("advantage", "loss"):
        raise ValueError(f"phase must be 'advantage' or 'loss', got {kind!r}")

    def deco(fn: Callable) -> Callable:
        fn.phase = kind  # type: ignore[attr-defined]  # a flag on the function object
        return fn

    return deco


def stateful(factory: Callable[..., object]) -> Callable:
    """Decorator: the function keeps state across batches; the learner makes one state per run
    (`make_state`) and passes it as `state=` (see the module docstring)."""

    def deco(fn: Callable) -> Callable:
        fn.make_state = factory  # type: ignore[attr-defined]  # a flag on the function object
        return fn

    return deco


def default_coef(weight: float) -> Callable:
    """Decorator: the term's weight when its loss entry gives no `coef` (SDAR's λ_SDAR = 0.01, the
    paper's); a function without the mark weighs 1."""

    def deco(fn: Callable) -> Callable:
        fn.default_coef = float(weight)  # type: ignore[attr-defined]  # a flag on the function object
        return fn

    return deco


def term_coef(fn: Callable, coef: float | None) -> float:
    """The weight of a loss entry: its `coef`, or the function's `@default_coef` when unset (None)."""
    return float(getattr(fn, "default_coef", 1.0)) if coef is None else float(coef)


def own_kl(fn: Callable) -> Callable:
    """Decorator: the function carries its own KL to the learner's reference model (Direct-OPD's
    adaptive α), so config validation refuses `algorithm.kl_coef` > 0 beside it (two KLs)."""
    fn.own_kl = True  # type: ignore[attr-defined]  # a flag on the function object
    return fn


def make_state(fn: Callable, options: Mapping[str, Any]) -> object | None:
    """The state of a `@stateful` function for one run (None for a stateless one): its factory
    called with the options it takes by name (Direct-OPD's α₀ and bounds; AntiSD's gate takes none).
    A bad option value raises ValueError here, which config validation reports."""
    factory = getattr(fn, "make_state", None)
    if factory is None:
        return None
    accepted = inspect.signature(factory).parameters
    return factory(**{k: v for k, v in options.items() if k in accepted})


TOPK_FIELDS = ("teacher_topk_logp", "student_topk_logp")
REFERENCE_FIELDS = ("teacher_ref_logp", "teacher_ref_topk_logp")
# the learner's reference model π_ref (kept with `algorithm.reference_model`)
POLICY_REFERENCE_FIELDS = ("student_ref_logp",)
# fields no rollout of this trainer fills yet: a function that needs one would train nothing from
# it, so config validation refuses it (TrOPD's teacher-prefix imitation: no mixed rollouts)
UNFILLED_FIELDS = ("teacher_generated",)


def needs(*fields: str) -> Callable:
    """Decorator: the optional `DistillBatch` fields a function cannot work without, so config
    validation can refuse a recipe that would not provide them (no top-k, no reference teacher)
    before training starts instead of the first batch raising."""
    unknown = [f for f in fields if f not in DistillBatch.__dataclass_fields__]
    if unknown:
        raise ValueError(f"needs: {unknown} are not DistillBatch fields")

    def deco(fn: Callable) -> Callable:
        fn.needs = tuple(fields)  # type: ignore[attr-defined]  # a flag on the function object
        return fn

    return deco
