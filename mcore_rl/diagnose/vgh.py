"""VGH — the Value-Gradient Hypothesis of RL for LLMs (MBZUAI, 2026): `mcore-rl diagnose vgh`.

The paper claims that critic-free RL (GRPO/PPO) is not value-free: in expectation the actor update is a
value-gradient update through the Transformer's approximately differentiable attention path around token
sampling, with an error bounded by the token entropy. It predicts the gain of RL from a checkpoint as
"usable value-gradient signal × reachable reward headroom", P_gap = (Σ − Λ_m)·H_α, and picks the RL
starting checkpoint N* = argmax_N P_gap(θ_N). Nothing in training changes; this is a measurement.

What is measured, on G rollouts per prompt of the policy (embedded engine, the recipe's reward):

- Reward headroom H_α(θ) = E_q[(1/α) log E_τ e^{αR(τ)} − E_τ R(τ)] from the sampled group rewards
  (`headroom`); exact, and the only part the summary calls usable in a real trainer. For 0/1 rewards with
  pass rate p it is (1/α) log(1 − p + p e^α) − p (`binary_headroom`); 1 − pass rate is reported too.
- The empirical costate λ̂_t = ∂/∂h_t Σ_{k≥t} Â_k ℓ_k (`costates`), with Â_k the GRPO group-normalised
  reward of the sequence and ℓ_k = log π_θ(o_k | s_k) (the PPO/GRPO surrogate at ρ = 1 has this gradient).
  One backward pass of Σ_k Â_k ℓ_k gives every λ̂_t at once: causal attention makes ∂ℓ_k/∂h_t = 0 for k < t.
- The entropy bound of Proposition 2, b_t = sqrt(H_t / log|V|) (`entropy_bound`): the relative size of the
  Jacobian term through the sampled token that the attention path misses.

Choices where the summary is unclear (docs/design.md#paper-methods; each reported in the output):

- h_t^{(L)} is the residual stream *entering* the last decoder layer. The output of the last layer feeds only
  the LM head, so a gradient there has no attention path J_{t+1←t} at all and the recursion of λ̂ would be
  empty; the last layer's input is the latest hidden state that later positions attend to.
- The true value gradient G_t exists only for a differentiable reward (the paper's label-copy toy); with a
  verifier's reward it cannot be measured. Σ = E‖G_t‖² is estimated by E‖λ̂_t‖² and the costate error
  ‖E[λ̂_t|h_t] − G_t‖ by the entropy bound with C = 1, ‖λ̂_t‖·b_t, so Λ̂ = E[‖λ̂_t‖² b_t] and the usable
  signal Ŝ = E[‖λ̂_t‖² (1 − b_t)] (`usable_signal`). This is a proxy built from the paper's own bound, not
  the paper's S_m (whose index m the summary does not define); P_gap is reported as Ŝ·H_α with that caveat.
- α is not given: `--alpha` (several allowed), default 1. ℓ and H_t are those of the sampling distribution
  (logits / temperature), as the engine samples and the learner recomputes π.
"""

from __future__ import annotations

import argparse
import math
from typing import Any
from collections.abc import Sequence

import torch

from mcore_rl.diagnose import analysis

# ---------------------------------------------------------------- the reward headroom


def _groups(rewards: Sequence[Sequence[float]] | torch.Tensor) -> list[torch.Tensor]:
    rows = [torch.as_tensor(r, dtype=torch.float64).flatten() for r in rewards]
    if any(r.numel() == 0 for r in rows):
        raise ValueError("every prompt needs at least one sampled reward")
    return rows


def headroom(rewards: Sequence[Sequence[float]] | torch.Tensor, alpha: float) -> torch.Tensor:
    """H_α of each prompt (one row of sampled rewards each; rows may differ in length):
    (1/α) log mean_j e^{α r_j} − mean_j r_j, computed as (1/α) log mean_j e^{α (r_j − r̄)} (the same value,
    without the cancellation of two large terms). α = inf gives the limit max − mean; α must be > 0."""
    if not alpha > 0:  # also rejects nan
        raise ValueError(f"alpha must be > 0, got {alpha}")
    out = []
    for r in _groups(rewards):
        centred = r - r.mean()
        if math.isinf(alpha):
            out.append(centred.max())
        else:
            value = (torch.logsumexp(alpha * centred, 0) - math.log(r.numel())) / alpha
            out.append(value.clamp_min(0.0))  # >= 0 by Jensen; the clamp removes only rounding (~1e-17)
    return torch.stack(out)


def binary_headroom(p: float | torch.Tensor, alpha: float) -> torch.Tensor:
    """H_α of a 0/1 reward with pass rate p: (1/α) log(1 − p + p e^α) − p."""
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    p = torch.as_tensor(p, dtype=torch.float64)
    return torch.log1p(p * math.expm1(alpha)) / alpha - p


# ---------------------------------------------------------------- the value-gradient measurements


def costates(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """λ̂ [B, S, d]: the gradient of Σ_{b,k} mask·Â_b·log π(targets[b,k] | ids[b,:k+1]) with respect to the
    hidden states entering the last decoder layer, and the logits [B, S, V] / temperature (detached).

    `model` is a `McoreRLForCausalLM`; `mask[b, s]` marks the positions whose next token is a
    response token (`targets[b, s]`); `advantages` [B] is the (stop-gradient) sequence advantage.
    Right padding is harmless: a causal model's real positions never see it."""
    decoder: Any = model.model  # the reference model's decoder stack, read by name (torch types it `Tensor | Module`)
    layers = decoder.layers
    captured: list[torch.Tensor] = []

    def leaf(module: torch.nn.Module, args: tuple) -> tuple:
        h = args[0].detach().requires_grad_(True)
        captured.append(h)
        return (h,) + tuple(args[1:])

    handle = layers[len(layers) - 1].register_forward_pre_hook(leaf)
    try:
        with torch.enable_grad():
            logits = model(input_ids).logits
            logits = (logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits) / temperature
            if not captured:
                raise ValueError(
                    "the model's last decoder layer was not called (AttnRes models route around it); "
                    "the costate needs its input"
                )
            logp = torch.log_softmax(logits, -1).gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            objective = (logp * mask.to(logp.dtype) * advantages.to(logp.dtype)[:, None]).sum()
            (grad,) = torch.autograd.grad(objective, captured[0], allow_unused=False)
    finally:
        handle.remove()
    return grad.detach(), logits.detach()


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H_t = −Σ_v π log π of each position's distribution (logits already divided by the temperature)."""
    logp = torch.log_softmax(logits.double(), -1)
    return -(logp.exp() * logp).sum(-1)


def entropy_bound(logits: torch.Tensor) -> torch.Tensor:
    """b_t = sqrt(H_t / log|V|) ∈ [0, 1] (Proposition 2 with C = 1): 0 for a deterministic token, 1 for uniform."""
    vocab = logits.shape[-1]
    return (token_entropy(logits) / math.log(vocab)).clamp(0.0, 1.0).sqrt()


def usable_signal(costate_sq: torch.Tensor, bound: torch.Tensor) -> dict[str, float]:
    """Σ̂ = E‖λ̂_t‖², Λ̂ = E[‖λ̂_t‖² b_t], Ŝ = Σ̂ − Λ̂ over the response tokens given (flat [M] each)."""
    if costate_sq.numel() == 0:
        raise ValueError("no response tokens to measure the costate on")
    sq, b = costate_sq.double(), bound.double()
    sigma, lam = float(sq.mean()), float((sq * b).mean())
    return {"sigma": sigma, "lambda": lam, "usable_signal": sigma - lam}


# ---------------------------------------------------------------- the command


def measure(
    model: torch.nn.Module, groups: list[list[Any]], temperature: float, alphas: Sequence[float], threshold: float = 1.0
) -> dict[str, Any]:
    """Every number of the analysis from scored groups of `Sample`s (one group per prompt)."""
    from mcore_rl.algos.advantages import grpo  # lazy: numpy

    rewards = [[float(s.reward) for s in g] for g in groups]
    flat = torch.tensor([r for g in rewards for r in g], dtype=torch.float64)
    gid = torch.tensor([i for i, g in enumerate(groups) for _ in g])
    adv = grpo(flat, gid, normalize_std=True)
    passed = (flat >= threshold).double()
    sq_all, bound_all, ent_all = [], [], []
    start = 0
    for g in groups:
        seqs = [s.prompt.ids + s.response_ids for s in g]
        width = max(len(x) for x in seqs)
        ids = torch.zeros(len(g), width, dtype=torch.long)
        targets = torch.zeros_like(ids)
        mask = torch.zeros(len(g), width, dtype=torch.bool)
        for b, (s, x) in enumerate(zip(g, seqs)):
            ids[b, : len(x)] = torch.tensor(x)
            targets[b, : len(x) - 1] = torch.tensor(x[1:])
            p = len(s.prompt.ids)
            mask[b, p - 1 : len(x) - 1] = True
        a = adv[start : start + len(g)]
        start += len(g)
        if not mask.any():
            continue
        lam, logits = costates(model, ids, targets, mask, a, temperature)
        sq_all.append((lam.double() ** 2).sum(-1)[mask])
        bound_all.append(entropy_bound(logits)[mask])
        ent_all.append(token_entropy(logits)[mask])
    sq, bound, ent = torch.cat(sq_all), torch.cat(bound_all), torch.cat(ent_all)
    signal = usable_signal(sq, bound)
    p_rate = float(passed.mean())
    per_prompt_constant = [len(set(r)) == 1 for r in rewards]
    rows = []
    for alpha in alphas:
        h = float(headroom(rewards, alpha).mean())
        rows.append({"alpha": alpha, "H_alpha": h, "P_gap": signal["usable_signal"] * h})
    return {
        "reward": {
            "mean": float(flat.mean()),
            "pass_rate": p_rate,
            "headroom_1_minus_pass_rate": 1.0 - p_rate,
            "constant_groups": float(sum(per_prompt_constant)) / len(groups),
        },
        "value_gradient": {
            "hidden_state": "input of the last decoder layer",
            "response_tokens": int(sq.numel()),
            "sigma_costate_sq": signal["sigma"],
            "lambda_entropy_bound": signal["lambda"],
            "usable_signal": signal["usable_signal"],
            "entropy_mean": float(ent.mean()),
            "entropy_bound_mean": float(bound.mean()),
        },
        "headroom": rows,
    }


@analysis("vgh", "VGH: usable value-gradient signal x reward headroom (P_gap) of a model on a recipe's task")
def add_arguments(parser: argparse.ArgumentParser):
    from mcore_rl.diagnose.rollouts import add_policy_arguments  # lazy: yaml

    add_policy_arguments(parser)
    parser.add_argument(
        "--alpha",
        type=float,
        action="append",
        default=None,
        help="α of H_α (repeat for several; default 1; inf: max − mean)",
    )
    parser.add_argument("--threshold", type=float, default=1.0, help="a rollout passes when its reward >= this")

    def run(args: argparse.Namespace) -> dict[str, Any]:
        from mcore_rl.diagnose.rollouts import load_policy, sample_groups, take_prompts  # lazy: yaml

        alphas = args.alpha or [1.0]
        for a in alphas:
            if not a > 0:
                raise ValueError(f"--alpha must be > 0, got {a}")
        policy = load_policy(args)
        prompts = take_prompts(policy, args.prompts, args.split)
        t = policy.cfg.rollout.temperature if args.temperature is None else args.temperature
        if not t > 0:
            raise ValueError(f"the rollouts must be sampled (temperature > 0), got {t}")
        groups = sample_groups(policy, prompts, args.group_size, t)
        out = {"policy": policy.source, "prompts": len(prompts), "group_size": args.group_size, "temperature": t}
        out.update(measure(policy.model, groups, t, alphas, args.threshold))
        return out

    return run
