"""AntiSD, "Anti-Self-Distillation for Reasoning RL via Pointwise Mutual Information" (Xiaohongshu &
CASIA, 2026): the GRPO sequence advantage minus a bounded token term,

    A_{i,t} = A_i − λ · sg[φ(u_t)],   u_t = log π_T(y_t) − log π_S(y_t),   φ(u) = ½(softplus(u) − log 2)

with π_T the same model given privileged context (a correct solution). u_t is the pointwise mutual
information of the token with that context; −φ is f′(π_S/π_T) of the Jensen–Shannon generator, so
the term *ascends* JSD(π_S‖π_T) instead of descending KL as self-distillation does: tokens the
context makes less likely (deliberation: "Wait", "Maybe") get a bonus of at most ½ log 2, tokens it
makes more likely (shortcuts) an unbounded penalty.

λ = g · λ_max, with g a hysteresis gate on the teacher's median token entropy H: the first
`warmup_steps` batches run with λ = 0 and fix H_warm (the median of their medians); after that g
opens when H ≥ H_warm and closes when H < 0.93 · H_warm. The gate is the state the learner keeps
(`@stateful`): one `AntiSDGate` per run, saved with checkpoints.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch
import torch.nn.functional as F

from mcore_rl.algos.distill._common import detached, masked_mean, valid_tokens, zero_where_not
from mcore_rl.algos.distill.base import DistillBatch, DistillTerms, phase, stateful
from mcore_rl.algos.registry import register

LOG2 = math.log(2.0)


def antisd_phi(u: torch.Tensor) -> torch.Tensor:
    """φ(u) = ½(softplus(u) − log 2): φ(0) = 0, increasing, ≥ −½ log 2, unbounded above."""
    return 0.5 * (F.softplus(u) - LOG2)


def jsd_generator_derivative(r: torch.Tensor) -> torch.Tensor:
    """f′(r) = ½ log(2r / (1 + r)) of JSD's generator f(r) = ½[r log(2r/(1+r)) + log(2/(1+r))]."""
    return 0.5 * torch.log(2.0 * r / (1.0 + r))


def gate_update(g: int, entropy: float, warm_entropy: float, down_ratio: float = 0.93) -> int:
    """One hysteresis step: 0 → 1 when H ≥ H_warm, 1 → 0 when H < down_ratio · H_warm, else keep."""
    if g == 0 and entropy >= warm_entropy:
        return 1
    if g == 1 and entropy < down_ratio * warm_entropy:
        return 0
    return g


class AntiSDGate:
    """The gate's state across batches: the warm-up medians, H_warm once known, and g.

    The gate's initial value after warm-up is not given in the summary; it starts open (`initial=1`,
    the method switched on at the entropy it was calibrated on) and the first post-warm-up batch
    already applies the hysteresis rule."""

    def __init__(self, initial: int = 1) -> None:
        self.initial = initial
        self.warm_medians: list[float] = []
        self.warm_entropy: float | None = None
        self.g = 0

    def update(self, median_entropy: float, warmup_steps: int = 5, down_ratio: float = 0.93) -> int:
        """Feed one batch's median teacher entropy; returns g for this batch (0 during warm-up)."""
        if self.warm_entropy is None:
            self.warm_medians.append(float(median_entropy))
            if len(self.warm_medians) < warmup_steps:
                return 0
            self.warm_entropy = statistics.median(self.warm_medians)
            self.g = self.initial
            return 0  # the last warm-up batch still runs with λ = 0
        self.g = gate_update(self.g, float(median_entropy), self.warm_entropy, down_ratio)
        return self.g

    def state_dict(self) -> dict[str, Any]:
        return {
            "initial": self.initial,
            "warm_medians": list(self.warm_medians),
            "warm_entropy": self.warm_entropy,
            "g": self.g,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.initial = int(state["initial"])
        self.warm_medians = [float(x) for x in state["warm_medians"]]
        self.warm_entropy = None if state["warm_entropy"] is None else float(state["warm_entropy"])
        self.g = int(state["g"])


def median_teacher_entropy(batch: DistillBatch) -> float | None:
    """The median of the teacher's per-token entropy over the mask (None on an empty mask).

    Uses `teacher_entropy` (full vocabulary) when the teacher provided it, else the entropy of the
    teacher's top-k log-probs (a lower bound of the full one, the best an engine teacher gives)."""
    if batch.teacher_entropy is not None:
        ent = batch.teacher_entropy.detach().float()
    elif batch.teacher_topk_logp is not None:
        lp = batch.teacher_topk_logp.detach().float()
        p = torch.exp(lp)
        ent = -zero_where_not(p > 0, p * lp).sum(-1)
    else:
        raise ValueError(
            "distill 'antisd' with its gate needs DistillBatch.teacher_entropy "
            "(or teacher_topk_logp); set gate=False for a constant λ"
        )
    ok = valid_tokens(batch, ent)
    if not bool(ok.any()):
        return None
    return float(ent[ok].median())


@register("distill", "antisd")
@phase("advantage")
@stateful(AntiSDGate)
def antisd(
    batch: DistillBatch,
    *,
    lam_max: float = 1.0,
    gate: bool = True,
    warmup_steps: int = 5,
    down_ratio: float = 0.93,
    state: AntiSDGate | None = None,
) -> DistillTerms:
    """token_advantage = −λ · φ(log π_T − log π_S), λ = g · λ_max (or λ_max with gate=False).

    λ_max is not given in the summary: 1.0, which keeps the per-token bonus (≤ ½ log 2 ≈ 0.35)
    below a standardised sequence advantage. `batch.advantages` is not used: the term is
    additive, and the learner adds it to the sequence advantage. Tokens without a finite student
    or teacher log-prob get 0."""
    with torch.no_grad():
        metrics: dict[str, torch.Tensor] = {}
        lam = lam_max
        if gate:
            if state is None:
                raise ValueError(
                    "distill 'antisd' with gate=True needs its state (the learner passes "
                    "state=antisd.make_state()); set gate=False for a constant λ"
                )
            h = median_teacher_entropy(batch)
            if h is not None:
                g = state.update(h, warmup_steps, down_ratio)
            else:  # nothing to measure: the gate neither moves nor counts a warm-up step
                g = state.g if state.warm_entropy is not None else 0
            lam = g * lam_max
            metrics["antisd/gate"] = torch.tensor(float(g))
            if h is not None:
                metrics["antisd/teacher_entropy_median"] = torch.tensor(h)
        student = detached(batch.student_logp)
        teacher = detached(batch.teacher_logp)
        ok = valid_tokens(batch, student, teacher)
        u = zero_where_not(ok, teacher) - zero_where_not(ok, student)
        phi = antisd_phi(u)
        delta = zero_where_not(ok, -lam * phi)
        metrics["antisd/lambda"] = torch.tensor(float(lam))
        metrics["antisd/pmi_mean"] = masked_mean(u, ok)
        metrics["antisd/bonus_frac"] = masked_mean((u < 0).float(), ok)
    return DistillTerms(token_advantage=delta, metrics=metrics)
