"""Z-Reward — "Beyond Scalar Rewards by Internalizing Reasoning into Score Distributions" (Z-Image
Team of Alibaba & NKU, 2026), its text analogue: a generative reward model whose verdict is a
distribution over score tokens, not a parsed number.

The model's probabilities of the score tokens at the score position, renormalised over them, are
q(s) over the bins S (the paper: 1.0, 1.5, …, 5.0), and the reward is the expected score
μ = Σ_s s·q(s) — dense, where a parsed text score would quantise it (3.8 and 4.2 both read "4").
The teacher (GDSO) is trained with GRPO on a pointwise and a pairwise reward plus a cross-entropy
on the true bin and a pairwise gap loss; the student (RISD) is distilled to the teacher's score
distribution, KL(q_T ‖ q_φ), and emits it in one token. Pure functions of those quantities; the
student is trained by `mcore-rl rm-train` with `reward_model.objective: score_distribution`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def score_bins(low: float = 1.0, high: float = 5.0, step: float = 0.5) -> torch.Tensor:
    """The paper's score levels: low, low + step, …, high (9 for the defaults)."""
    n = round((high - low) / step) + 1
    return torch.linspace(low, high, n, dtype=torch.float64)


def score_distribution(score_logits: torch.Tensor) -> torch.Tensor:
    """q [..., S]: the score tokens' logits (or log-probs) renormalised over the score tokens."""
    return torch.softmax(score_logits.double(), -1)


def expected_score(q: torch.Tensor, bins: torch.Tensor) -> torch.Tensor:
    """μ = Σ_s s·q(s) [...]."""
    return (q.double() * bins.double()).sum(-1)


def pointwise_reward(mu: torch.Tensor, target: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """r^pt = 1 − |μ − ŝ| / (S_max − S_min)."""
    return 1 - (mu.double() - target.double()).abs() / (high - low)


def pairwise_reward(mu: torch.Tensor, other: torch.Tensor, gap: float, low: float, high: float) -> torch.Tensor:
    """r^pw_i = 1 − 1/(G (S_max − S_min)) Σ_k |(μ_i − μ̄_k) − Δŝ| for one side's G samples `mu` [G]
    against the other side's `other` [G]; Δŝ = ŝ_this − ŝ_other."""
    diffs = (mu.double()[:, None] - other.double()[None, :]) - gap
    return 1 - diffs.abs().mean(1) / (high - low)


def pointwise_ce(q: torch.Tensor, true_bin: torch.Tensor) -> torch.Tensor:
    """L^pt_CE: the mean negative log-probability of the true bin (indices [N] into q [N, S])."""
    return -torch.log(q.gather(-1, true_bin.long()[..., None]).squeeze(-1)).mean()


def pairwise_loss(mu_w: torch.Tensor, mu_l: torch.Tensor, gap: float, low: float, high: float) -> torch.Tensor:
    """L^pw = 1/(2G²(S_max − S_min)) Σ_j Σ_{i,k} |(μ_{j,i} − μ_{j̄,k}) − Δŝ_{j,j̄}| over both sides
    (Δŝ_{w,l} = `gap`, Δŝ_{l,w} = −gap)."""
    g = mu_w.numel()
    total = ((mu_w.double()[:, None] - mu_l.double()[None, :]) - gap).abs().sum()
    total = total + ((mu_l.double()[:, None] - mu_w.double()[None, :]) + gap).abs().sum()
    return total / (2 * g * g * (high - low))


def risd_loss(teacher_q: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """KL(q_T ‖ q_φ) per example [...]: the student's score logits distilled to the teacher's
    distribution (0 exactly where q_φ = q_T; a teacher's zero bins contribute nothing)."""
    log_student = F.log_softmax(student_logits.float(), -1)
    return F.kl_div(log_student, teacher_q.float(), reduction="none").sum(-1)
