"""PPO clip (clip-higher, dual-clip), GSPO, aggregation modes, KL estimators, entropy bonus."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.algos.entropy import entropy_bonus
from mcore_rl.algos.kl import k1, k2, k3, kl_loss, kl_penalized_rewards
from mcore_rl.algos.policy_loss import AGG_MODES, aggregate, gspo, ppo_clip, sequence_log_ratio


def _grad_of(fn, logp: torch.Tensor) -> torch.Tensor:
    x = logp.detach().clone().requires_grad_()
    fn(x).backward()
    return x.grad


def _one_token(ratio: float, adv: float, **kw):
    """Loss and d loss / d log π for one token with the given ratio and advantage."""
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), math.log(ratio), requires_grad=True)
    out = ppo_clip(logp, old, torch.tensor([adv]), torch.ones(1, 1), **kw)
    out.loss.backward()
    return float(out.loss.detach()), float(logp.grad)


def test_ppo_unclipped_is_policy_gradient() -> None:
    loss, grad = _one_token(1.1, 2.0)
    assert loss == pytest.approx(-2.2) and grad == pytest.approx(-2.2)  # d(-A r)/dlog π = -A r


def test_clip_higher_separates_bounds() -> None:
    # A > 0, r = 1.25: clipped by ε_high = 0.2, not by DAPO's 0.28
    assert _one_token(1.25, 1.0, clip_high=0.2)[1] == 0.0
    loss, grad = _one_token(1.25, 1.0, clip_low=0.2, clip_high=0.28)
    assert grad == pytest.approx(-1.25) and loss == pytest.approx(-1.25)
    # A < 0, r = 0.7: below 1 - ε_low -> clipped (no push further down)
    assert _one_token(0.7, -1.0, clip_low=0.2, clip_high=0.28)[1] == 0.0
    assert _one_token(0.7, -1.0, clip_low=0.35)[1] == pytest.approx(0.7)
    # A > 0, r small: never clipped from below (min picks the unclipped term)
    assert _one_token(0.5, 1.0)[1] == pytest.approx(-0.5)


def test_dual_clip_bounds_negative_advantage_loss() -> None:
    loss, grad = _one_token(10.0, -1.0)
    assert loss == pytest.approx(10.0) and grad == pytest.approx(10.0)
    loss, grad = _one_token(10.0, -1.0, dual_clip=3.0)
    assert loss == pytest.approx(3.0) and grad == 0.0
    assert _one_token(2.0, -1.0, dual_clip=3.0)[0] == pytest.approx(2.0)  # below the cap: PPO
    assert _one_token(10.0, 1.0, dual_clip=3.0)[0] == pytest.approx(-1.2)  # A > 0 untouched
    with pytest.raises(ValueError):
        _one_token(1.0, -1.0, dual_clip=1.0)


def test_is_weights_scale_loss_and_gradient_and_are_constants() -> None:
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(3, 4, generator=g) * 0.05, torch.randn(3, 4, generator=g) * 0.05
    adv, mask = torch.randn(3, generator=g), torch.ones(3, 4)
    w = torch.rand(3, 4, generator=g).requires_grad_()
    base = _grad_of(lambda x: ppo_clip(x, old, adv, mask).loss_sum, logp)
    weighted = _grad_of(lambda x: ppo_clip(x, old, adv, mask, is_weights=w).loss_sum, logp)
    torch.testing.assert_close(weighted, base * w.detach())
    assert w.grad is None


def test_metrics_clipfrac() -> None:
    logp = torch.log(torch.tensor([[1.0, 1.5, 0.5, 1.0]]))
    out = ppo_clip(logp, torch.zeros(1, 4), torch.tensor([1.0]), torch.tensor([[1, 1, 1, 0]]))
    assert float(out.metrics["pg/clipfrac"]) == pytest.approx(1 / 3)  # only r = 1.5 (A > 0)
    assert float(out.metrics["pg/ratio_mean"]) == pytest.approx(1.0)


# ------------------------------------------------------------------------------ aggregation


def _values_and_mask():
    values = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [5.0, 5.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # third sequence: no tokens
    return values, mask


def test_aggregation_modes_by_hand() -> None:
    values, mask = _values_and_mask()
    want = {
        "token-mean": (10.0, 4.0),
        "seq-mean-token-mean": (2.0 + 4.0, 2.0),
        "seq-mean-token-sum": (6.0 + 4.0, 2.0),
        "seq-mean-token-sum-norm": ((6.0 + 4.0) / 4, 2.0),
    }
    for mode in AGG_MODES:
        total, count = aggregate(values, mask, mode)
        assert (float(total), float(count)) == pytest.approx(want[mode]), mode
    assert float(aggregate(values, mask, "seq-mean-token-sum-norm", norm_length=10)[0]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(values, mask, "mean")


@pytest.mark.parametrize("mode", AGG_MODES)
def test_sums_and_counts_compose_across_micro_batches(mode: str) -> None:
    """What megatron-core does with calculate_per_token_loss: Σ sums / Σ counts over splits."""
    g = torch.Generator().manual_seed(1)
    values = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    total, count = aggregate(values, mask, mode)
    parts = [aggregate(values[i : i + 2], mask[i : i + 2], mode, norm_length=5) for i in (0, 2, 4)]
    assert float(sum(p[0] for p in parts) / sum(p[1] for p in parts)) == pytest.approx(float(total / count))


# ------------------------------------------------------------------------------------- GSPO


def test_gspo_ratio_is_length_normalised_sequence_ratio() -> None:
    g = torch.Generator().manual_seed(2)
    logp, old = torch.randn(2, 5, generator=g) * 0.1, torch.randn(2, 5, generator=g) * 0.1
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    adv = torch.tensor([1.0, -1.0])
    out = gspo(logp, old, adv, mask, clip_low=10.0, clip_high=10.0)  # effectively unclipped
    s = torch.exp(sequence_log_ratio(logp, old, mask))
    assert float(out.metrics["pg/ratio_mean"]) == pytest.approx(float((s[0] * 3 + s[1] * 5) / 8))
    # gradient equals the sequence-level objective -mean_i(s_i A_i)
    want = _grad_of(lambda x: -(torch.exp(sequence_log_ratio(x, old, mask)) * adv).mean(), logp)
    got = _grad_of(lambda x: gspo(x, old, adv, mask, clip_low=10.0, clip_high=10.0).loss, logp)
    torch.testing.assert_close(got, want)


def test_gspo_clips_whole_sequences() -> None:
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.01, 0.01, 0.01], [0.0, 0.0, 0.0]])
    out_grad = _grad_of(lambda x: gspo(x, old, torch.tensor([1.0, 1.0]), torch.ones(2, 3)).loss, logp)
    assert torch.equal(out_grad[0], torch.zeros(3))  # s = e^0.01 > 1 + 4e-4: every token clipped
    assert bool((out_grad[1] != 0).all())


# --------------------------------------------------------------------------------------- KL


def test_kl_estimators_values_and_signs() -> None:
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -2.0, -0.1])
    d = ref - logp
    torch.testing.assert_close(k1(logp, ref), -d)
    torch.testing.assert_close(k2(logp, ref), 0.5 * d * d)
    torch.testing.assert_close(k3(logp, ref), torch.exp(d) - d - 1)
    assert bool((k3(logp, ref) >= 0).all()) and float(k3(logp, logp).abs().max()) == 0.0


def test_k1_and_k3_unbiased_k2_biased_on_samples() -> None:
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(20, generator=g), -1)
    q = torch.softmax(torch.randn(20, generator=g), -1)
    exact = float((p * (p.log() - q.log())).sum())
    y = torch.multinomial(p, 400_000, replacement=True, generator=g)
    lp, lq = p.log()[y], q.log()[y]
    est = {name: float(fn(lp, lq).double().mean()) for name, fn in (("k1", k1), ("k2", k2), ("k3", k3))}
    se = {name: float(fn(lp, lq).double().std()) / math.sqrt(len(y)) for name, fn in (("k1", k1), ("k3", k3))}
    assert abs(est["k1"] - exact) < 4 * se["k1"]
    assert abs(est["k3"] - exact) < 4 * se["k3"]
    assert se["k3"] < se["k1"]  # the low-variance one
    assert abs(est["k2"] - exact) > 0.02  # k2 is biased at this distance (exact ~ 0.6)


def test_kl_as_reward_penalty_and_as_loss() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0, -1.0]])
    mask = torch.tensor([[1, 1, 0]])
    r = kl_penalized_rewards(torch.tensor([1.0]), logp, ref, mask, coef=0.1, kind="k1")
    assert float(r) == pytest.approx(1.0 - 0.1 * 0.5) and not r.requires_grad
    total, count = kl_loss(logp, ref, mask, kind="k3")
    total.backward()
    d = (ref - logp.detach())[0, :2]
    torch.testing.assert_close(logp.grad[0, :2], 1 - torch.exp(d))  # ∇k3 = (1 - π_ref/π) ∇log π
    assert float(logp.grad[0, 2]) == 0.0 and float(count) == 2


def test_entropy_bonus_lowers_loss_when_entropy_rises() -> None:
    ent = torch.tensor([[1.0, 2.0], [3.0, 0.0]], requires_grad=True)
    total, count = entropy_bonus(ent, torch.tensor([[1, 1], [1, 0]]), coef=0.01)
    assert float(total.detach() / count) == pytest.approx(-0.02)
    total.backward()
    torch.testing.assert_close(ent.grad, torch.tensor([[-0.01, -0.01], [-0.01, 0.0]]))
