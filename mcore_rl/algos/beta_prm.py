"""BetaPRM's Beta head and loss ("Process Rewards with Learned Reliability", 2026): per reasoning
step, a Beta belief over the success probability of the step's prefix, mean μ and concentration κ,
trained on Monte-Carlo continuation counts (K of N continuations from the prefix succeeded).

Parameterisation Beta(a, b), a = μκ, b = (1 − μ)κ, from a two-output head: μ = σ(z₀), κ = softplus(z₁).
The likelihood of a count is Beta-Binomial:

    P(K | N, a, b) = C(N, K) · B(K + a, N − K + b) / B(a, b)

The paper describes, without a formula, a regulariser that penalises a high κ where μ disagrees with
K/N; here it is log(1 + κ) · (μ − K/N)², zero at μ = K/N and growing with κ elsewhere. Best-of-N
with adaptive compute stops when the best candidate's lower confidence bound exceeds every other
candidate's upper bound, with σ = sqrt(μ(1 − μ) / (κ + 1)), the Beta's standard deviation; until it
does, the next samples continue from the step prefix with the largest σ_t (`most_uncertain_step`:
"keep sampling from uncertain prefixes"; the paper gives no formula for the choice, this is ours).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def beta_head(raw: torch.Tensor, min_concentration: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """raw [..., 2] -> (μ in (0, 1), κ > 0)."""
    return torch.sigmoid(raw[..., 0].float()), F.softplus(raw[..., 1].float()) + min_concentration


def beta_binomial_log_pmf(k: torch.Tensor, n: torch.Tensor, mu: torch.Tensor, kappa: torch.Tensor) -> torch.Tensor:
    """log P(K = k | n, a = μκ, b = (1 − μ)κ), elementwise; in float64 (differences of large log-gammas
    at a high κ), returned in μ's dtype."""
    k, n = k.double(), n.double()
    a, b = mu.double() * kappa.double(), (1 - mu.double()) * kappa.double()
    log_choose = torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)
    log_beta_num = torch.lgamma(k + a) + torch.lgamma(n - k + b) - torch.lgamma(n + a + b)
    log_beta_den = torch.lgamma(a) + torch.lgamma(b) - torch.lgamma(a + b)
    return (log_choose + log_beta_num - log_beta_den).to(mu.dtype)


def reliability_regularizer(k: torch.Tensor, n: torch.Tensor, mu: torch.Tensor, kappa: torch.Tensor) -> torch.Tensor:
    """log(1 + κ) · (μ − K/N)²: confidence is only cheap where the mean is right."""
    return torch.log1p(kappa) * (mu - k.float() / n.float()) ** 2


def beta_prm_loss(raw: torch.Tensor, k: torch.Tensor, n: torch.Tensor, regularizer_weight: float = 1.0) -> torch.Tensor:
    """Per-step loss [...]: Beta-Binomial NLL of the counts plus the weighted regulariser."""
    mu, kappa = beta_head(raw)
    nll = -beta_binomial_log_pmf(k, n, mu, kappa)
    return nll + regularizer_weight * reliability_regularizer(k, n, mu, kappa)


def beta_std(mu: torch.Tensor, kappa: torch.Tensor) -> torch.Tensor:
    """The Beta's standard deviation sqrt(μ(1 − μ) / (κ + 1))."""
    return torch.sqrt(mu * (1 - mu) / (kappa + 1))


def adaptive_stop(mean: torch.Tensor, std: torch.Tensor, z: float = 1.0) -> bool:
    """Best-of-N's stopping rule over candidates [C]: the best mean's lower bound (mean − z·std)
    exceeds the upper bound (mean + z·std) of every other candidate."""
    if mean.numel() < 2:
        return True
    best = int(torch.argmax(mean))
    others = torch.cat([mean[:best] + z * std[:best], mean[best + 1 :] + z * std[best + 1 :]])
    return bool(mean[best] - z * std[best] > others.max())


def most_uncertain_step(std: list[torch.Tensor], available: list[torch.Tensor]) -> tuple[int, int] | None:
    """Adaptive compute's choice of where to spend the next samples: (candidate, step) with the largest
    σ_t among the `available` steps (per candidate [H] each; the caller marks the step prefixes a
    continuation can still change), the first on ties; None when none is available."""
    best: tuple[int, int] | None = None
    top = -math.inf
    for c, (s, ok) in enumerate(zip(std, available)):
        for t in range(s.numel()):
            if bool(ok[t]) and float(s[t]) > top:
                best, top = (c, t), float(s[t])
    return best
