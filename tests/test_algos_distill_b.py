"""Distillation functions POPD/TOPD, PowerOPD, Direct-OPD and SEED, each against the testable
properties of its paper (docs/papers.md), and reverse-KL OPD (K1)
against the identity that makes it a reverse-KL gradient."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.algos import registry
from mcore_rl.algos.advantages import grpo
from mcore_rl.algos.distill.base import DistillBatch
from mcore_rl.algos.distill.direct_opd import adapt_alpha, direct_opd, sequence_shift, shift_weights
from mcore_rl.algos.distill.popd import (
    discounted_returns,
    horizon_mask,
    horizon_tokens,
    popd,
    popd_horizon,
    topd_horizon,
)
from mcore_rl.algos.distill.power_opd import power_opd, power_reward
from mcore_rl.algos.distill.reverse_kl import reverse_kl
from mcore_rl.algos.distill.seed import seed, seed_gate
from mcore_rl.algos.policy_loss import ppo_clip


def _batch(n: int = 3, t: int = 5, seed_: int = 0, **kw) -> DistillBatch:
    g = torch.Generator().manual_seed(seed_)
    old = -torch.rand(n, t, generator=g) * 3
    mask = torch.ones(n, t)
    mask[0, 3:] = 0
    base = dict(student_logp=old.clone(), old_logp=old, teacher_logp=-torch.rand(n, t, generator=g) * 3, mask=mask)
    base.update(kw)
    return DistillBatch(**base)


def test_registered_with_their_phases():
    want = {
        "reverse_kl": "advantage",
        "popd": "advantage",
        "topd": "advantage",
        "power_opd": "advantage",
        "direct_opd": "loss",
        "seed": "loss",
    }
    for name, ph in want.items():
        assert registry.get("distill", name).phase == ph, name
    assert registry.get("distill", "topd") is registry.get("distill", "popd")


# ----------------------------------------------------------------------------- reverse-KL (K1)


def test_reverse_kl_advantage_is_the_negated_k1_on_distilled_tokens_only():
    b = _batch()
    b.old_logp.requires_grad_()
    out = reverse_kl(b)
    assert not out.token_advantage.requires_grad and out.loss_sum is None
    torch.testing.assert_close(out.token_advantage, (b.teacher_logp - b.old_logp.detach()) * b.mask)
    assert out.token_advantage[0, 3:].eq(0).all()
    clipped = reverse_kl(b, clip=0.5).token_advantage
    assert clipped.abs().max() <= 0.5 and clipped[0, 3:].eq(0).all()


def test_reverse_kl_policy_gradient_is_the_gradient_of_the_reverse_kl():
    """On a categorical, E_{y~p}[A(y) ∇log p(y)] with A = log q(y) - log p(y) is -∇KL(p || q):
    the K1 advantage makes the policy gradient descend the reverse KL to the teacher."""
    z = torch.randn(7, generator=torch.Generator().manual_seed(1), dtype=torch.float64).requires_grad_()
    log_q = torch.log_softmax(torch.randn(7, generator=torch.Generator().manual_seed(2), dtype=torch.float64), 0)
    log_p = torch.log_softmax(z, 0)
    ids = torch.arange(7)
    b = DistillBatch(
        student_logp=log_p.detach()[None],
        old_logp=log_p.detach()[None],
        teacher_logp=log_q[None],
        mask=torch.ones(1, 7),
    )
    adv = reverse_kl(b).token_advantage[0]
    surrogate = (log_p.detach().exp() * adv * log_p[ids]).sum()  # exact expectation over y
    (g_pg,) = torch.autograd.grad(surrogate, z)
    log_p = torch.log_softmax(z, 0)
    kl = (log_p.exp() * (log_p - log_q)).sum()
    (g_kl,) = torch.autograd.grad(kl, z)
    torch.testing.assert_close(g_pg, -g_kl)


# ----------------------------------------------------------------------------- POPD / TOPD


def test_popd_horizon_schedule():
    """Property 1: H_0=512, ΔH=512, Δk=100, T=4096 at steps 0, 99, 100, 1000 -> 512, 512, 1024, 4096."""
    assert [popd_horizon(k, 512, 512, 100, 4096) for k in (0, 99, 100, 1000)] == [512, 512, 1024, 4096]
    assert [horizon_tokens("growing", k, 4096, h0=512, delta_h=512, delta_k=100) for k in (0, 100)] == [512, 1024]
    assert topd_horizon(0.1, 4096) == 409 and topd_horizon(0.25, 4096) == 1024 and topd_horizon(0.29, 100) == 29
    assert horizon_tokens("fixed", 7, 40, rho=0.1) == 4 and horizon_tokens("fixed", 7, 40, tokens=6) == 6
    assert horizon_tokens("none", 7, 40) is None
    with pytest.raises(ValueError, match="rho"):
        topd_horizon(1.5, 10)


def test_truncated_loss_equals_the_token_level_loss_on_the_first_h_tokens():
    """Property 2: with the horizon mask, positions >= H get zero gradient, and the loss equals the
    full token-level loss computed on the first H tokens."""
    h = 3
    b = _batch(t=6, seed_=4)
    b.mask = b.mask * horizon_mask(6, h)
    adv = popd(b).token_advantage
    logp = b.old_logp.clone().requires_grad_()
    out = ppo_clip(logp, b.old_logp, adv, b.mask)
    (out.loss_sum / out.count).backward()
    assert logp.grad[:, h:].eq(0).all() and logp.grad[:, :h].abs().sum() > 0
    short = b.old_logp[:, :h].clone().requires_grad_()
    ref = ppo_clip(short, b.old_logp[:, :h], adv[:, :h], b.mask[:, :h])
    (ref.loss_sum / ref.count).backward()
    torch.testing.assert_close(out.loss_sum / out.count, ref.loss_sum / ref.count)
    torch.testing.assert_close(logp.grad[:, :h], short.grad)


def test_discounted_weights_and_the_variance_of_the_sequence_level_weight():
    """Property 3: γ=0 gives r_t, γ=1 the suffix sum; with i.i.d. noise σ_k = δk the variance of
    Â_1 (γ=1) is δ² Σ k²."""
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(discounted_returns(r, m, 0.0), torch.tensor([[1.0, 2.0, 3.0, 0.0]]))
    torch.testing.assert_close(discounted_returns(r, m, 1.0), torch.tensor([[6.0, 5.0, 3.0, 0.0]]))
    torch.testing.assert_close(discounted_returns(r, m, 0.5), torch.tensor([[1 + 1 + 0.75, 2 + 1.5, 3.0, 0.0]]))
    b = _batch()
    torch.testing.assert_close(popd(b).token_advantage, (b.teacher_logp - b.old_logp) * b.mask)  # γ = 0
    t, delta, n = 8, 0.1, 40000
    sigma = delta * torch.arange(1, t + 1, dtype=torch.float64)
    noise = torch.randn(n, t, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * sigma
    a1 = discounted_returns(noise, torch.ones(n, t, dtype=torch.float64), 1.0)[:, 0]
    want = delta**2 * sum(k * k for k in range(1, t + 1))
    assert abs(float(a1.var()) - want) < 0.03 * want


# ----------------------------------------------------------------------------- PowerOPD


def test_power_reward_is_bounded_sign_consistent_and_antisymmetric():
    """Properties 1 and 4: |r^α| <= 1, r^α = 0 iff p = q, sign(r^α) = sign(p - q), swapping negates."""
    p = torch.linspace(0, 1, 41, dtype=torch.float64)
    pp, qq = torch.meshgrid(p, p, indexing="ij")
    lp, lq = pp.log(), qq.log()  # log 0 = -inf: p^α = 0
    for alpha in (0.1, 1.0, 3.0, 500.0):
        r = power_reward(lp, lq, alpha)
        assert r.abs().max() <= 1.0
        assert torch.equal(torch.sign(r), torch.sign(pp - qq)) or alpha == 500.0  # 500: underflow to 0 below 0.5
        assert torch.equal(r == 0, pp == qq) or alpha == 500.0
        torch.testing.assert_close(power_reward(lq, lp, alpha), -r)
    r = power_reward(lp, lq, 3.0)
    assert torch.equal(torch.sign(r), torch.sign(pp - qq)) and torch.equal(r == 0, pp == qq)


def test_power_reward_recovers_the_log_ratio_as_alpha_goes_to_zero():
    """Property 2: (p^α - q^α)/α -> log p - log q; p=0.3, q=0.1, α=1e-6 gives log 3 within 1e-5."""
    lp, lq = torch.tensor(math.log(0.3), dtype=torch.float64), torch.tensor(math.log(0.1), dtype=torch.float64)
    assert abs(float(power_reward(lp, lq, 1e-6, normalize=True)) - math.log(3)) < 1e-5
    lp32, lq32 = lp.float(), lq.float()
    assert abs(float(power_reward(lp32, lq32, 1e-6, normalize=True)) - math.log(3)) < 1e-5


def test_power_opd_reward_has_no_gradient_and_an_inert_region():
    """Property 3: r^α is stop-gradient, so the loss gradient is Σ_t r^α_t ∇log π_θ(o_t); with p,q <=
    0.5 and α = 500, |r^α| < 1e-150."""
    b = _batch(seed_=5)
    b.old_logp.requires_grad_()
    b.teacher_logp.requires_grad_()
    adv = power_opd(b, alpha=2.0).token_advantage
    assert not adv.requires_grad
    torch.testing.assert_close(adv, (b.teacher_logp.detach().exp() ** 2 - b.old_logp.detach().exp() ** 2) * b.mask)
    logp = b.old_logp.detach().clone().requires_grad_()
    out = ppo_clip(logp, None, adv, b.mask)  # on-policy: ratio 1, d loss_sum / d logp = -r^α
    out.loss_sum.backward()
    torch.testing.assert_close(logp.grad, -adv)
    p = torch.tensor([0.5, 0.3, 1e-3], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.4], dtype=torch.float64)
    assert power_reward(p.log(), q.log(), 500.0).abs().max() < 1e-150


# ----------------------------------------------------------------------------- Direct-OPD


def _bigram(seed_: int, v: int) -> torch.Tensor:
    return torch.log_softmax(torch.randn(v, v, generator=torch.Generator().manual_seed(seed_), dtype=torch.float64), -1)


def test_direct_opd_token_shifts_sum_to_the_sequence_shift():
    """Property 1: Σ_t r_t(y_t) = log π_T(y|x) - log π_Tref(y|x) for two (bigram) teachers."""
    v, y = 6, [2, 5, 1, 1, 4, 0]
    teacher, ref = _bigram(1, v), _bigram(2, v)
    prev = [3] + y[:-1]  # x = token 3
    lt = torch.stack([teacher[a, b] for a, b in zip(prev, y)])
    lr = torch.stack([ref[a, b] for a, b in zip(prev, y)])
    seq_t = sum(float(teacher[a, b]) for a, b in zip(prev, y))
    seq_r = sum(float(ref[a, b]) for a, b in zip(prev, y))
    got = sequence_shift(lt[None], lr[None], torch.ones(1, len(y), dtype=torch.float64))
    assert abs(float(got[0]) - (seq_t - seq_r)) < 1e-12


def _direct_batch(z: torch.Tensor, teacher: torch.Tensor, ref: torch.Tensor, mask=None) -> DistillBatch:
    """Student logits z [n, T, V] with the candidate set = the whole vocabulary."""
    lp = torch.log_softmax(z, -1)
    n, t, _ = z.shape
    return DistillBatch(
        student_logp=lp[..., 0],
        old_logp=lp[..., 0].detach(),
        teacher_logp=teacher[..., 0],
        mask=torch.ones(n, t, dtype=z.dtype) if mask is None else mask,
        teacher_topk_logp=teacher,
        student_topk_logp=lp,
        teacher_ref_topk_logp=ref,
    )


def test_direct_opd_without_a_shift_has_no_gradient():
    """Property 2: π_T ≡ π_Tref gives exactly zero gradient (only the KL term would act)."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(2, 3, 5, generator=g, dtype=torch.float64).requires_grad_()
    t = torch.log_softmax(torch.randn(2, 3, 5, generator=g, dtype=torch.float64), -1)
    out = direct_opd(_direct_batch(z, t, t.clone()), alpha=0.0)  # the shift term alone
    out.loss_sum.backward()
    assert torch.equal(z.grad, torch.zeros_like(z))


def test_direct_opd_gradient_is_the_stop_gradient_weighted_score():
    """Property 3: d/dz of -Σ_v A^w(v) log softmax(z)_v is -Σ_v A^w(v)(e_v - softmax(z)), A^w has no
    gradient; with S = V and a constant shift the gradient is zero."""
    g = torch.Generator().manual_seed(4)
    z = torch.randn(1, 2, 6, generator=g, dtype=torch.float64).requires_grad_()
    t = torch.log_softmax(torch.randn(1, 2, 6, generator=g, dtype=torch.float64), -1)
    r = torch.log_softmax(torch.randn(1, 2, 6, generator=g, dtype=torch.float64), -1)
    b = _direct_batch(z, t, r)
    w = shift_weights(b.student_topk_logp, t, r)
    assert not w.requires_grad
    direct_opd(b, alpha=0.0).loss_sum.backward()
    sm = torch.softmax(z.detach(), -1)
    want = -(w[..., :, None] * (torch.eye(6, dtype=torch.float64) - sm[..., None, :])).sum(-2)
    torch.testing.assert_close(z.grad, want)
    z.grad = None
    direct_opd(_direct_batch(z, t, t - 0.7), alpha=0.0).loss_sum.backward()  # r_t(v) = 0.7 for every v
    torch.testing.assert_close(z.grad, torch.zeros_like(z), atol=1e-12, rtol=0)


def test_direct_opd_bandit_converges_to_the_tilted_initial_policy():
    """Property 4: gradient ascent on E_π[Δ] - α KL(π || π_S) converges to π_S exp(Δ/α) / Z."""
    v, alpha = 5, 0.7
    g = torch.Generator().manual_seed(5)
    log_s, t, r = (torch.log_softmax(0.5 * torch.randn(v, generator=g, dtype=torch.float64), 0) for _ in range(3))
    z = log_s.clone().requires_grad_()
    opt = torch.optim.SGD([z], lr=2.0)
    for _ in range(400):
        opt.zero_grad()
        b = _direct_batch(z[None, None], t[None, None], r[None, None])
        lp = torch.log_softmax(z, 0)
        kl = (lp.exp() * (lp - log_s)).sum()
        (direct_opd(b, alpha=0.0).loss_sum + alpha * kl).backward()  # the exact KL over V
        opt.step()
    want = torch.softmax(log_s + (t - r) / alpha, 0)
    torch.testing.assert_close(torch.softmax(z.detach(), 0), want, atol=1e-7, rtol=0)


def test_direct_opd_alpha_controller():
    """Property 5: α=1, r̄>0 -> 1.01; α=1, r̄<0 -> 0.99; 2.5, r̄>0 -> 2.5; 0.5, r̄<0 -> 0.5; r̄=0 unchanged."""
    assert adapt_alpha(1.0, 0.3) == pytest.approx(1.01)
    assert adapt_alpha(1.0, -0.3) == pytest.approx(0.99)
    assert adapt_alpha(2.5, 0.3) == 2.5 and adapt_alpha(0.5, -0.3) == 0.5
    assert adapt_alpha(1.3, 0.0) == 1.3


def test_direct_opd_renormalises_on_a_candidate_set_smaller_than_the_vocabulary():
    """p̄_t(v) = π_θ(v) / Σ_{u∈S_t} π_θ(u) on S_t = the teacher's top-3 of a 10-token vocabulary:
    the learner hands over the *full-vocabulary* log-probs at the candidate ids (their exp sums
    to < 1), and the weights and the gradient in the logits must use the renormalised p̄ (with S = V
    the renormalisation is a no-op and cannot be told apart)."""
    g = torch.Generator().manual_seed(11)
    v, k = 10, 3
    z = torch.randn(2, 3, v, generator=g, dtype=torch.float64).requires_grad_()
    teacher = torch.log_softmax(torch.randn(2, 3, v, generator=g, dtype=torch.float64), -1)
    ref = torch.log_softmax(torch.randn(2, 3, v, generator=g, dtype=torch.float64), -1)
    ids = teacher.topk(k, -1).indices
    full = torch.log_softmax(z, -1)
    s_topk = full.gather(-1, ids)
    assert float(s_topk.detach().exp().sum(-1).max()) < 0.99  # a proper subset of the mass
    t_topk, r_topk = teacher.gather(-1, ids), ref.gather(-1, ids)
    b = DistillBatch(
        student_logp=full[..., 0],
        old_logp=full[..., 0].detach(),
        teacher_logp=teacher[..., 0],
        mask=torch.ones(2, 3, dtype=torch.float64),
        teacher_topk_logp=t_topk,
        student_topk_logp=s_topk,
        teacher_ref_topk_logp=r_topk,
    )
    p = s_topk.detach().exp()
    p_bar = p / p.sum(-1, keepdim=True)
    want_w = p_bar * (t_topk - r_topk)
    torch.testing.assert_close(shift_weights(s_topk, t_topk, r_topk), want_w, rtol=0, atol=1e-12)
    out = direct_opd(b, alpha=0.0)
    torch.testing.assert_close(out.metrics["shift_mean"], want_w.sum(-1).mean(), rtol=0, atol=1e-12)
    out.loss_sum.backward()
    # d/dz of -Σ_{v∈S} w(v) log softmax(z)_v = -Σ_{v∈S} w(v) (e_v - softmax(z)) over the whole vocabulary
    onehot = torch.nn.functional.one_hot(ids, v).to(torch.float64)
    want = -(want_w[..., None] * (onehot - torch.softmax(z.detach(), -1)[..., None, :])).sum(-2)
    torch.testing.assert_close(z.grad, want, rtol=0, atol=1e-12)


def _kl_batch(seed_: int = 12) -> DistillBatch:
    g = torch.Generator().manual_seed(seed_)
    s_topk = torch.log_softmax(torch.randn(2, 4, 3, generator=g, dtype=torch.float64), -1)
    t_topk = torch.log_softmax(torch.randn(2, 4, 3, generator=g, dtype=torch.float64), -1)
    logp = -torch.rand(2, 4, generator=g, dtype=torch.float64) * 2
    mask = torch.ones(2, 4, dtype=torch.float64)
    mask[1, 2:] = 0
    return DistillBatch(
        student_logp=logp.requires_grad_(),
        old_logp=logp.detach(),
        teacher_logp=t_topk[..., 0],
        mask=mask,
        teacher_topk_logp=t_topk,
        student_topk_logp=s_topk,
        teacher_ref_topk_logp=t_topk - 0.3 * torch.randn(2, 4, 3, generator=g, dtype=torch.float64),
        student_ref_logp=logp.detach() + torch.randn(2, 4, generator=g, dtype=torch.float64) * 0.5,
    )


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_direct_opd_carries_its_own_kl_weighted_by_alpha(estimator):
    """loss = shift term + α·Σ_agg KL_t(π_θ‖π_S) on the sampled tokens, with the learner's estimators;
    α comes from the state when there is one (not from the option)."""
    from mcore_rl.algos.kl import kl_estimate

    b = _kl_batch()
    shift = direct_opd(b, alpha=0.0).loss_sum
    kl = (kl_estimate(b.student_logp, b.student_ref_logp, estimator) * b.mask).sum()
    out = direct_opd(b, alpha=0.7, kl_estimator=estimator)
    torch.testing.assert_close(out.loss_sum, shift + 0.7 * kl)
    (grad,) = torch.autograd.grad(out.loss_sum, b.student_logp)
    (want,) = torch.autograd.grad(0.7 * kl, b.student_logp)
    torch.testing.assert_close(grad, want)  # the shift term has no gradient in the sampled token's log-prob
    state = direct_opd.make_state(alpha=2.0)
    torch.testing.assert_close(direct_opd(b, alpha=0.7, kl_estimator=estimator, state=state).loss_sum, shift + 2.0 * kl)
    with pytest.raises(ValueError, match="student_ref_logp"):
        direct_opd(DistillBatch(**{**b.__dict__, "student_ref_logp": None}))
    with pytest.raises(ValueError, match="kl_estimator"):
        direct_opd(b, kl_estimator="k4")


def test_direct_opd_alpha_adapts_per_batch_with_the_sign_of_the_last_shift_and_round_trips():
    """`AdaptiveKL.start_batch`: batch 0 trains with α₀, batch m with clip(α_{m−1}(1 + ε·sign r̄_{m−1}));
    r̄ is the batch's student-weighted shift mean at π_old; the state saved after batch m continues
    exactly as the uninterrupted controller; `adaptive: false` keeps α₀."""
    from mcore_rl.algos.distill.direct_opd import AdaptiveKL, batch_shift_mean

    up = _kl_batch()
    up.teacher_ref_topk_logp = up.teacher_topk_logp - 0.5  # r_t(v) = +0.5: r̄ > 0
    down = _kl_batch()
    down.teacher_ref_topk_logp = down.teacher_topk_logp + 0.5  # r̄ < 0
    assert batch_shift_mean(up) == pytest.approx(0.5) and batch_shift_mean(down) == pytest.approx(-0.5)
    c = AdaptiveKL(alpha=1.0)
    seen = []
    for b in (up, up, down, up, up):
        m = c.start_batch(b)
        seen.append(c.alpha)
        assert float(m["alpha"]) == c.alpha and float(m["shift_mean"]) == pytest.approx(batch_shift_mean(b))
    want = [1.0]
    for r in (0.5, 0.5, -0.5, 0.5):
        want.append(adapt_alpha(want[-1], r))
    assert (
        seen == pytest.approx(want) and seen[1] == pytest.approx(1.01) and seen[3] == pytest.approx(1.01 * 1.01 * 0.99)
    )
    # resume after batch 2: a fresh controller with the saved state gives batches 3 and 4 the same α
    c2 = AdaptiveKL(alpha=1.0)
    for b in (up, up, down):
        c2.start_batch(b)
    saved = c2.state_dict()
    fresh = AdaptiveKL(alpha=1.0)
    fresh.load_state_dict(saved)
    assert [fresh.start_batch(b) and fresh.alpha for b in (up, up)] == pytest.approx(seen[3:])
    # bounds, and off
    hi = AdaptiveKL(alpha=2.5)
    for _ in range(3):
        hi.start_batch(up)
    assert hi.alpha == 2.5
    fixed = AdaptiveKL(alpha=1.0, adaptive=False)
    for b in (up, up, down):
        fixed.start_batch(b)
    assert fixed.alpha == 1.0
    with pytest.raises(ValueError, match="options.alpha_min"):
        AdaptiveKL(alpha_min=3.0)
    with pytest.raises(ValueError, match="options.eps"):
        AdaptiveKL(eps=-1.0)


def test_direct_opd_needs_the_top_k_and_a_reference():
    with pytest.raises(ValueError, match="teacher_ref_topk_logp"):
        direct_opd(_batch(student_topk_logp=torch.zeros(3, 5, 2), teacher_topk_logp=torch.zeros(3, 5, 2)))


# ----------------------------------------------------------------------------- SEED


def test_seed_gate():
    """Property 1: g ∈ (0, 1), g = 0.5 at Δ = 0, increasing in Δ, and no gradient through g or ℓ^skill."""
    delta = torch.linspace(-3, 3, 13)
    student = torch.zeros(13, requires_grad=True)
    skill = delta.clone().requires_grad_()
    g = seed_gate(skill, student, beta=5.0)
    assert not g.requires_grad
    assert (g > 0).all() and (g < 1).all() and float(g[6]) == 0.5 and (g.diff() > 0).all()
    b = _batch(seed_=6)
    b.teacher_logp.requires_grad_()
    b.student_logp.requires_grad_()
    seed(b).loss_sum.backward()
    assert b.teacher_logp.grad is None  # sg[ℓ^skill]


def test_seed_gradient_per_token():
    """Property 2: ∂L_opd/∂ℓ^θ = -m g / (#tokens), masked tokens contribute 0 (token mean)."""
    b = _batch(seed_=7)
    b.student_logp.requires_grad_()
    out = seed(b, beta=5.0)
    (out.loss_sum / b.mask.sum()).backward()
    g = torch.sigmoid(5.0 * (b.teacher_logp - b.student_logp.detach()))
    torch.testing.assert_close(b.student_logp.grad, -b.mask * g / b.mask.sum())
    assert b.student_logp.grad[0, 3:].eq(0).all()


def test_seed_with_zero_weight_is_grpo_and_acts_where_grpo_cannot():
    """Property 3: λ_opd = 0 reproduces the GRPO loss exactly; for a group with all-equal rewards
    ∇L_rl = 0 while ∇L_opd != 0."""
    b = _batch(n=4, seed_=8)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    adv = grpo(rewards, groups)
    logp = b.old_logp.clone().requires_grad_()
    rl = ppo_clip(logp, b.old_logp, adv, b.mask)
    b.student_logp = logp
    total = rl.loss_sum + 0.0 * seed(b).loss_sum
    (g_total,) = torch.autograd.grad(total, logp, retain_graph=True)
    (g_rl,) = torch.autograd.grad(rl.loss_sum, logp, retain_graph=True)
    assert float(total.detach()) == float(rl.loss_sum.detach()) and torch.equal(g_total, g_rl)
    assert g_rl[2:].eq(0).all()  # group 1: rewards all 1 -> advantages 0 -> no RL gradient
    (g_opd,) = torch.autograd.grad(seed(b).loss_sum, logp)
    assert g_opd[2:].abs().sum() > 0


def test_seed_with_an_empty_skill_is_half_the_nll_gradient():
    """Property 4: ℓ^skill = ℓ^θ gives Δ = 0, g = 0.5, loss value 0, and gradient 0.5 x the NLL's."""
    b = _batch(seed_=9)
    logp = b.old_logp.clone().requires_grad_()
    b.student_logp, b.teacher_logp = logp, logp.detach().clone()
    out = seed(b)
    assert float(out.loss_sum) == 0.0 and float(out.metrics["gate_mean"]) == 0.5
    (g_opd,) = torch.autograd.grad(out.loss_sum / b.mask.sum(), logp)
    (g_nll,) = torch.autograd.grad(-(logp * b.mask).sum() / b.mask.sum(), logp)
    torch.testing.assert_close(g_opd, 0.5 * g_nll)


def test_seed_is_finite_where_the_teacher_gave_no_score():
    """A token without a finite ℓ^skill (a sample the environment gave no skill for, padding: -inf or
    NaN) takes no part: the loss and its gradient stay finite and equal those without the token."""
    b = _batch(seed_=9)
    b.student_logp.requires_grad_()
    bad = b.teacher_logp.clone()
    bad[1, 2], bad[2, 4], bad[0, 4] = float("-inf"), float("nan"), float("-inf")  # [0, 4] is also off the mask
    hole = DistillBatch(**{**b.__dict__, "teacher_logp": bad})
    out = seed(hole)
    assert torch.isfinite(out.loss_sum) and all(torch.isfinite(v) for v in out.metrics.values())
    out.loss_sum.backward()
    grad = b.student_logp.grad.clone()
    assert torch.isfinite(grad).all() and grad[1, 2] == 0 and grad[2, 4] == 0
    b.student_logp.grad = None
    mask = b.mask.clone()
    mask[1, 2] = mask[2, 4] = 0
    ref = seed(DistillBatch(**{**b.__dict__, "mask": mask}))
    ref.loss_sum.backward()
    torch.testing.assert_close(out.loss_sum, ref.loss_sum)
    torch.testing.assert_close(grad, b.student_logp.grad)


# ----------------------------------------------------------------------------- UI-MOPD


def test_ui_mopd_k3_is_nonnegative_zero_where_equal_and_unbiased():
    """Property 1: K3 >= 0 element-wise, 0 iff the log-probs agree; its Monte-Carlo mean over
    a ~ π_θ approaches KL(π_θ ‖ π_ref) on a tiny categorical."""
    from mcore_rl.algos.distill.ui_mopd import k3

    s = torch.log_softmax(torch.randn(6, generator=torch.Generator().manual_seed(1), dtype=torch.float64), 0)
    t = torch.log_softmax(torch.randn(6, generator=torch.Generator().manual_seed(2), dtype=torch.float64), 0)
    grid = torch.arange(-40, 41, dtype=torch.float64) / 10
    est = k3(grid, torch.zeros_like(grid))
    assert (est >= 0).all() and est[40] == 0 and (est[:40] > 0).all() and (est[41:] > 0).all()
    draws = torch.multinomial(s.exp(), 400_000, replacement=True, generator=torch.Generator().manual_seed(3))
    mc = k3(t[draws], s[draws]).mean()
    exact = (s.exp() * (s - t)).sum()
    assert abs(float(mc - exact)) < 0.01 * float(exact) + 1e-3


def test_ui_mopd_group_gate_is_strict_and_zeroes_loss_and_gradient():
    """Property 3: a group whose mean reward is > τ_KL adds exactly zero loss and zero gradient for every
    member; a mean equal to τ keeps the KL. The learner's whole-group mean decides in a micro-batch that
    holds part of a group."""
    from mcore_rl.algos.distill.ui_mopd import ui_mopd

    b = _batch(n=4, seed_=13)
    b.rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])  # group 0 mean 0.5 (= τ: on), group 1 mean 1.0 (> τ: off)
    b.group_ids = torch.tensor([0, 0, 1, 1])
    b.student_logp.requires_grad_()
    out = ui_mopd(b, tau_kl=0.5)
    out.loss_sum.backward()
    grad = b.student_logp.grad
    assert grad[2:].eq(0).all() and grad[:2].abs().sum() > 0
    assert float(out.metrics["ui_mopd/kl_on_frac"]) < 1
    only_on = DistillBatch(**{**b.__dict__, "mask": b.mask * torch.tensor([1.0, 1, 0, 0])[:, None]})
    only_on.student_logp = b.student_logp.detach().clone()
    torch.testing.assert_close(out.loss_sum.detach(), ui_mopd(only_on, tau_kl=None).loss_sum)
    # a micro-batch holding only sample 1 of group 0, whose group mean the learner gives: 0.5 keeps it on,
    # its own reward alone (0.0) would too; sample 2 alone (1.0) with its group's mean 1.0 is off
    one = DistillBatch(**{k: (v[2:3] if isinstance(v, torch.Tensor) else v) for k, v in b.__dict__.items()})
    one.group_mean_reward = torch.tensor([0.4])
    assert float(ui_mopd(one, tau_kl=0.5).loss_sum) > 0  # the learner's mean, not this slice's 1.0
    one.group_mean_reward = None
    assert float(ui_mopd(one, tau_kl=0.5).loss_sum) == 0


def test_ui_mopd_is_a_loss_phase_term_weighted_beta_and_finite_without_a_teacher_score():
    from mcore_rl.algos.distill.base import term_coef
    from mcore_rl.algos.distill.ui_mopd import ui_mopd

    fn = registry.get("distill", "ui_mopd")
    assert fn.phase == "loss" and term_coef(fn, None) == 0.01 and term_coef(fn, 0.5) == 0.5
    b = _batch(seed_=14)
    b.teacher_logp[1, 1] = float("-inf")
    b.teacher_logp[2, 2] = float("nan")
    assert torch.isfinite(ui_mopd(b).loss_sum)
