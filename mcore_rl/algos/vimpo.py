"""VIMPO — "VIMPO: Value-Implicit Policy Optimization for LLMs" (UC Berkeley & Yele, 2026).

No critic network: in a KL-regularised token MDP with deterministic transitions the optimal policy
satisfies β·log π*(a_t|s_t)/π_ref(a_t|s_t) = r_t + γV*(s_{t+1}) − V*(s_t) + β·KL*(s_t), so the
policy/reference log-ratio *is* an implicit value function. Two terms follow:

* the value loss (kind "aux_loss", `vimpo_value`) is where the outcome reward enters, per response

      L_V = ½ [ Σ_t ( β·log π_θ(a_t)/π_ref(a_t) − β·sg[KL_θ(s_t)] ) − (R − R̄) ]²,

  with the group-centred reward R − R̄ read from `seq_advantages`: configure
  `algorithm.advantage: dr_grpo` (mean-centred, no std) for the paper's target; with another
  estimator its advantage is the target (a variant).
* the actor's advantage (kind "advantage_shaping", `vimpo`) is the policy-implied TD advantage
  Â^TD_t = β·log π_old(a_t)/π_ref(a_t) − β·KL_old(s_t) (zero mean under π), accumulated GAE-style,
  Â_t = Σ_l (γλ)^l Â^TD_{t+l} (the summary's summand index t is read as t+l), and
  standardised. It *replaces* the incoming advantage (the reward is not in it); the existing
  `ppo_clip` policy loss trains on it.

The paper's total L_V + c_A·L_A is expressed through coefficients: the policy loss has weight 1, so
configure `aux_losses: [{name: vimpo_value, coef: 1/c_A}]` (c_A = 0.005 → coef 200). That is the
paper's loss times 1/c_A; Adam is invariant to that scale (up to its ε and gradient clipping).
c_A = 0 (value loss only, which the paper finds slow) is not expressible: the policy loss always
has weight 1.

Choices where the summary is unclear (docs/design.md#paper-methods):
* KL(s_t): the summary asks for the exact full-vocabulary KL against π_ref; the learner keeps only
  the sampled tokens' log-probs of π_ref, so KL(s_t) is the k3 estimate e^d − 1 − d (d = log π_ref −
  log π at the sampled token). Its expectation under π is the exact KL (Σ_a π_ref(a) = 1), so
  E_π[Â^TD] = 0 holds exactly, as the paper's does; per token it is noisier.
* The actor advantage uses π_old (computed once per batch, no gradient: the summary leaves the detach
  open; an advantage is a constant of the PPO surrogate). L_V uses π_θ with its gradient and
  sg[KL_θ].
* Standardisation is over the response tokens of the whole rollout batch (the learner's advantage
  phase), not each mini-batch; population std, + ε.
* β, λ are not given: defaults β = 0.1, λ = 0.95, γ = 1 (outcome reward). Use the same β in both
  terms.
* L_V is per response; every token of the response carries it (as a sequence advantage is
  broadcast to its tokens) and it is aggregated with the policy loss's mode, so that both share one
  count: under `seq-mean-token-mean` it is the mean over responses, under `token-mean` each response
  weighs by its length.

Both read π_ref's log-probs (`needs_reference`): validation asks for `algorithm.reference_model`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcore_rl.algos.kl import k3
from mcore_rl.algos.multi_reward import need
from mcore_rl.algos.policy_loss import LossOutput, aggregate
from mcore_rl.algos.registry import register


def td_advantage(logp: torch.Tensor, ref_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """Â^TD = β·(log π − log π_ref) − β·KL, KL by its k3 estimate at the sampled token."""
    return beta * (logp - ref_logp) - beta * k3(logp, ref_logp)


def gae(td: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """Â_t = Σ_l (γλ)^l td_{t+l} over each row's masked tokens (masked-out positions add nothing)."""
    m = mask.to(td.dtype)
    out = torch.zeros_like(td)
    acc = torch.zeros_like(td[:, 0])
    for t in range(td.shape[1] - 1, -1, -1):
        acc = td[:, t] * m[:, t] + gamma * lam * acc
        out[:, t] = acc
    return out * m


def standardize(values: torch.Tensor, mask: torch.Tensor, eps: float) -> torch.Tensor:
    """(x − mean) / (std + ε) over the masked tokens (population std); 0 outside the mask."""
    m = mask.to(torch.float64)
    x = values.double()
    count = m.sum().clamp_min(1)
    mean = (x * m).sum() / count
    std = (((x - mean) * m).square().sum() / count).sqrt()
    return ((x - mean) / (std + eps) * m).to(values.dtype)


def _need_ref(ref_logp: torch.Tensor | None, like: torch.Tensor, name: str) -> torch.Tensor:
    if ref_logp is None or ref_logp.shape != like.shape:
        got = None if ref_logp is None else tuple(ref_logp.shape)
        raise ValueError(
            f"{name} needs π_ref's log-probs {tuple(like.shape)} (algorithm.reference_model: true), got {got}"
        )
    return ref_logp


@register("advantage_shaping", "vimpo")
def vimpo(
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
    beta: float = 0.1,
    gamma: float = 1.0,
    lam: float = 0.95,
    normalize: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """The standardised GAE of π_old's implied TD advantage [N, T]; `advantages` are replaced."""
    need(beta > 0, "beta", f"must be > 0, got {beta}")
    need(0 <= gamma <= 1, "gamma", f"must be in [0, 1], got {gamma}")
    need(0 <= lam <= 1, "lam", f"must be in [0, 1], got {lam}")
    need(eps > 0, "eps", f"must be > 0, got {eps}")
    if old_logp is None or old_logp.shape != advantages.shape:
        raise ValueError(f"vimpo needs π_old's log-probs {tuple(advantages.shape)}")
    ref = _need_ref(ref_logp, old_logp, "vimpo")
    td = td_advantage(old_logp.detach().double(), ref.detach().double(), beta)
    out = gae(td, mask, gamma, lam)
    return (standardize(out, mask, eps) if normalize else out).to(advantages.dtype)


def value_loss_per_sequence(
    logp: torch.Tensor, ref_logp: torch.Tensor, kl: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, beta: float
) -> torch.Tensor:
    """½ [Σ_t m_t (β(log π − log π_ref) − β·kl_t) − target]² per response [n]; `kl` is used as given
    (the caller decides whether it carries a gradient)."""
    m = mask.to(logp.dtype)
    implied = ((beta * (logp - ref_logp) - beta * kl) * m).sum(-1)
    return 0.5 * (implied - target.to(logp.dtype)).square()


@register("aux_loss", "vimpo_value")
def vimpo_value(
    logp: torch.Tensor,
    *,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    rewards: torch.Tensor | None = None,
    seq_advantages: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    agg: str = "token-mean",
    norm_length: int | None = None,
    beta: float = 0.1,
) -> LossOutput:
    """L_V per response with sg[KL_θ], on each of its tokens, aggregated like the policy loss."""
    need(beta > 0, "beta", f"must be > 0, got {beta}")
    ref = _need_ref(ref_logp, logp, "vimpo_value").detach()
    if mask is None or seq_advantages is None or seq_advantages.shape != logp.shape[:1]:
        raise ValueError("vimpo_value needs the token mask and the per-sequence advantages (R − R̄)")
    kl = k3(logp.detach(), ref)  # sg[KL_θ(s_t)]
    per_seq = value_loss_per_sequence(logp, ref, kl, seq_advantages.detach(), mask, beta)
    total, count = aggregate(per_seq[:, None].expand_as(logp), mask, agg, norm_length)
    return LossOutput(total, count, {"vimpo/value_loss": per_seq.detach().mean()})


vimpo.needs_reference = True  # type: ignore[attr-defined]  # a flag on the function, read by the validation (algorithm.reference_model)
vimpo_value.needs_reference = True  # type: ignore[attr-defined]  # a flag on the function object
