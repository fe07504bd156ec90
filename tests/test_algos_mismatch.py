"""TIS / MIS / IcePop / geometric mask / veto (docs/mismatch_correction.md) and the mismatch metrics."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl import algos
from mcore_rl.algos.mismatch import (
    MismatchConfig,
    correct,
    icepop_weights,
    mismatch_metrics,
    ratio_mask,
    tis_weights,
    veto_mask,
)
from mcore_rl.algos.policy_loss import ppo_clip

LN = math.log


def _pair(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(π_old, μ) log-probs with the given per-token ratios π_old/μ."""
    mu = torch.full((len(ratios), len(ratios[0])), -1.0)
    return mu + torch.log(torch.tensor(ratios)), mu


def test_token_tis_is_clamped_ratio_and_constant() -> None:
    train, mu = _pair([[0.5, 1.0, 3.0, 1.5]])
    train.requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0]])
    w = tis_weights(train, mu, mask)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 2.0, 0.0]]))
    assert not w.requires_grad
    torch.testing.assert_close(tis_weights(train, mu, mask, clip_low=0.8), torch.tensor([[0.8, 1.0, 2.0, 0.0]]))


def test_sequence_and_geometric_levels() -> None:
    train, mu = _pair([[1.2, 1.5, 1.0], [0.9, 0.8, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    seq = tis_weights(train, mu, mask, level="sequence", clip_high=10.0)
    torch.testing.assert_close(seq, torch.tensor([[1.8] * 3, [0.72, 0.72, 0.0]]))
    torch.testing.assert_close(tis_weights(train, mu, mask, level="sequence", clip_high=1.5)[0], torch.full((3,), 1.5))
    geo = tis_weights(train, mu, mask, level="geometric")
    torch.testing.assert_close(geo[1, :2], torch.full((2,), 0.72**0.5))
    with pytest.raises(ValueError, match="level"):
        tis_weights(train, mu, mask, level="batch")


def test_tis_with_pi_equal_mu_is_exactly_ppo() -> None:
    g = torch.Generator().manual_seed(0)
    old = torch.randn(4, 6, generator=g) - 2
    logp = (old + 0.3 * torch.randn(4, 6, generator=g)).requires_grad_()
    adv, mask = torch.randn(4, generator=g), (torch.rand(4, 6, generator=g) > 0.2).float()
    corr = correct(old, old.clone(), mask)
    assert torch.equal(corr.weights, mask) and torch.equal(corr.mask, mask)
    a = ppo_clip(logp, old, adv, corr.mask, is_weights=corr.weights)
    (ga,) = torch.autograd.grad(a.loss, logp)
    b = ppo_clip(logp, old, adv, mask)
    (gb,) = torch.autograd.grad(b.loss, logp)
    assert torch.equal(a.loss, b.loss) and torch.equal(ga, gb)
    assert float(corr.metrics["mismatch/k3"]) == 0.0 and float(corr.metrics["mismatch/clipfrac"]) == 0.0


def test_icepop_and_mis_mask_outside_bounds() -> None:
    train, mu = _pair([[0.4, 0.5, 1.3, 5.0, 6.0]])
    mask = torch.ones(1, 5)
    torch.testing.assert_close(icepop_weights(train, mu, mask), torch.tensor([[0.0, 0.5, 1.3, 5.0, 0.0]]))
    for name in ("icepop", "mis"):
        c = algos.get("mismatch", name)(train, mu, mask)
        torch.testing.assert_close(c.weights, torch.tensor([[0.0, 0.5, 1.3, 5.0, 0.0]]))
        assert c.mask.tolist() == [[0, 1, 1, 1, 0]]
        assert float(c.metrics["mismatch/maskfrac"]) == pytest.approx(0.4)
        assert float(c.metrics["mismatch/is_weight_max"]) == pytest.approx(5.0)


def test_geometric_sequence_mask() -> None:
    # seq 0: tokens deviate but cancel (geometric mean 1); seq 1: uniformly 1% off
    train, mu = _pair([[1.1, 1 / 1.1, 1.0], [1.01, 1.01, 1.01]])
    mask = torch.ones(2, 3)
    keep = ratio_mask(train, mu, mask, level="geometric", low=0.999, high=1.002)
    assert keep.tolist() == [[1, 1, 1], [0, 0, 0]]
    c = algos.get("mismatch", "seq_mask_tis")(train, mu, mask)
    assert c.mask.tolist() == [[1, 1, 1], [0, 0, 0]]
    torch.testing.assert_close(c.weights[0], torch.tensor([1.1, 1 / 1.1, 1.0]))  # untruncated token IS
    # token-level mask with the same bounds would drop seq 0's first two tokens
    assert ratio_mask(train, mu, mask, level="token", low=0.999, high=1.002)[0].tolist() == [0, 0, 1]


def test_veto_drops_whole_sequence() -> None:
    train, mu = _pair([[1.0, 5e-5, 1.0], [1.0, 2e-4, 1.0], [1.0, 1.0, 1e-6]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]])  # seq 2's bad token is padding
    assert veto_mask(train, mu, mask).tolist() == [[0, 0, 0], [1, 1, 1], [1, 1, 0]]
    c = correct(train, mu, mask, MismatchConfig(veto_threshold=1e-4))
    assert c.mask[0].sum() == 0 and float(c.metrics["mismatch/veto_frac"]) == pytest.approx(1 / 3)


def test_batch_normalize_and_presets_take_overrides() -> None:
    train, mu = _pair([[0.5, 1.0, 3.0], [1.5, 1.0, 1.0]])
    mask = torch.ones(2, 3)
    c = correct(train, mu, mask, MismatchConfig(batch_normalize=True))
    assert float((c.weights * c.mask).sum() / c.mask.sum()) == pytest.approx(1.0)
    c3 = algos.get("mismatch", "tis")(train, mu, mask, is_clip_high=3.0)
    assert float(c3.weights.max()) == pytest.approx(3.0)
    c2 = algos.get("mismatch", "tis")(train, mu, mask)
    assert float(c2.metrics["mismatch/clipfrac"]) == pytest.approx(1 / 6)
    none = algos.get("mismatch", "none")(train, mu, mask)
    assert torch.equal(none.weights, mask) and float(none.metrics["mismatch/k3"]) > 0


def test_metrics_by_hand_and_k3_properties() -> None:
    train = torch.tensor([[-1.0, -2.0, -0.5]])
    mu = torch.tensor([[-1.2, -2.0, -0.1]])
    mask = torch.tensor([[1, 1, 0]])
    m = mismatch_metrics(train, mu, mask)
    d = torch.tensor([0.2, 0.0])
    assert float(m["mismatch/k3"]) == pytest.approx(float((torch.exp(d) - d - 1).mean()), rel=1e-5)
    assert float(m["mismatch/abs_logp_diff"]) == pytest.approx(0.1)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(50, 8, generator=g), torch.randn(50, 8, generator=g)
    k3 = torch.expm1(a - b) - (a - b)
    assert bool((k3 >= 0).all()) and bool((k3 > 0).all())
    assert float(mismatch_metrics(a, a.clone(), torch.ones(50, 8))["mismatch/k3"]) == 0.0


def test_extreme_ratios_stay_finite() -> None:
    train, mu = torch.tensor([[0.0, -200.0]]), torch.tensor([[-200.0, 0.0]])
    for name in algos.names("mismatch"):
        c = algos.get("mismatch", name)(train, mu, torch.ones(1, 2))
        assert bool(torch.isfinite(c.weights).all()), name
        assert all(bool(torch.isfinite(v)) for v in c.metrics.values()), name


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="is_mode"):
        MismatchConfig(is_mode="clip")
    with pytest.raises(ValueError, match="mask_level"):
        MismatchConfig(mask_level="batch")
    with pytest.raises(ValueError, match="is_clip_low"):
        MismatchConfig(is_clip_low=3.0)
