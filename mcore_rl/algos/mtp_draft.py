"""Losses that train MTP draft heads to agree with the policy, and what they predict for speculative
sampling (Bebop: "Breaking Entropy Bounds: Accelerating RL Training via MTP with Rejection Sampling").

Under rejection sampling a draft token from q is accepted with probability
α = Σ_y min(p(y), q(y)) = 1 − d_TV(p, q) (p: the policy's distribution there). So the heads are
trained on d_TV itself, with p detached:

* `tv`: the end-to-end loss over γ chained depths, L = 1 − (1/γ) Σ_j Π_{i≤j} α_i, which is one minus
  the expected accepted length over γ; with γ = 1 it is d_TV(p, q). Its gradient w.r.t. a draft
  logit is bounded by 1 in magnitude and does not grow with the entropy of p;
* `ce`: the soft cross-entropy −Σ p log q per depth (gradient q − p w.r.t. the logits), the usual
  distillation loss, as the alternative the paper compares with.

Pure tensor functions over rows: logits [N, V] or per-depth lists of them.
"""

from __future__ import annotations

from typing import Literal

import torch

MTPLoss = Literal["tv", "ce"]


def acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """α = Σ_v min(p_v, q_v) = 1 − d_TV(p, q) per row: the chance a draft from q is accepted
    against p by rejection sampling. p, q [..., V] probabilities."""
    return torch.minimum(p, q).sum(-1)


def tv_distance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """d_TV(p, q) = ½ Σ_v |p_v − q_v| = 1 − Σ_v min(p_v, q_v) per row."""
    return 1.0 - acceptance(p, q)


def expected_accepted_length(alphas: torch.Tensor) -> torch.Tensor:
    """E[L] = α_1 + α_1 α_2 + … + Π_{i≤γ} α_i per row; alphas [γ, N] (depth-major)."""
    return torch.cumprod(alphas, dim=0).sum(0)


def e2e_tv_loss(alphas: torch.Tensor) -> torch.Tensor:
    """Bebop's L_e2e = 1 − (1/γ) Σ_j Π_{i≤j} α_i per row; alphas [γ, N]."""
    return 1.0 - expected_accepted_length(alphas) / alphas.shape[0]


def mtp_draft_loss(
    policy_logits: list[torch.Tensor], draft_logits: list[torch.Tensor], kind: MTPLoss
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss [N] and the detached per-depth acceptance [γ, N] of γ draft depths.

    `policy_logits[d]` [N, V]: the policy's logits where depth d's draft is verified (detached here);
    `draft_logits[d]` [N, V]: depth d's logits for the same token. Row n of every depth belongs to the
    same anchor position (the drafts of one speculative step)."""
    if len(policy_logits) != len(draft_logits) or not draft_logits:
        raise ValueError(f"mtp_draft_loss: {len(policy_logits)} policy and {len(draft_logits)} draft depths")
    p = [logits.detach().float().softmax(-1) for logits in policy_logits]
    q_logp = [logits.float().log_softmax(-1) for logits in draft_logits]
    alphas = torch.stack([acceptance(pd, lq.exp()) for pd, lq in zip(p, q_logp)])
    if kind == "tv":
        loss = e2e_tv_loss(alphas)
    elif kind == "ce":
        floor = torch.finfo(torch.float32).min  # padded vocabulary columns: p = 0, log q = -inf
        loss = torch.stack([-(pd * lq.clamp(min=floor)).sum(-1) for pd, lq in zip(p, q_logp)]).mean(0)
    else:
        raise ValueError(f"mtp_draft_loss: kind {kind!r}: expected 'tv' or 'ce'")
    return loss, alphas.detach()
