"""EffOPD, "Learning to Foresee: Unveiling the Unlocking Efficiency of On-Policy Distillation"
(USTC & Tencent, 2026): on-policy distillation moves the weights along a nearly fixed, low-rank
direction early on, so jumping ahead along it saves steps. At steps t = 2^n (1, 2, 4, 8, …) take
the displacement since the previous such step,

    Δ_n = W_{2^n} − W_{2^(n−1)},   candidates  W̃_{n,k} = W_{2^n} + 2k · Δ_n,  k = 1..5,

score them in order on a small validation set (50 training samples) and keep the last candidate
of the unbroken run whose score does not drop (≥: ties accept); the first drop stops the search.
If candidate 1 already drops, training continues from W_{2^n} unchanged (vanilla OPD).

Not a loss: pure functions on lists of parameter tensors (one entry per tensor, any shards, as
the arithmetic is elementwise). `mcore_rl.recipes.effopd.WeightExtrapolator` applies them to the
model chunks and the optimizer's fp32 masters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NUM_CANDIDATES = 5
SCALE = 2.0  # candidate k moves by SCALE · k · Δ: coefficients 2, 4, 6, 8, 10


def is_extrapolation_step(step: int) -> bool:
    """True at steps 1, 2, 4, 8, 16, … (step = number of updates done so far)."""
    return step >= 1 and step & (step - 1) == 0


def displacement(current: Sequence[torch.Tensor], anchor: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Δ = current − anchor, per tensor, in fp32."""
    if len(current) != len(anchor):
        raise ValueError(f"{len(current)} tensors vs {len(anchor)} in the anchor")
    return [c.detach().float() - a.detach().float() for c, a in zip(current, anchor)]


def candidate(
    base: Sequence[torch.Tensor],
    delta: Sequence[torch.Tensor],
    k: int,
    scale: float = SCALE,
) -> list[torch.Tensor]:
    """W̃_k = base + scale·k·Δ (fp32); k = 0 is `base` itself, exactly."""
    if k == 0:
        return [b.detach().float().clone() for b in base]
    return [b.detach().float() + (scale * k) * d for b, d in zip(base, delta)]


def accepts(score: float, accepted_score: float) -> bool:
    """The validation check: a candidate is kept when its score does not drop (ties accept)."""
    return score >= accepted_score


def accepted_count(base_score: float, candidate_scores: Sequence[float]) -> int:
    """How many candidates, in order, pass `accepts` against the last accepted score before the
    first failure (0: keep the base weights). Scores after the first failure are ignored, so the
    caller may stop evaluating there."""
    best, k = base_score, 0
    for score in candidate_scores:
        if not accepts(score, best):
            break
        best, k = score, k + 1
    return k
