"""DelTA — "Discriminative Token Credit Assignment for RLVR" (Gaoling RUC & Ant International, 2026).

A DAPO update moves θ by Σ_{A>0} A·v − Σ_{A<0} |A|·v over tokens, v_{i,t} = ∇_θ log π(o_{i,t}) at θ_old:
an implicit linear discriminator between an |A|-weighted positive centroid μ+ and a negative one μ−.
Tokens whose gradients sit between the two (entities, shared boilerplate) add noise to it. DelTA
weights each token by how much closer its gradient is to its own side's centroid than to the other:

  1. μ±⁽⁰⁾ = |A|-weighted mean of the side's proxies v (side = sign of the token's advantage);
  2. K times: margins Δ⁺ = ‖v−μ−‖² − ‖v−μ+‖² (A > 0), Δ⁻ = −Δ⁺ (A < 0), soft assignments
     α = σ(Δ/γ±) (the maximiser of αΔ + γ·h(α) on [0, 1]), centroids re-weighted by |A|·α;
  3. α* = σ(Δ/γ) at μ±⁽ᴷ⁾, λ = λ_min + (λ_max − λ_min)·α*;
  4. the loss is the self-normalised weighted token mean (1/Σλ) Σ λ_{i,t} ℓ_{i,t} (ℓ: the clipped term).

λ is computed once per rollout batch, without gradient, and kept for every epoch on it.

How it runs here: an `advantage_shaping` step, once per rollout batch in `Learner.prepare`. Every
policy loss here is positively homogeneous in the advantage (λ·min(rA, clip(r)A) = min(r·λA, clip(r)·λA)
for λ >= 0, dual clip included), so the step returns A·λ/mean(λ) and the `token-mean` aggregation
(DAPO's) turns into exactly (1/Σλ) Σ λ ℓ. The mean runs over the batch's training tokens; the
learner's token-mean divides per optimizer step, so with several mini-batches per rollout batch each
mini-batch is normalised by the batch's mean λ rather than its own (equal in expectation).

**The gradient proxy** (what the learner can supply): the paper's v is the LM-head gradient of
log π(y_t), (e_y − p)·h_tᵀ, which needs π_old's full-vocabulary probabilities and the last-layer
hidden states h_t; `train/logprobs.py` computes both inside its chunked vocab-parallel log-softmax and
returns neither. It does return π_old's log-probs at *given* ids (the top-k machinery of on-policy
distillation), so the proxy here is the logit gradient ∂log π(y_t)/∂z = e_y − p restricted to a support S:

    v_{i,t} = (1[v = y_t] − π_old(v))_{v ∈ S},  plus the coordinate 1 − π_old(y_t) at y_t when y_t ∉ S,

S = the `support` most frequent sampled ids of the batch's training tokens (ties: lower id first), whose
log-probs the learner computes in one more forward over the batch (`logp_at`). With
`support: 0` there is no extra forward and v = (1 − π_old(y_t))·e_{y_t}, the sampled coordinate only.
Missing against the paper: the coordinates outside S (π_old's own top-k would need a distributed top-k in
`vocab_parallel_topk_stats`) and the h_t factor (the hidden states out of `gpt_token_stats`): tokens with
the same logit gradient are the same point here whatever their context. `delta_weights` takes any proxy
as sparse rows (ids, values) — a dense [M, D] matrix is `dense_proxy(v)` — so the paper's proxy plugs
in once the learner hands it over.

Chosen where the summary is unclear: γ± = `gamma_scale` · the population std of the side's current
margins (adaptive from the first iteration; their mean |Δ| where that std is 0; `gamma` fixes it
instead); K = `iterations` = 1 (the paper's most stable); λ ∈ [`lam_min`, `lam_max`] = [0.5, 1.5] (not
given; only their ratio matters after the normalisation); `support` = 32 ids; one pair of centroids
over the whole batch, not per group; tokens with A = 0 get α* = 0.5 (they train on nothing but count
in Σλ, as they count in DAPO's token mean); if a side has no tokens, every α* is 0.5 (plain DAPO).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mcore_rl.algos.multi_reward import need
from mcore_rl.algos.registry import register

Proxy = tuple[torch.Tensor, torch.Tensor]  # (ids [M, k] long, values [M, k]): M sparse vectors in R^D


def dense_proxy(v: torch.Tensor) -> Proxy:
    """Dense vectors [M, D] as sparse rows."""
    m, d = v.shape
    return torch.arange(d).expand(m, d), v.double()


def support_ids(ids: torch.Tensor, k: int) -> torch.Tensor:
    """The `k` most frequent of `ids` (ties: lower id first), [min(k, distinct)] long."""
    values, counts = torch.unique(ids.long(), return_counts=True)
    order = torch.argsort(-counts * (int(values.max()) + 2) + values) if values.numel() else values
    return values[order[:k]]


def logit_gradient_proxy(
    targets: torch.Tensor, target_logp: torch.Tensor, support: torch.Tensor, support_logp: torch.Tensor
) -> Proxy:
    """∂log π(y)/∂z = e_y − p on the ids `support` [S] (π's log-probs there: `support_logp` [M, S]),
    and 1 − π(y) at y when y is not in the support; `targets` [M], `target_logp` [M] log π(y)."""
    m = targets.shape[0]
    hit = support.long()[None, :] == targets.long()[:, None]
    vals = hit.double() - support_logp.double().exp()
    own = torch.where(hit.any(1), torch.zeros(m, dtype=torch.float64), -torch.expm1(target_logp.double()))
    ids = torch.cat([support.long()[None, :].expand(m, -1), targets.long()[:, None]], 1)
    return ids, torch.cat([vals, own[:, None]], 1)


def soft_assign(margin: torch.Tensor, gamma: torch.Tensor | float) -> torch.Tensor:
    """argmax_{α ∈ [0,1]} α·Δ + γ·h(α) = σ(Δ/γ) (h the binary entropy, γ > 0)."""
    return torch.sigmoid(margin / gamma)


def centroid(proxy: Proxy, weight: torch.Tensor, dim: int) -> torch.Tensor | None:
    """Σ w·v / Σ w as a dense [dim] vector; None when Σ w is 0 (an empty side)."""
    ids, vals = proxy
    total = weight.double().sum()
    if not total > 0:
        return None
    acc = torch.zeros(dim, dtype=torch.float64).index_add_(
        0, ids.reshape(-1), (weight.double()[:, None] * vals.double()).reshape(-1)
    )
    return acc / total


def positive_margin(proxy: Proxy, mu_pos: torch.Tensor, mu_neg: torch.Tensor) -> torch.Tensor:
    """Δ⁺ = ‖v − μ−‖² − ‖v − μ+‖² = 2·v·(μ+ − μ−) + ‖μ−‖² − ‖μ+‖², [M] (‖v‖² cancels, so only dot
    products with the centroids are needed)."""
    ids, vals = proxy
    diff = mu_pos - mu_neg
    return 2 * (diff[ids] * vals.double()).sum(-1) + mu_neg.dot(mu_neg) - mu_pos.dot(mu_pos)


def _gamma(
    side_margin: torch.Tensor, on_side: torch.Tensor, gamma: float | None, scale: float, eps: float
) -> torch.Tensor:
    if gamma is not None:
        return torch.tensor(float(gamma), dtype=torch.float64)
    x = side_margin[on_side]
    spread = x.std(unbiased=False) if x.numel() > 1 else torch.zeros((), dtype=torch.float64)
    if not spread > eps:  # one token, or all margins equal: their scale instead of a hard 0/1 assignment
        spread = x.abs().mean() if x.numel() else spread
    return (scale * spread).clamp_min(eps)


def delta_weights(
    proxy: Proxy,
    advantages: torch.Tensor,
    *,
    iterations: int = 1,
    lam_min: float = 0.5,
    lam_max: float = 1.5,
    gamma: float | None = None,
    gamma_scale: float = 1.0,
    eps: float = 1e-8,
) -> torch.Tensor:
    """DelTA's λ [M] float64 for M tokens with proxies `proxy` and advantages [M]; no gradient."""
    with torch.no_grad():
        ids, vals = proxy[0].long(), proxy[1].detach().double()
        proxy = (ids, vals)
        adv = advantages.detach().double()
        pos, neg = adv > 0, adv < 0
        alpha = torch.full_like(adv, 0.5)
        dim = int(ids.max()) + 1 if ids.numel() else 1
        mu_pos, mu_neg = centroid(proxy, adv.abs() * pos, dim), centroid(proxy, adv.abs() * neg, dim)
        if mu_pos is not None and mu_neg is not None:
            for k in range(iterations + 1):
                up = positive_margin(proxy, mu_pos, mu_neg)
                side = torch.where(pos, up, -up)  # Δ⁺ on the positive side, Δ⁻ = −Δ⁺ on the negative
                g = torch.where(
                    pos, _gamma(side, pos, gamma, gamma_scale, eps), _gamma(side, neg, gamma, gamma_scale, eps)
                )
                alpha = soft_assign(side, g)
                if k == iterations:  # step 3: α* at μ±⁽ᴷ⁾
                    break
                new_pos = centroid(proxy, adv.abs() * alpha * pos, dim)
                new_neg = centroid(proxy, adv.abs() * alpha * neg, dim)
                mu_pos = mu_pos if new_pos is None else new_pos
                mu_neg = mu_neg if new_neg is None else new_neg
            alpha = torch.where(pos | neg, alpha, torch.full_like(alpha, 0.5))
        return lam_min + (lam_max - lam_min) * alpha


@register("advantage_shaping", "delta")
def delta(
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    rewards: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: torch.Tensor | None = None,
    head_names: Sequence[str] = (),
    entropy: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    response_ids: torch.Tensor | None = None,
    logp_at: Callable[[torch.Tensor], torch.Tensor] | None = None,
    support: int = 32,
    iterations: int = 1,
    lam_min: float = 0.5,
    lam_max: float = 1.5,
    gamma: float | None = None,
    gamma_scale: float = 1.0,
) -> torch.Tensor:
    """The per-token advantages times λ/mean(λ) over the training tokens [N, T] float32 (detached),
    λ from the logit-gradient proxy on the batch's `support` most frequent sampled ids; with
    `loss_agg: token-mean` the loss is DelTA's self-normalised weighted token mean."""
    need(support >= 0, "support", f"must be >= 0 (0: the sampled-token coordinate only), got {support}")
    need(iterations >= 0, "iterations", f"must be >= 0 (K, the alternating iterations), got {iterations}")
    need(lam_min >= 0, "lam_min", f"must be >= 0, got {lam_min}")
    need(lam_max >= lam_min and lam_max > 0, "lam_max", f"must be > 0 and >= lam_min ({lam_min}), got {lam_max}")
    need(
        gamma is None or (isinstance(gamma, (int, float)) and not isinstance(gamma, bool) and gamma > 0),
        "gamma",
        f"must be null (adaptive) or > 0, got {gamma!r}",
    )
    need(gamma_scale > 0, "gamma_scale", f"must be > 0, got {gamma_scale}")
    if response_ids is None or old_logp is None or response_ids.shape != advantages.shape:
        got = None if response_ids is None else tuple(response_ids.shape)
        raise ValueError(
            f"delta needs the sampled token ids {tuple(advantages.shape)} and π_old's log-probs, got response_ids {got}"
        )
    with torch.no_grad():
        on = mask > 0
        out = torch.zeros(advantages.shape, dtype=torch.float32)
        if not bool(on.any()):
            return out
        targets, target_logp = response_ids.detach()[on].long(), old_logp.detach()[on]
        if support == 0:
            proxy = (targets[:, None], (-torch.expm1(target_logp.double()))[:, None])
        else:
            if logp_at is None:
                raise ValueError("delta with support > 0 needs `logp_at` (π_old's log-probs at given ids)")
            ids = support_ids(targets, support)
            proxy = logit_gradient_proxy(targets, target_logp, ids, logp_at(ids).detach()[on])
        adv = advantages.detach()[on].double()
        lam = delta_weights(
            proxy, adv, iterations=iterations, lam_min=lam_min, lam_max=lam_max, gamma=gamma, gamma_scale=gamma_scale
        )
        out[on] = (adv * lam / lam.mean()).float()
        return out
