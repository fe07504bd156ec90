"""MIPU (arXiv:2606.29526, testable properties 1-6) and the LR-decay baseline; the accept/reject gate
with the project's real `ModelParallelAdamW.snapshot()/restore()`."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from mcore_rl.algos.advantages import grpo, make_group_ids
from mcore_rl.algos.mipu import (
    MIPUController,
    TPostEstimate,
    accept,
    bootstrap_flip_rate,
    decide,
    flip_probability,
    ratio_se,
    lr_decay_baseline,
    sequence_ratio,
    step1_correction,
    step1_loss,
    t_hat_post,
    validation_estimate,
    validation_t_post,
    tolerance,
)
from mcore_rl.algos.mismatch import mismatch_metrics
from mcore_rl.algos.policy_loss import ppo_clip


def _batch(seed: int = 0, n: int = 4, t: int = 6):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(n, t, generator=g) - 2.0
    logp = old + 0.1 * torch.randn(n, t, generator=g)
    adv = torch.randn(n, generator=g)
    mask = (torch.rand(n, t, generator=g) > 0.2).float()
    return logp, old, adv, mask


def _loss_and_grad(fn, logp: torch.Tensor):
    x = logp.detach().clone().requires_grad_()
    out = fn(x)
    (g,) = torch.autograd.grad(out.loss, x)
    return out.loss.detach(), g


def test_p1_pi_k_equal_mu_gives_ppo() -> None:
    logp, old, adv, mask = _batch()
    a_loss, a_grad = _loss_and_grad(lambda x: step1_loss(x, old, old.clone(), adv, mask), logp)
    b_loss, b_grad = _loss_and_grad(lambda x: ppo_clip(x, old, adv, mask), logp)
    assert torch.equal(a_loss, b_loss) and torch.equal(a_grad, b_grad)


@pytest.mark.parametrize("w, factor", [(5.0, 2.0), (0.5, 0.5), (1.5, 1.5)])
def test_p2_truncated_weight_scales_unclipped_gradient(w: float, factor: float) -> None:
    logp = torch.full((1, 1), -1.0)
    old = torch.full((1, 1), -1.0 - math.log(1.05))  # r = 1.05: inside the clip range
    mu = old - math.log(w)  # π_k/μ_k = w
    adv, mask = torch.tensor([0.7]), torch.ones(1, 1)
    _, g_mipu = _loss_and_grad(lambda x: step1_loss(x, old, mu, adv, mask), logp)
    _, g_ppo = _loss_and_grad(lambda x: ppo_clip(x, old, adv, mask), logp)
    torch.testing.assert_close(g_mipu, factor * g_ppo, rtol=1e-6, atol=0)


def test_p2_no_gradient_into_pi_k_or_mu() -> None:
    logp, old, adv, mask = _batch(1)
    old = old.clone().requires_grad_()
    mu = (old.detach() - 0.3).requires_grad_()
    x = logp.clone().requires_grad_()
    step1_loss(x, old, mu, adv, mask).loss.backward()
    assert old.grad is None and mu.grad is None and x.grad is not None


def test_p3_clip_acts_only_on_pi_theta_over_pi_k() -> None:
    logp = torch.full((1, 1), -1.0)
    old = logp.clone()  # π_θ = π_k: r = 1
    mu = old - math.log(3.0)  # w = π_k/μ_k = 3
    adv, mask = torch.tensor([1.0]), torch.ones(1, 1)
    _, g_tis = _loss_and_grad(lambda x: step1_loss(x, old, mu, adv, mask), logp)
    assert float(g_tis) == pytest.approx(-2.0)  # non-zero: w̄ = min(3, 2) times -A·r
    # PPO-IS: clip(π_θ/μ_k, 0.8, 1.2) at 3 is flat -> zero gradient
    _, g_ppo_is = _loss_and_grad(lambda x: ppo_clip(x, mu, adv, mask), logp)
    assert float(g_ppo_is) == 0.0


def test_p4_t_post_zero_when_rho_one_and_equals_minus_covariance() -> None:
    g = torch.Generator().manual_seed(2)
    groups = make_group_ids(3, 4)
    adv = grpo(torch.randint(0, 2, (12,), generator=g).float(), groups)
    mu = torch.randn(12, 5, generator=g)
    mask = torch.ones(12, 5)
    t = t_hat_post(mu.clone(), mu, mask, adv)
    assert t == pytest.approx(0.0, abs=1e-7) and accept(t, 0.0)
    pi = mu + 0.05 * torch.randn(12, 5, generator=g)
    rho = sequence_ratio(pi, mu, mask)
    cov = sum(float(((rho[groups == k] - rho[groups == k].mean()) * adv[groups == k]).mean()) for k in range(3)) / 3
    assert t_hat_post(pi, mu, mask, adv) == pytest.approx(-cov, abs=1e-6)
    # length-normalised: padding does not change ρ
    padded = torch.cat([pi, torch.zeros(12, 3)], 1), torch.cat([mu, torch.full((12, 3), -9.0)], 1)
    torch.testing.assert_close(sequence_ratio(*padded, torch.cat([mask, torch.zeros(12, 3)], 1)), rho)


def test_p5_tolerance_annealing() -> None:
    cs, ce = 4e-3, 1e-3
    assert tolerance(0, cs, ce) == cs
    assert tolerance(50, cs, ce) == pytest.approx((cs + ce) / 2)
    assert all(tolerance(t, cs, ce) == pytest.approx(ce) for t in (100, 101, 10_000))
    assert accept(-1e-3, 1e-3) and not accept(-1.1e-3, 1e-3) and not accept(float("nan"), 1.0)


def test_p6_k3_nonnegative_zero_iff_equal() -> None:
    g = torch.Generator().manual_seed(3)
    a = torch.randn(10, 10, generator=g)
    m = torch.ones(10, 10)
    assert float(mismatch_metrics(a, a.clone(), m)["mismatch/k3"]) == 0.0
    for _ in range(5):
        b = a + 0.1 * torch.randn(10, 10, generator=g)
        assert float(mismatch_metrics(a, b, m)["mismatch/k3"]) > 0.0


# ------------------------------------------------------------------ the gate, real optimizer


def _checksum(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _trainer_checksum(model: torch.nn.Module, opt) -> str:
    tensors = [p for p in model.parameters()] + [m for m in opt.main_params]
    for m in opt.main_params:
        for k in sorted(opt.optimizer.state.get(m, {})):
            v = opt.optimizer.state[m][k]
            tensors.append(v if isinstance(v, torch.Tensor) else torch.tensor(float(v)))
    tensors.append(
        torch.tensor([opt.get_lr(), float(opt.scheduler.state_dict().get("num_steps", 0))], dtype=torch.float64)
    )
    return _checksum(tensors) + repr(sorted(opt.scheduler.state_dict().items()))


class Policy(torch.nn.Module):
    """A bag-of-context toy policy: logits over 7 tokens from a learned embedding of the prompt."""

    def __init__(self, dtype=torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(5, 8).to(dtype)
        self.head = torch.nn.Linear(8, 7).to(dtype)
        self.norm = torch.nn.LayerNorm(8).to(dtype)

    def logp(self, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(self.emb(prompts))).float().log_softmax(-1)  # [N, 7]
        return logits[:, None, :].expand(-1, tokens.shape[1], -1).gather(-1, tokens[..., None]).squeeze(-1)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_p6_reject_restores_trainer_and_engine_bit_identically(precision: str) -> None:
    from mcore_rl.config.schema import OptimizerConfig
    from mcore_rl.train.optimizer import build_optimizer

    model = Policy(torch.bfloat16 if precision == "bf16" else torch.float32)
    opt = build_optimizer([model], OptimizerConfig(lr=0.05, lr_warmup_iters=2, clip_grad=1.0), precision, 20)
    engine: dict[str, torch.Tensor] = {}

    def sync() -> None:  # the "engine" gets a copy of the weights, as a weight sync would
        engine.clear()
        engine.update({k: v.detach().clone() for k, v in model.state_dict().items()})

    g = torch.Generator().manual_seed(5)
    prompts = torch.arange(4).repeat_interleave(2)
    tokens = torch.randint(0, 7, (8, 3), generator=g)
    mask = torch.ones(8, 3)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.0])

    def update() -> None:
        with torch.no_grad():
            old = model.logp(prompts, tokens)
        mu = old - 0.05 * torch.randn(old.shape, generator=g)  # the engine's (mismatched) log-probs
        adv = grpo(rewards, torch.arange(4).repeat_interleave(2))
        for _ in range(2):  # two mini-batch steps per update
            model.zero_grad()
            step1_loss(model.logp(prompts, tokens), old, mu, adv, mask).loss.backward()
            opt.step()

    resyncs = []
    ctrl = MIPUController(opt.snapshot, opt.restore, lambda: (resyncs.append(1), sync()), c_start=1e-3, c_end=0.0)
    sync()
    ctrl.begin()
    update()
    sync()
    first = ctrl.decide(0.0)  # accepted: state moves on
    assert first.accepted and not resyncs and first.tolerance == 1e-3
    before = _trainer_checksum(model, opt)
    engine_before = _checksum(engine.values())
    step_before = opt.scheduler.state_dict()

    ctrl.begin()
    update()
    sync()
    assert _trainer_checksum(model, opt) != before and _checksum(engine.values()) != engine_before
    decision = ctrl.decide(-0.5)  # T̂_post far below -c_t: reject
    assert not decision.accepted and resyncs == [1]
    assert _trainer_checksum(model, opt) == before
    assert _checksum(engine.values()) == engine_before
    assert opt.scheduler.state_dict() == step_before
    assert decision.step == 1 and ctrl.t == 2 and ctrl.metrics()["mipu/reject_rate"] == 0.5
    assert decision.metrics() == {"mipu/t_post": -0.5, "mipu/tolerance": pytest.approx(0.99e-3), "mipu/accepted": 0.0}

    # the restored trainer replays the same update exactly (torch backend)
    ctrl.begin()
    state = g.get_state()
    update()
    after_a = _trainer_checksum(model, opt)
    ctrl.decide(-1.0)
    g.set_state(state)
    update()
    assert _trainer_checksum(model, opt) == after_a


def test_controller_requires_begin_and_counts_only_accepted_if_asked() -> None:
    calls = []
    ctrl = MIPUController(lambda: "snap", calls.append, lambda: calls.append("resync"), count_rejected=False)
    with pytest.raises(RuntimeError, match="begin"):
        ctrl.decide(0.0)
    ctrl.begin()
    assert not ctrl.decide(-1.0).accepted and calls == ["snap", "resync"] and ctrl.t == 0
    ctrl.begin()
    assert ctrl.decide(1.0).accepted and ctrl.t == 1
    state = ctrl.state_dict()
    other = MIPUController(lambda: None, lambda s: None, lambda: None)
    other.load_state_dict(state)
    assert other.state_dict() == {"t": 1, "accepted": 1, "rejected": 1}


def test_lr_decay_baseline() -> None:
    assert lr_decay_baseline(50, 1.0, None, 10) == 1.0
    assert [lr_decay_baseline(t, 1.0, 20, 10) for t in (19, 20, 29, 30, 40, 50, 60, 1000)] == [
        1.0,
        0.5,
        0.5,
        0.25,
        0.125,
        0.1,
        0.1,
        0.1,
    ]
    assert lr_decay_baseline(35, 1.0, 20, 10, factor=0.25, min_lr=0.01) == 0.25**2


def test_step1_correction_is_the_registered_mipu_correction_and_matches_step1_loss() -> None:
    from mcore_rl.algos import registry

    logp, old, adv, mask = _batch(3)
    mu = old - 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(9))
    corr = registry.get("mismatch", "mipu")(old, mu, mask, is_clip_high=2.0, is_level="token", mask_low=None)
    assert torch.equal(corr.mask, mask)
    assert torch.all(corr.weights <= 2.0)
    via_parts = ppo_clip(logp, old, adv, mask, 0.2, 0.2, None, is_weights=corr.weights)
    assert torch.equal(via_parts.loss_sum, step1_loss(logp, old, mu, adv, mask).loss_sum)
    assert set(corr.metrics) >= {"mismatch/k3", "mismatch/is_weight_mean", "mismatch/clipfrac", "mismatch/maskfrac"}
    assert torch.equal(step1_correction(old, mu, mask).weights, corr.weights)  # defaults: w_max 2, token level


def test_validation_t_post_is_t_hat_post_with_grpo_advantages() -> None:
    logp, mu, _, mask = _batch(4)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    groups = make_group_ids(2, 2)
    assert validation_t_post(logp, mu, mask, rewards, groups) == t_hat_post(logp, mu, mask, grpo(rewards, groups))


def test_validation_t_post_leaves_unusable_samples_out() -> None:
    """Failed samples count neither in the groups' advantages nor in the mean over sequences."""
    logp, mu, _, mask = _batch(5, n=6)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    groups = make_group_ids(2, 3)
    ok = torch.tensor([True, True, False, True, True, False])
    got = validation_t_post(logp, mu, mask, rewards, groups, valid=ok)
    assert got == validation_t_post(logp[ok], mu[ok], mask[ok], rewards[ok], groups[ok])
    junk = rewards.clone()
    junk[~ok] = 7.0  # what a failed sample scored does not matter
    assert validation_t_post(logp, mu, mask, junk, groups, valid=ok) == got
    assert got != validation_t_post(logp, mu, mask, rewards, groups)
    assert validation_t_post(logp, mu, mask, rewards, groups, valid=torch.zeros(6, dtype=torch.bool)) == 0.0


# ---------------------------------------------------------------------------------- Step 2's noise


def _validation_batch(g: torch.Generator, k: int, size: int, t: int = 6, slope: float = 0.02, noise: float = 0.02):
    """K prompts of random difficulty, G 0/1 rewards each, per-token log π - log μ whose mean over
    a sequence is `slope`·(r - 1/2) + N(0, noise²): ρ is correlated with the reward, so the true
    T_post is non-zero (negative: π > μ on the correct answers, whose Â > 0)."""
    p = torch.rand(k, 1, generator=g) * 0.8 + 0.1
    rewards = (torch.rand(k, size, generator=g) < p).float().reshape(-1)
    mu = torch.randn(k * size, t, generator=g) - 2.0
    d = slope * (rewards - 0.5) + noise * torch.randn(k * size, generator=g)
    pi = mu + d[:, None] + 0.01 * torch.randn(k * size, t, generator=g)  # token noise, mean-zero-ish
    mask = torch.ones(k * size, t)
    ids = torch.arange(k).repeat_interleave(size) * 7 + 3  # any ids, as the loop's prompt indices
    return pi, mu, mask, rewards, ids


def test_validation_estimate_is_validation_t_post_with_a_group_level_se() -> None:
    g = torch.Generator().manual_seed(11)
    pi, mu, mask, rewards, ids = _validation_batch(g, 6, 4)
    est = validation_estimate(pi, mu, mask, rewards, ids)
    assert est.t_post == validation_t_post(pi, mu, mask, rewards, ids)
    assert est.t_post == pytest.approx(float(est.group_sums.sum() / est.group_counts.sum()), rel=1e-5, abs=1e-9)
    # equal groups: SE = sd(s_g / G, ddof=1) / sqrt(K)
    per_group = est.group_sums / est.group_counts
    assert torch.equal(est.group_counts, torch.full((6,), 4.0, dtype=torch.float64))
    assert est.se == pytest.approx(float(per_group.std()) / math.sqrt(6), rel=1e-9)
    # s_g = -Σ (ρ - 1) Â too: GRPO's Â sums to 0 over a group
    rho = sequence_ratio(pi, mu, mask).double()
    adv = grpo(rewards, ids)
    alt = torch.stack([-((rho[ids == i] - 1) * adv[ids == i]).sum() for i in torch.unique(ids)])
    torch.testing.assert_close(est.group_sums, alt, rtol=0, atol=1e-6)  # ρ is float32
    # unusable samples count nowhere, as in validation_t_post; a constant-reward group is uninformative
    ok = torch.ones(24, dtype=torch.bool)
    ok[[1, 9]] = False
    rewards2 = rewards.clone()
    rewards2[:4] = 1.0
    est2 = validation_estimate(pi, mu, mask, rewards2, ids, valid=ok)
    assert est2.t_post == validation_t_post(pi, mu, mask, rewards2, ids, valid=ok)
    assert est2.group_counts.tolist() == [3.0, 4.0, 3.0, 4.0, 4.0, 4.0] and float(est2.group_sums[0]) == 0.0
    assert est2.informative_groups == 6 - 1 - sum(float(rewards2[ids == i].std()) == 0 for i in torch.unique(ids)[1:])
    # nothing to estimate a spread from
    assert validation_estimate(pi[:4], mu[:4], mask[:4], rewards[:4], ids[:4]).se == math.inf
    none = validation_estimate(pi, mu, mask, rewards, ids, valid=torch.zeros(24, dtype=torch.bool))
    assert none.t_post == 0.0 and none.se == math.inf


@pytest.mark.parametrize("k, size", [(32, 8), (16, 4)])
def test_se_matches_the_spread_of_many_validation_batches(k: int, size: int) -> None:
    """Brute force: the SD of T̂_post over 1500 independent batches vs the formula's mean SE."""
    g = torch.Generator().manual_seed(k * 100 + size)
    ts, ses = [], []
    for _ in range(1500):
        est = validation_estimate(*_validation_batch(g, k, size))
        ts.append(est.t_post)
        ses.append(est.se)
    ts_t = torch.tensor(ts, dtype=torch.float64)
    sd, se = float(ts_t.std()), sum(ses) / len(ses)
    assert float(ts_t.mean()) < -3 * sd / math.sqrt(len(ts))  # the batches have a real (negative) T_post
    assert se == pytest.approx(sd, rel=0.10), (se, sd)
    # samples as if independent would be far off: -ρ_i Â_i has SD ≈ SD(Â) ≈ 1, but Â sums to 0 per group
    pi, mu, mask, rewards, ids = _validation_batch(g, k, size)
    x = -(sequence_ratio(pi, mu, mask).double() * grpo(rewards, ids))
    assert float(x.std()) / math.sqrt(x.numel()) > 5 * sd


def test_flip_probability_and_bootstrap_flip_rate() -> None:
    g = torch.Generator().manual_seed(5)
    sums = 0.01 * torch.randn(400, generator=g, dtype=torch.float64) - 0.002 * 8
    counts = torch.full((400,), 8.0, dtype=torch.float64)
    t, se = ratio_se(sums, counts)
    assert se > 0
    # far from the threshold: nobody flips
    for c in (-t + 10 * se, -t - 10 * se):
        assert bootstrap_flip_rate(sums, counts, c, 500, seed=1) == 0.0
        assert flip_probability(t, se, c) < 1e-12
    # at the threshold: a coin flip
    assert bootstrap_flip_rate(sums, counts, -t, 2000, seed=1) == pytest.approx(0.5, abs=0.05)
    assert flip_probability(t, se, -t) == 0.5
    # one SE from it: Φ(-1) ≈ 0.159, both ways
    assert flip_probability(t, se, -t + se) == pytest.approx(0.1587, abs=1e-3)
    assert bootstrap_flip_rate(sums, counts, -t + se, 4000, seed=2) == pytest.approx(0.1587, abs=0.03)
    # seeded: the same resamples
    assert bootstrap_flip_rate(sums, counts, -t + se, 300, seed=3) == bootstrap_flip_rate(
        sums, counts, -t + se, 300, seed=3
    )
    # the "se" rule's threshold is -c - z·SE
    assert flip_probability(t, se, -t - 2 * se, z=2.0) == pytest.approx(0.5)
    assert bootstrap_flip_rate(sums, counts, -t - 2 * se, 2000, seed=4, rule="se", z=2.0) == pytest.approx(
        0.5, abs=0.08
    )
    assert flip_probability(t, math.inf, 0.0) == 0.5 and flip_probability(-1.0, 0.0, 0.0) == 0.0


def test_se_decision_rule_rejects_only_beyond_z_standard_errors() -> None:
    c, se = 1e-3, 4e-3
    assert decide(-c, se, c, "plain") and decide(-c, se, c, "se", 2.0)
    t = -c - 1.5 * se  # below the tolerance, within the noise
    assert not decide(t, se, c, "plain") and decide(t, se, c, "se", 2.0) and not decide(t, se, c, "se", 1.0)
    t = -c - 3 * se  # clear evidence of a worse engine policy
    assert not decide(t, se, c, "plain") and not decide(t, se, c, "se", 2.0)
    assert decide(-1.0, math.inf, c, "se", 2.0)  # no spread estimate: no evidence to reject on
    assert not decide(float("nan"), se, c, "se") and not decide(float("nan"), se, c, "plain")
    assert decide(-c - 1e-9, 0.0, c, "se", 2.0) is False  # SE 0: the plain rule
    with pytest.raises(ValueError, match="unknown MIPU decision rule 'bogus'"):
        decide(0.0, se, c, "bogus")


def test_controller_with_the_se_rule_and_logged_noise() -> None:
    calls: list[str] = []
    ctrl = MIPUController(
        lambda: "snap",
        lambda s: calls.append("restore"),
        lambda: calls.append("resync"),
        c_start=1e-3,
        c_end=1e-3,
        rule="se",
        z=2.0,
        bootstrap=100,
    )
    sums = torch.tensor([-0.06, 0.0, -0.01, 0.02], dtype=torch.float64)
    counts = torch.full((4,), 8.0, dtype=torch.float64)
    t, se = ratio_se(sums, counts)
    est = TPostEstimate(t, se, sums, counts, 3)
    assert t < -1e-3 and t > -1e-3 - 2 * se  # plain would reject
    ctrl.begin()
    d = ctrl.decide(est)
    assert d.accepted and calls == [] and d.se == se
    assert d.flip_prob == pytest.approx(flip_probability(t, se, 1e-3, 2.0))
    assert 0.0 <= d.bootstrap_flip <= 1.0
    m = d.metrics()
    assert set(m) >= {"mipu/t_post", "mipu/t_post_se", "mipu/flip_prob", "mipu/bootstrap_flip_rate", "mipu/accepted"}
    ctrl.begin()
    with pytest.raises(ValueError, match="needs the estimate"):
        ctrl.decide(t)
    plain = MIPUController(
        lambda: "snap", lambda s: calls.append("restore"), lambda: calls.append("resync"), c_start=1e-3, c_end=1e-3
    )
    plain.begin()
    assert not plain.decide(est).accepted and calls == ["restore", "resync"]
    plain.begin()
    bare = plain.decide(0.5)  # a bare float still works with the plain rule, and logs what it always did
    assert math.isnan(bare.se) and set(bare.metrics()) == {"mipu/t_post", "mipu/tolerance", "mipu/accepted"}
    with pytest.raises(ValueError, match="unknown MIPU decision rule"):
        MIPUController(lambda: None, lambda s: None, lambda: None, rule="strict")
