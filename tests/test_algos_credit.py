"""Credit assignment: W-REINFORCE (advantage "w_reinforce", policy loss "reinforce"), the Unlikeliness
reward (reward shaping "unlikeliness") and DelTA (advantage shaping "delta").

Each paper's testable properties (docs/papers.md) are tests here, with autograd on real logits where they are about
gradients; the config test loads every key from YAML and checks that bad values name their dotted key;
the learner test runs them in a spawned gloo world.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import replace

import pytest
import torch

from mcore_rl import algos
from mcore_rl.algos.advantages import grpo
from mcore_rl.algos.gigpo import gigpo
from mcore_rl.algos.step_credit import StepBatch, state_key
from mcore_rl.algos.delta import (
    centroid,
    delta,
    delta_weights,
    dense_proxy,
    logit_gradient_proxy,
    positive_margin,
    soft_assign,
    support_ids,
)
from mcore_rl.algos.multi_reward import declared_inputs, option_problems
from mcore_rl.algos.policy_loss import clipped_surrogate, ppo_clip, reinforce
from mcore_rl.algos.unlikeliness import likelihood_ranks, unlikeliness
from mcore_rl.algos.w_reinforce import pi_form_objective, w_reinforce
from mcore_rl.config import ConfigError, RLConfig, load_config, validate_rl_config
from tests.helpers import TINY, tiny
from tests.world import run_world


def test_registered_by_name() -> None:
    assert algos.get("advantage", "w_reinforce") is w_reinforce
    assert algos.get("policy_loss", "reinforce") is reinforce
    assert algos.get("reward_shaping", "unlikeliness") is unlikeliness
    assert algos.get("advantage_shaping", "delta") is delta


# ------------------------------------------------------------------------------------ W-REINFORCE


def _logp_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)


def test_w_reinforce_advantages_have_no_baseline() -> None:
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    gids = torch.tensor([0, 0, 0, 1, 2])  # group 2 holds one sample: no baseline is needed, it trains
    valid = torch.tensor([True, True, False, True, True])
    a = w_reinforce(r, gids, valid=valid)
    assert a.tolist() == pytest.approx([0.1, -1.0, 0.0, -1.0, 0.1])
    assert w_reinforce(torch.tensor([1.0, -1.0]), torch.zeros(2, dtype=torch.long), lam=0.0).tolist() == [0.0, -1.0]
    assert w_reinforce(
        torch.tensor([0.7, 0.3]), torch.zeros(2, dtype=torch.long), correct_threshold=0.5, lam=0.2
    ).tolist() == pytest.approx([0.2, -1.0])


def test_lambda_one_is_vanilla_reinforce_and_lambda_zero_on_all_correct_gives_zero_gradient() -> None:
    """Property 1, on a real (linear-head) model's logits through the `reinforce` policy loss."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 5, 8, generator=gen)
    head = torch.randn(11, 8, generator=gen, requires_grad=True)
    targets = torch.randint(0, 11, (6, 5), generator=gen)
    mask = torch.ones(6, 5)
    mask[0, 3:] = 0
    rewards = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0])
    gids = torch.tensor([0, 0, 0, 1, 1, 1])

    def grad(adv: torch.Tensor) -> torch.Tensor:
        logp = _logp_of(hidden @ head.T, targets)
        out = reinforce(logp, logp.detach(), adv, mask)
        (g,) = torch.autograd.grad(out.loss, head)
        return g

    logp = _logp_of(hidden @ head.T, targets)
    vanilla = -(rewards[:, None] * logp * mask).sum() / mask.sum()  # REINFORCE with r ∈ {±1}
    (want,) = torch.autograd.grad(vanilla, head)
    torch.testing.assert_close(grad(w_reinforce(rewards, gids, lam=1.0)), want)
    assert not torch.allclose(grad(w_reinforce(rewards, gids, lam=0.1)), want)  # λ matters

    all_correct = torch.ones(6)
    assert torch.count_nonzero(grad(w_reinforce(all_correct, gids, lam=0.0))) == 0
    assert torch.count_nonzero(grad(w_reinforce(all_correct, gids, lam=0.1))) > 0  # control: PSR at λ > 0


def test_pi_form_token_gradients_psr_nsr_and_proportional_redistribution() -> None:
    """Properties 2 and 3: −∂L/∂z of the π-form token loss, from autograd on the logits."""
    gen = torch.Generator().manual_seed(1)
    v_size, y = 7, 2
    logits = torch.randn(1, 1, v_size, generator=gen, dtype=torch.float64, requires_grad=True)
    targets, mask = torch.tensor([[y]]), torch.ones(1, 1)
    pi = torch.softmax(logits.detach()[0, 0], -1)
    onehot = torch.nn.functional.one_hot(torch.tensor(y), v_size).double()
    psr_want = pi[y] * (onehot - pi)  # +π_y(1−π_y) at y, −π_y π_v elsewhere
    (g,) = torch.autograd.grad(pi_form_objective(logits, targets, mask, torch.tensor([True]), 1.0), logits)
    psr = -g[0, 0]
    (g,) = torch.autograd.grad(pi_form_objective(logits, targets, mask, torch.tensor([False]), 1.0), logits)
    nsr = -g[0, 0]
    torch.testing.assert_close(psr, psr_want)
    assert psr[y] == pytest.approx(float(pi[y] * (1 - pi[y])))
    torch.testing.assert_close(nsr, -psr_want)
    assert abs(float(psr.sum())) < 1e-12 and abs(float(nsr.sum())) < 1e-12
    for v1, v2 in ((0, 1), (3, 6), (5, 4)):
        assert float(nsr[v1] / nsr[v2]) == pytest.approx(float(pi[v1] / pi[v2]), rel=1e-10)
    # control: the log-form gradient (1[v=y] − π_v) is not the π form's
    (g,) = torch.autograd.grad(-_logp_of(logits, targets).sum(), logits)
    assert not torch.allclose(-g[0, 0], psr_want)
    # NSR keeps confident priors and stops by itself: its update vanishes as π_y → 1 and as π_y → 0
    for bias in (30.0, -30.0):
        z = logits.detach().clone()
        z[0, 0, y] += bias
        z.requires_grad_()
        (g,) = torch.autograd.grad(pi_form_objective(z, targets, mask, torch.tensor([False]), 1.0), z)
        assert float(g.abs().max()) < 1e-10


def test_sampled_w_reinforce_has_the_expected_gradient_of_lambda_psr_plus_nsr() -> None:
    """Property 4, exactly: all V^T responses of a bigram model enumerated, each weighted by its
    probability (the `reinforce` loss's IS weights), against ∇(λ·L_PSR + L_NSR) in sequence π form."""
    gen = torch.Generator().manual_seed(2)
    v_size, t_len, lam = 3, 2, 0.1
    table = torch.randn(v_size + 1, v_size, generator=gen, dtype=torch.float64, requires_grad=True)  # row v: BOS
    ys = torch.tensor(list(itertools.product(range(v_size), repeat=t_len)))
    prev = torch.cat([torch.full((ys.shape[0], 1), v_size), ys[:, :-1]], 1)
    correct = torch.tensor([int(a) == int(b) for a, b in ys])  # "correct": a repeated token
    rewards = torch.where(correct, 1.0, -1.0)

    logp = _logp_of(table[prev], ys)  # [9, 2]
    prob = logp.sum(-1).exp()
    objective = -lam * prob[correct].sum() + prob[~correct].sum()
    (want,) = torch.autograd.grad(objective, table)

    logp = _logp_of(table[prev], ys)
    adv = w_reinforce(rewards, torch.arange(ys.shape[0]), lam=lam)
    weights = logp.sum(-1).exp().detach()[:, None].expand_as(logp)
    out = reinforce(logp, logp.detach(), adv, torch.ones_like(logp), is_weights=weights, agg="seq-mean-token-sum")
    (got,) = torch.autograd.grad(out.loss * ys.shape[0], table)  # the mean over responses → the expectation
    torch.testing.assert_close(got, want)
    # control: the same with λ = 1 is another gradient
    adv1 = w_reinforce(rewards, torch.arange(ys.shape[0]), lam=1.0)
    logp = _logp_of(table[prev], ys)
    out = reinforce(logp, logp.detach(), adv1, torch.ones_like(logp), is_weights=weights, agg="seq-mean-token-sum")
    (other,) = torch.autograd.grad(out.loss * ys.shape[0], table)
    assert not torch.allclose(other, want)


def test_reinforce_loss_has_no_ratio_and_no_clip() -> None:
    logp = torch.tensor([[-0.1, -2.0]], requires_grad=True)
    old = torch.tensor([[-3.0, -0.1]])  # far off π_old: PPO would clip both
    adv, mask = torch.tensor([1.0]), torch.ones(1, 2)
    out = reinforce(logp, old, adv, mask, is_weights=torch.tensor([[2.0, 0.5]]))
    (g,) = torch.autograd.grad(out.loss, logp)
    torch.testing.assert_close(g, torch.tensor([[-1.0, -0.25]]))  # −A·w/count, whatever the ratio
    assert float(out.metrics["pg/clipfrac"]) == 0.0
    p = ppo_clip(logp, old, adv, mask)
    assert float(p.metrics["pg/clipfrac"]) > 0  # control


# ------------------------------------------------------------------------------------ Unlikeliness


def _batch(seed: int, groups: int = 5, g: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(groups * g, generator=gen) < 0.5).float()
    gids = torch.arange(groups).repeat_interleave(g)[torch.randperm(groups * g, generator=gen)]
    seq_logp = -torch.rand(groups * g, generator=gen) * 20  # distinct
    return rewards, gids, seq_logp


def test_unlikeliness_wrong_stay_zero_and_correct_lie_in_range() -> None:
    """Property 1."""
    beta = 0.25
    for seed in range(5):
        r, gids, lp = _batch(seed)
        out = unlikeliness(r, gids, seq_logp=lp, beta_rank=beta)
        assert torch.all(out[r == 0] == 0)
        c = out[r == 1]
        assert torch.all((c >= 1 - beta) & (c <= 1))
    # wrong samples stay 0 at every rank, the most likely included
    r = torch.tensor([0.0, 1.0, 1.0, 0.0])
    assert unlikeliness(r, torch.zeros(4, dtype=torch.long), seq_logp=torch.tensor([-1.0, -2.0, -3.0, -4.0]))[
        [0, 3]
    ].tolist() == [0.0, 0.0]


def test_unlikeliness_strictly_increases_with_rank_among_correct() -> None:
    """Property 2: decreasing in likelihood (distinct likelihoods)."""
    for seed in range(5):
        r, gids, lp = _batch(seed)
        out = unlikeliness(r, gids, seq_logp=lp)
        for g in gids.unique():
            sel = (gids == g) & (r == 1)
            order = torch.argsort(lp[sel], descending=True)  # most likely first
            vals = out[sel][order]
            assert torch.all(vals[1:] > vals[:-1]), vals


def test_all_correct_group_gets_signal_most_likely_negative_least_likely_positive() -> None:
    """Property 3, through GRPO; control: without the shaping the group has no signal."""
    r = torch.ones(6)
    gids = torch.zeros(6, dtype=torch.long)
    lp = torch.tensor([-3.0, -0.5, -9.0, -4.0, -1.0, -7.0])
    shaped = unlikeliness(r, gids, seq_logp=lp)
    assert float(shaped.std()) > 0
    adv = grpo(shaped, gids)
    assert adv[lp.argmax()] < 0 and adv[lp.argmin()] > 0
    assert torch.all(grpo(r, gids) == 0)


def test_unlikeliness_values_at_g8_one_based_and_ties() -> None:
    """Property 4 (1-based rank, G = 8), the rank over all valid samples, ties sharing their mean rank."""
    lp = -torch.arange(8.0)  # sample i has rank i + 1
    out = unlikeliness(torch.ones(8), torch.zeros(8, dtype=torch.long), seq_logp=lp)
    assert float(out[0]) == 0.78125 and float(out[7]) == 1.0
    assert out.tolist() == [1 - 0.25 * (8 - k) / 8 for k in range(1, 9)]
    # correct and wrong samples rank together: a correct sample below 7 more likely wrong ones gets 1.0
    r = torch.tensor([0.0] * 7 + [1.0])
    assert unlikeliness(r, torch.zeros(8, dtype=torch.long), seq_logp=lp).tolist() == [0.0] * 7 + [1.0]
    # ties: equal log-probs share the mean of the ranks they span (2 and 3 → 2.5), whatever the order
    tied = torch.tensor([-1.0, -2.0, -2.0, -5.0])
    rank, size = likelihood_ranks(tied, torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool))
    assert rank.tolist() == [1.0, 2.5, 2.5, 4.0] and size.tolist() == [4.0] * 4
    out = unlikeliness(torch.ones(4), torch.zeros(4, dtype=torch.long), seq_logp=tied)
    assert out[1] == out[2] == pytest.approx(1 - 0.25 * 1.5 / 4)
    perm = torch.tensor([3, 1, 0, 2])
    assert (
        unlikeliness(torch.ones(4), torch.zeros(4, dtype=torch.long), seq_logp=tied[perm]).tolist()
        == out[perm].tolist()
    )


def test_unlikeliness_invalid_samples_keep_reward_and_do_not_rank() -> None:
    r = torch.tensor([1.0, 1.0, 1.0, 1.0])
    lp = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    valid = torch.tensor([False, True, True, True])  # G = 3 valid
    out = unlikeliness(r, torch.zeros(4, dtype=torch.long), valid=valid, seq_logp=lp)
    assert out.tolist() == pytest.approx([1.0, 1 - 0.25 * 2 / 3, 1 - 0.25 / 3, 1.0])
    with pytest.raises(ValueError, match="sequence log-probs"):
        unlikeliness(r, torch.zeros(4, dtype=torch.long), seq_logp=None)


# ------------------------------------------------------------------------------------ DelTA


def test_soft_assignment_is_the_entropy_regularised_argmax() -> None:
    """Property 1: σ(Δ/γ) maximises αΔ + γ·h(α) over [0, 1] (grid search)."""
    grid = torch.linspace(1e-6, 1 - 1e-6, 200001, dtype=torch.float64)
    h = -grid * grid.log() - (1 - grid) * (1 - grid).log()
    for d, g in ((0.7, 0.3), (-1.3, 0.5), (0.0, 2.0), (4.0, 1.0)):
        best = float(grid[torch.argmax(grid * d + g * h)])
        assert float(soft_assign(torch.tensor(d), g)) == pytest.approx(best, abs=1e-5)
    assert float(soft_assign(torch.tensor(0.7), 0.3)) == pytest.approx(0.9116, abs=1e-4)


def _ppo_tokens(seed: int = 3) -> dict:
    gen = torch.Generator().manual_seed(seed)
    n, t, v = 6, 5, 9
    ids = torch.randint(0, v, (n, t), generator=gen)
    mask = torch.ones(n, t)
    mask[1, 3:] = 0
    mask[4, 1:] = 0
    seq_adv = torch.tensor([1.2, -0.4, 0.8, -1.5, 0.6, -0.7])
    old_logits = torch.randn(n, t, v, generator=gen) * 2  # π_old
    logits_param = torch.randn(n, t, v, generator=gen, requires_grad=True)  # π_θ, away from π_old: clipping
    return dict(
        ids=ids,
        mask=mask,
        adv=seq_adv[:, None] * mask,
        old=_logp_of(old_logits, ids),
        logits=logits_param,
        old_logits=old_logits,
        logp_at=lambda at: torch.log_softmax(old_logits, -1)[..., at],
    )


def _delta_call(d: dict, **options) -> torch.Tensor:
    return delta(d["adv"], d["mask"], old_logp=d["old"], response_ids=d["ids"], logp_at=d["logp_at"], **options)


def test_equal_lambda_bounds_give_plain_dapo_whatever_the_constant() -> None:
    """Property 2: λ_min = λ_max = c → the self-normalised objective is DAPO's token mean, exactly."""
    d = _ppo_tokens()
    logp = _logp_of(d["logits"], d["ids"])
    plain = ppo_clip(logp, d["old"], d["adv"], d["mask"], clip_high=0.28)
    for c in (0.3, 1.0, 7.0):
        shaped = _delta_call(d, lam_min=c, lam_max=c)
        assert torch.equal(shaped, d["adv"].float())
        out = ppo_clip(logp, d["old"], shaped, d["mask"], clip_high=0.28)
        assert torch.equal(out.loss, plain.loss)


def test_margin_is_affine_and_an_equidistant_token_gets_the_middle_weight() -> None:
    """Property 3: Δ⁺ = ‖v−μ−‖² − ‖v−μ+‖² = 2v·(μ+−μ−) + ‖μ−‖² − ‖μ+‖²; v equidistant → α* = 0.5."""
    gen = torch.Generator().manual_seed(4)
    v = torch.randn(20, 6, generator=gen, dtype=torch.float64)
    mu_p, mu_n = torch.randn(6, generator=gen, dtype=torch.float64), torch.randn(6, generator=gen, dtype=torch.float64)
    explicit = ((v - mu_n) ** 2).sum(-1) - ((v - mu_p) ** 2).sum(-1)
    torch.testing.assert_close(positive_margin(dense_proxy(v), mu_p, mu_n), explicit)
    torch.testing.assert_close(explicit, 2 * v @ (mu_p - mu_n) + mu_n @ mu_n - mu_p @ mu_p)
    mid = ((mu_p + mu_n) / 2)[None]
    assert float(positive_margin(dense_proxy(mid), mu_p, mu_n).abs()) < 1e-12
    # in the full procedure (K = 0): μ+ = mean of (2,0), (0,0) = (1,0); μ− = (−1,0); (0,0) is equidistant
    v = torch.tensor([[2.0, 0.0], [0.0, 0.0], [-1.0, 0.0]])
    lam = delta_weights(dense_proxy(v), torch.tensor([1.0, 1.0, -1.0]), iterations=0, lam_min=0.2, lam_max=1.0)
    assert float(lam[1]) == pytest.approx(0.6)
    assert float(lam[0]) > 0.6 and float(lam[2]) > 0.6  # both on their own side


def test_lambda_is_detached_and_a_full_assignment_keeps_the_centroid() -> None:
    """Property 4: λ has no grad_fn and the θ-gradient is the same with λ as a constant; α⁽⁰⁾ = 1 → μ⁽¹⁾ = μ⁽⁰⁾.
    Control: a λ built from π_θ's log-probs (no detach) has a grad_fn and changes the gradient."""
    d = _ppo_tokens()
    logp = _logp_of(d["logits"], d["ids"])
    grad_carrying = lambda at: torch.log_softmax(d["logits"], -1)[..., at]
    shaped = delta(d["adv"], d["mask"], old_logp=logp, response_ids=d["ids"], logp_at=grad_carrying)
    assert shaped.grad_fn is None and not shaped.requires_grad
    (g1,) = torch.autograd.grad(ppo_clip(logp, d["old"], shaped, d["mask"]).loss, d["logits"])
    constant = shaped.detach().clone()
    logp = _logp_of(d["logits"], d["ids"])
    (g2,) = torch.autograd.grad(ppo_clip(logp, d["old"], constant, d["mask"]).loss, d["logits"])
    assert torch.equal(g1, g2)
    logp = _logp_of(d["logits"], d["ids"])
    leaky = shaped * (1 - logp.exp()) / (1 - logp.exp()).detach()  # same values, gradient through π
    assert leaky.grad_fn is not None
    (g3,) = torch.autograd.grad(ppo_clip(logp, d["old"], leaky, d["mask"]).loss, d["logits"])
    assert not torch.allclose(g1, g3)

    gen = torch.Generator().manual_seed(5)
    v, w = torch.randn(10, 4, generator=gen, dtype=torch.float64), torch.rand(10, generator=gen, dtype=torch.float64)
    mu0 = centroid(dense_proxy(v), w, 4)
    mu1 = centroid(dense_proxy(v), w * torch.ones(10, dtype=torch.float64), 4)
    torch.testing.assert_close(mu1, mu0)
    torch.testing.assert_close(mu0, (w[:, None] * v).sum(0) / w.sum())


def test_folded_weights_make_the_token_mean_the_self_normalised_weighted_mean() -> None:
    """The advantage shaping's output under ppo_clip's token mean is (1/Σλ) Σ λ·ℓ, loss and gradient,
    with clipped tokens (logp far from π_old) included."""
    d = _ppo_tokens()
    on = d["mask"] > 0
    support = support_ids(d["ids"][on], 4)
    proxy = logit_gradient_proxy(d["ids"][on], d["old"][on], support, d["logp_at"](support)[on])
    lam_flat = delta_weights(proxy, d["adv"][on].double())
    assert float(lam_flat.max() - lam_flat.min()) > 0.05  # the weights are not uniform
    lam = torch.zeros_like(d["mask"])
    lam[on] = lam_flat.float()

    logp = _logp_of(d["logits"], d["ids"])
    out = ppo_clip(logp, d["old"], _delta_call(d, support=4), d["mask"], clip_low=0.2, clip_high=0.28)
    (got,) = torch.autograd.grad(out.loss, d["logits"])
    logp = _logp_of(d["logits"], d["ids"])
    ratio = torch.exp(logp - d["old"])
    ell, clipped, _ = clipped_surrogate(ratio, d["adv"], 0.2, 0.28)
    assert bool(clipped[on].any())
    want_loss = (lam * ell * d["mask"]).sum() / (lam * d["mask"]).sum()
    (want,) = torch.autograd.grad(want_loss, d["logits"])
    torch.testing.assert_close(out.loss, want_loss)
    torch.testing.assert_close(got, want)


def test_sparse_proxy_equals_its_dense_form_and_side_specific_ids_weigh_more() -> None:
    gen = torch.Generator().manual_seed(6)
    m, dim = 40, 7
    ids = torch.randint(0, dim, (m,), generator=gen)
    vals = torch.rand(m, generator=gen, dtype=torch.float64)
    adv = torch.randn(m, generator=gen, dtype=torch.float64)
    dense = torch.zeros(m, dim, dtype=torch.float64)
    dense[torch.arange(m), ids] = vals
    for k in (0, 1, 3):
        torch.testing.assert_close(
            delta_weights((ids[:, None], vals[:, None]), adv, iterations=k),
            delta_weights(dense_proxy(dense), adv, iterations=k),
        )
    # id 1 appears only in positive responses, id 3 only in negative ones, id 2 equally on both sides:
    # the discriminative tokens weigh more
    ids = torch.tensor([1, 2, 1, 2, 3, 3])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    lam = delta_weights((ids[:, None], torch.full((6, 1), 0.5, dtype=torch.float64)), adv)
    assert float(lam[0]) > float(lam[1])
    assert float(lam[4]) > float(lam[3])
    # one token per side: γ from the margin's own scale, not a hard 0/1 assignment
    lam = delta_weights((torch.tensor([[1], [2]]), torch.ones(2, 1, dtype=torch.float64)), torch.tensor([1.0, -1.0]))
    assert 0.5 < float(lam[0]) < 1.5 and float(lam[0]) == pytest.approx(float(lam[1]))
    # no negative tokens: one side only → α* = 0.5 everywhere, plain DAPO after normalisation
    lam = delta_weights((ids[:, None], torch.ones(6, 1, dtype=torch.float64)), adv.abs())
    assert torch.all(lam == 1.0)


def test_the_proxy_is_the_logit_gradient_on_its_support() -> None:
    """v = ∂log π(y_t)/∂z from autograd on π_old's logits, on the support ids (all of them: the whole
    gradient), plus 1 − π(y) at a sampled id outside the support."""
    d = _ppo_tokens()
    on = d["mask"] > 0
    z = d["old_logits"].clone().requires_grad_()
    (grad,) = torch.autograd.grad((_logp_of(z, d["ids"]) * d["mask"]).sum(), z)  # rows: e_y − p per token
    grad = grad[on].double()
    m, v_size = grad.shape
    full = support_ids(d["ids"][on], v_size)
    ids, vals = logit_gradient_proxy(d["ids"][on], d["old"][on], full, d["logp_at"](full)[on])
    dense = torch.zeros(m, v_size, dtype=torch.float64).scatter_add_(1, ids, vals)
    if full.numel() == v_size:
        torch.testing.assert_close(dense, grad)
    part = support_ids(d["ids"][on], 3)
    ids, vals = logit_gradient_proxy(d["ids"][on], d["old"][on], part, d["logp_at"](part)[on])
    dense = torch.zeros(m, v_size, dtype=torch.float64).scatter_add_(1, ids, vals)
    keep = torch.zeros(m, v_size, dtype=torch.bool)
    keep[:, part] = True
    keep[torch.arange(m), d["ids"][on]] = True
    torch.testing.assert_close(dense, torch.where(keep, grad, torch.zeros_like(grad)))
    # the support: most frequent first, ties by the lower id
    assert support_ids(torch.tensor([5, 2, 2, 9, 5, 7, 2]), 3).tolist() == [2, 5, 7]


def test_delta_zero_advantage_tokens_and_inputs() -> None:
    d = _ppo_tokens()
    d["adv"][2] = 0.0
    out = _delta_call(d)
    assert torch.all(out[2] == 0) and torch.all(out[d["mask"] == 0] == 0)
    assert torch.equal(torch.sign(out), torch.sign(d["adv"]))
    with pytest.raises(ValueError, match="sampled token ids"):
        delta(d["adv"], d["mask"], old_logp=d["old"])
    with pytest.raises(ValueError, match="logp_at"):
        delta(d["adv"], d["mask"], old_logp=d["old"], response_ids=d["ids"])
    only_sampled = delta(d["adv"], d["mask"], old_logp=d["old"], response_ids=d["ids"], support=0)
    assert torch.equal(torch.sign(only_sampled), torch.sign(d["adv"])) and not torch.equal(only_sampled, out)
    assert "response_ids" in declared_inputs(delta, "advantage_shaping", {"response_ids": 1, "mask": 2})
    assert declared_inputs(lambda advantages, mask: None, "advantage_shaping", {"response_ids": 1, "mask": 2}) == {
        "mask": 2
    }
    assert option_problems("advantage_shaping", "delta", {}) == []


# ------------------------------------------------------------------------------------ config

CREDIT_YAML = """
algorithm:
  advantage: w_reinforce
  advantage_options: {lam: 0.05, correct_threshold: 0.5}
  policy_loss: reinforce
  reward_shaping:
    - name: unlikeliness
      options: {beta_rank: 0.3, correct_threshold: 1.0}
  advantage_shaping:
    - name: delta
      options: {iterations: 2, lam_min: 0.2, lam_max: 1.8, gamma: 0.5, gamma_scale: 1.0, support: 16}
"""


def test_config_keys_load_from_yaml_and_bad_values_name_their_key(tmp_path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(CREDIT_YAML)
    cfg = load_config(RLConfig, str(path), TINY)
    validate_rl_config(cfg, 1)
    a = cfg.algorithm
    assert a.advantage == "w_reinforce" and a.advantage_options == {"lam": 0.05, "correct_threshold": 0.5}
    assert a.policy_loss == "reinforce"
    assert a.reward_shaping[0].name == "unlikeliness" and a.reward_shaping[0].options["beta_rank"] == 0.3
    assert a.advantage_shaping[0].name == "delta" and a.advantage_shaping[0].options["iterations"] == 2
    bad = [
        ("algorithm.advantage_options={lam: -0.1}", "algorithm.advantage_options.lam: must be >= 0"),
        ("algorithm.advantage_options={lambda: 0.1}", "algorithm.advantage_options.lambda: is not an option"),
        (
            "algorithm.reward_shaping=[{name: unlikeliness, options: {beta_rank: 1.5}}]",
            "algorithm.reward_shaping[0].options.beta_rank: must be in [0, 1]",
        ),
        (
            "algorithm.advantage_shaping=[{name: delta, options: {iterations: -1}}]",
            "algorithm.advantage_shaping[0].options.iterations: must be >= 0",
        ),
        (
            "algorithm.advantage_shaping=[{name: delta, options: {iterations: 1.5}}]",
            "algorithm.advantage_shaping[0].options.iterations: expects int",
        ),
        (
            "algorithm.advantage_shaping=[{name: delta, options: {lam_min: 1.0, lam_max: 0.5}}]",
            "algorithm.advantage_shaping[0].options.lam_max: must be > 0 and >= lam_min",
        ),
        (
            "algorithm.advantage_shaping=[{name: delta, options: {support: -1}}]",
            "algorithm.advantage_shaping[0].options.support: must be >= 0",
        ),
        (
            "algorithm.advantage_shaping=[{name: delta, options: {gamma: 0}}]",
            "algorithm.advantage_shaping[0].options.gamma: must be null (adaptive) or > 0",
        ),
        ("algorithm.policy_loss=reinforcee", "algorithm.policy_loss"),
    ]
    for override, message in bad:
        cfg = load_config(RLConfig, str(path), TINY + [override])
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate_rl_config(cfg, 1)
    # no baseline: W-REINFORCE runs with one sample per prompt
    validate_rl_config(
        load_config(RLConfig, None, TINY + ["algorithm.advantage=w_reinforce", "rollout.group_size=1"]), 1
    )


def test_demo_overrides_validate() -> None:
    import os

    demo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "demo.yaml")
    for overrides in (
        [
            "algorithm.advantage=w_reinforce",
            "algorithm.advantage_options={lam: 0.1}",
            "algorithm.policy_loss=reinforce",
        ],
        ["algorithm.advantage=w_reinforce", "algorithm.advantage_options={lam: 0.1}"],
        ["algorithm.reward_shaping=[{name: unlikeliness, options: {beta_rank: 0.25}}]"],
        ["algorithm.advantage_shaping=[{name: delta, options: {iterations: 1, support: 32}}]"],
    ):
        validate_rl_config(load_config(RLConfig, demo, overrides), 1)


# ------------------------------------------------------------------------------------ learner

LEARNER_OPTIONS = [
    "algorithm.reward_shaping=[{name: unlikeliness}]",
    "algorithm.advantage_shaping=[{name: delta}]",
    "algorithm.loss_agg=token-mean",
    "algorithm.num_minibatches=1",
    "train.micro_batch_size=4",
    "init.sft_steps=0",
]


def _samples(tokenizer) -> list:
    import random

    from mcore_rl.data.samples import Prompt, Sample

    rng = random.Random(3)
    out = []
    for g in range(4):
        text = f"{g}+1="
        prompt = Prompt(index=g, text=text, ids=[tokenizer.bos_id] + tokenizer.encode(text))
        for j in range(4):
            n = rng.randint(2, 4)
            rsp = [rng.randrange(3, 40) for _ in range(n)]
            reward = float(j < 2 if g < 3 else 1.0)  # the last group is all correct
            out.append(Sample(prompt, g, rsp, [-1.0] * n, policy_version=0, finish_reason="stop", reward=reward))
    return out


def _world(rank: int, world_size: int) -> None:
    from mcore_rl.train.packing import sequence_view
    from mcore_rl.train.policy import build_policy
    from mcore_rl.train.rl_step import Learner, response_ids

    cfg = tiny(*LEARNER_OPTIONS)
    policy = build_policy(cfg, validate_rl_config, total_iters=4)
    learner = Learner(cfg, policy.chunks, policy.optimizer, None, policy.tokenizer.pad_id)
    samples = _samples(policy.tokenizer)
    per_seq, metrics = learner.prepare(samples)

    # what the learner trained with = the pure functions on π_old's log-probs and the sampled ids
    v = sequence_view(samples)
    old, mask = per_seq["old_logp"], v.mask
    valid = v.ok.bool()
    shaped = unlikeliness(v.rewards, v.group_ids, valid=valid, seq_logp=(old * mask).sum(1))
    assert int((shaped[12:] < 1).sum()) == 3 and shaped[12:].std() > 0  # the all-correct group now has a signal
    adv = grpo(shaped, v.group_ids, valid=valid)
    ids = response_ids(samples, mask.shape[1])
    logp_at = learner._shaping_inputs(samples, v)["logp_at"]
    support = support_ids(ids[mask > 0], 32)
    at = logp_at(support)  # one more forward: at each token's own id it is π_old's log-prob of it
    hit = (ids[..., None] == support) & (mask[..., None] > 0)
    assert int(hit.sum()) == int(mask.sum())  # ≤ 32 distinct ids here: every sampled id is in the support
    torch.testing.assert_close(at[hit], old[..., None].expand_as(at)[hit])
    want = delta(adv[:, None] * mask, mask, old_logp=old, response_ids=ids, logp_at=logp_at)
    torch.testing.assert_close(per_seq["advantages"], want, rtol=0, atol=0)
    assert not torch.allclose(want, adv[:, None] * mask)  # DelTA's weights changed the advantages
    assert "advantage/shaped_abs_mean" in metrics
    records, _ = learner.train(samples, 0)
    assert len(records) == 1 and math.isfinite(records[0]["train/loss"])

    # W-REINFORCE with the plain REINFORCE loss, on the same policy
    learner.cfg = tiny(
        "algorithm.advantage=w_reinforce",
        "algorithm.policy_loss=reinforce",
        "algorithm.num_minibatches=1",
        "train.micro_batch_size=4",
        "init.sft_steps=0",
    )
    per_seq, _ = learner.prepare(samples)
    torch.testing.assert_close(per_seq["advantages"], w_reinforce(v.rewards, v.group_ids, valid=valid))
    records, _ = learner.train(samples, 1)
    assert math.isfinite(records[0]["train/loss"]) and records[0]["pg/clipfrac"] == 0.0

    # GiGPO (tests/test_step_credit.py): the learner hands a step-level estimator each sample's place
    # in its episode. Each group: 2 episodes of 2 steps, both starting in "start"
    steps = [
        replace(
            x,
            episode=j % 4 // 2,
            step_index=j % 2,
            info={"state": state, "state_key": state_key(state), "step_reward": x.reward if j % 2 else 0.0},
        )
        for j, x in enumerate(samples)
        for state in ["start" if j % 2 == 0 else f"after {x.group}"]
    ]
    learner.cfg = tiny(
        "algorithm.advantage=gigpo",
        "algorithm.advantage_options={step_weight: 0.5}",
        "algorithm.num_minibatches=1",
        "train.micro_batch_size=4",
        "init.sft_steps=0",
    )
    per_seq, _ = learner.prepare(steps)
    n = len(steps)
    want_steps = StepBatch(
        torch.arange(n) % 4 // 2,
        torch.arange(n) % 2,
        torch.tensor([state_key(x.info["state"]) for x in steps]),
        torch.tensor([x.info["step_reward"] for x in steps]),
    )
    want = gigpo(v.rewards, v.group_ids, valid=valid, steps=want_steps, step_weight=0.5)
    torch.testing.assert_close(per_seq["advantages"], want, rtol=0, atol=0)
    assert not torch.allclose(want, grpo(v.rewards, v.group_ids, valid=valid))


@pytest.mark.slow
def test_learner_trains_with_unlikeliness_delta_and_w_reinforce() -> None:
    run_world(1, _world)
