"""GoLongRL's TMN-Reweight (Kuaishou & UCAS, 2026): task-normalised advantages with difficulty reweighting.

Multi-task batches mix reward types of different scales (EM, F1, ROUGE, …). Dividing each prompt
by its own std (GRPO) makes every prompt unit-variance and erases how informative the prompt is;
TMN divides by the *task's* RMS of per-prompt stds instead, so each task gets the same gradient
scale while prompts inside it keep their relative spread:

    Â_i = (r_i − μ_u) / (σ_task + δ),   σ_task = sqrt(mean_{u in task} σ_u²),   σ_u: Bessel std.

Then a difficulty weight w = exp(0.5 − p̂), p̂ = the share of the prompt's rollouts above the
smoothed mean μ̃ = α μ_u + (1 − α) μ_task: positive advantages ×w, the others ÷w, so hard prompts
amplify their successes and damp their failures (easy ones the reverse); w ∈ [e^−0.5, e^0.5].

Task = domain (`domain_ids`; None = one task). μ_task is the mean reward of the domain's valid
samples in the batch; σ_task is over the domain's groups with >= 2 valid samples. The summary's note
that "the mean subtracted is the mean over all tasks" contradicts its formula; this implements the
formula (per-prompt μ_u). A task whose prompts are all constant has σ_task = 0: advantage 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_rl.algos.advantages import kept, valid_mask
from mcore_rl.algos.multi_reward import domains_of, group_domains, group_index, group_moments, need
from mcore_rl.algos.registry import register


def difficulty_weight(p_hat: torch.Tensor) -> torch.Tensor:
    """w = exp(0.5 − p̂): 1 at p̂ = 0.5, e^0.5 for a prompt nobody beats the mean on."""
    return torch.exp(0.5 - p_hat)


def reweight(a_hat: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Ã = Â·w where Â > 0, Â/w otherwise (w > 0, so the sign never changes)."""
    return torch.where(a_hat > 0, a_hat * w, a_hat / w)


@register("advantage", "golongrl")
def golongrl(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    normalize_std: bool = True,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: torch.Tensor | None = None,
    head_names: Sequence[str] = (),
    alpha: float = 0.8,
    delta: float = 1e-6,
    difficulty_reweight: bool = True,
) -> torch.Tensor:
    """TMN-Reweight advantages [N]. `alpha` mixes the prompt mean into μ̃ (0.8 in the paper), `delta`
    guards the division, `difficulty_reweight=False` gives TMN alone. (`normalize_std`, the heads:
    part of the advantage signature only; TMN defines its own normalisation on the scalar reward.)"""
    need(0.0 <= alpha <= 1.0, "alpha", f"must be in [0, 1], got {alpha}")
    need(delta >= 0.0, "delta", f"must be >= 0, got {delta}")
    ok = valid_mask(rewards, group_ids, valid)
    n = rewards.shape[0]
    dom = domains_of(domain_ids, n)
    inverse, k = group_index(group_ids)
    if k == 0:
        return torch.zeros(0)
    gdom = group_domains(dom, inverse, k)
    r = torch.where(ok, rewards.double(), torch.zeros((), dtype=torch.float64))
    count, mu_u, var_pop = group_moments(r, inverse, k, ok)
    has = count >= 2
    var_u = torch.where(has, var_pop * count / (count - 1).clamp_min(1), torch.zeros_like(var_pop))
    d = int(dom.max()) + 1
    task_sq = torch.zeros(d, dtype=torch.float64).index_add_(0, gdom, var_u)
    task_groups = torch.zeros(d, dtype=torch.float64).index_add_(0, gdom, has.double())
    sigma_task = (task_sq / task_groups.clamp_min(1)).sqrt()
    mu_task = torch.zeros(d, dtype=torch.float64).index_add_(0, dom, r) / torch.zeros(
        d, dtype=torch.float64
    ).index_add_(0, dom, ok.double()).clamp_min(1)
    s = sigma_task[gdom][inverse]
    a_hat = torch.where(s > 0, (r - mu_u[inverse]) / (s + delta), torch.zeros_like(r))
    adv = a_hat
    if difficulty_reweight:
        mu_tilde = alpha * mu_u + (1 - alpha) * mu_task[gdom]
        above = ((r > mu_tilde[inverse]) & ok).double()
        p_hat = torch.zeros(k, dtype=torch.float64).index_add_(0, inverse, above) / count.clamp_min(1)
        adv = reweight(a_hat, difficulty_weight(p_hat)[inverse])
    return kept(adv, count[inverse], ok)
