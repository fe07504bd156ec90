"""Reward-model losses: Bradley–Terry on preference pairs (with a margin and ties) and pointwise
binary labels. Pure tensor functions of the scores a value head gives; one value per pair or per
response, so the caller chooses the reduction (`train/reward_model.py` sums and divides by the global
count, like the token losses).

Bradley–Terry, P(chosen ≻ rejected) = σ(r_c − r_r). With a margin m ≥ 0 (the preference strength of
"Llama 2: Open Foundation and Fine-Tuned Chat Models", arXiv:2307.09288):

    L = −log σ(r_c − r_r − m)

A tie is a preference of strength ½ both ways, the binary cross-entropy of σ(r_c − r_r) against ½:

    L_tie = −½ [log σ(r_c − r_r) + log σ(r_r − r_c)]

which is minimal (log 2) at r_c = r_r and pulls the two scores together; its margin is ignored.

Pointwise binary (a thumbs-up/down label y ∈ [0, 1], e.g. "P[Love]" of RLUF): the cross-entropy of
σ(r) against y, soft labels allowed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: torch.Tensor | None = None,
    tie: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-pair loss [P] from the scores of the chosen and rejected responses [P]; `margin` [P] ≥ 0,
    `tie` [P] bool (a tie ignores its margin)."""
    diff = chosen.float() - rejected.float()
    shifted = diff - margin.float() if margin is not None else diff
    loss = -F.logsigmoid(shifted)
    if tie is not None:
        tied = -0.5 * (F.logsigmoid(diff) + F.logsigmoid(-diff))
        loss = torch.where(tie.bool(), tied, loss)
    return loss


def pointwise_binary_loss(score: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Per-response loss [N]: cross-entropy of σ(score) against the label in [0, 1]."""
    return F.binary_cross_entropy_with_logits(score.float(), label.float(), reduction="none")


def pair_correct(chosen: torch.Tensor, rejected: torch.Tensor, tie: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair 1.0 where the chosen response scores strictly higher, 0.0 otherwise, NaN for ties
    (a tie has no right order: accuracy is over the strict pairs)."""
    right = (chosen > rejected).float()
    if tie is None:
        return right
    return torch.where(tie.bool(), torch.full_like(right, float("nan")), right)


def binary_correct(score: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Per-response 1.0 where σ(score) falls on the label's side of ½, NaN for a label of exactly ½."""
    right = ((score > 0) == (label > 0.5)).float()
    return torch.where(label == 0.5, torch.full_like(right, float("nan")), right)


def rrm_keep(first: torch.Tensor, second: torch.Tensor, target: torch.Tensor, threshold: float = 0.2) -> torch.Tensor:
    """RRM's filter of augmented pairs ("RRM: Robust Reward Model Training Mitigates Reward
    Hacking", arXiv:2409.13156): keep a pair where the base model's P(first ≻ second) = σ(r₁ − r₂)
    is off its target (1 for a preference, ½ for a tie) by at least `threshold` (bool [P])."""
    p_hat = torch.sigmoid(first.float() - second.float())
    return (p_hat - target.float()).abs() >= threshold
