"""Advantages across domains and reward heads: TMN-Reweight (GoLongRL), DVAO, PAPO, ALP, CGPO — each
property its paper states (docs/papers.md) — and how they reach the learner: the
kinds' signatures, the sequence view's domain ids and head matrix, the config keys and their errors."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl import algos
from mcore_rl.algos.advantages import grpo
from mcore_rl.algos.alp import alp
from mcore_rl.algos.cgpo import calibrated, cgpo_judges, codpo_pairs, weight_domains
from mcore_rl.algos.critic import ValueBatch, takes_values
from mcore_rl.algos.dvao import dvao, dvao_combine
from mcore_rl.algos.golongrl import difficulty_weight, golongrl, reweight
from mcore_rl.algos.multi_reward import domain_metrics, option_problems, restrict_to_domains
from mcore_rl.algos.papo import papo
from mcore_rl.algos.policy_loss import ppo_clip
from mcore_rl.config import ConfigError, RLConfig, load_config, validate_rl_config
from mcore_rl.data.samples import Prompt, Sample
from mcore_rl.train.packing import sequence_view

E = math.e


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _groups(num: int, size: int) -> torch.Tensor:
    return torch.arange(num).repeat_interleave(size)


def _pop_grpo(r: torch.Tensor, g: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """GRPO with the population std, float64, written out (the specs' reference advantage)."""
    out = torch.zeros(len(r), dtype=torch.float64)
    for k in g.unique():
        sel = g == k
        x = r[sel].double()
        sd = x.std(unbiased=False)
        out[sel] = (x - x.mean()) / sd if sd > eps else 0.0
    return out


# ============================================================================ GoLongRL TMN-Reweight


def test_golongrl_weight_is_one_at_half_solved_and_never_flips_a_sign() -> None:
    assert float(difficulty_weight(torch.tensor(0.5))) == 1.0
    a_hat = torch.tensor([1.5, -0.5, 0.0, 2.0])
    assert torch.equal(reweight(a_hat, difficulty_weight(torch.full((4,), 0.5))), a_hat)
    # a group with p̂ = 0.5 through the estimator: Ã = Â (TMN alone)
    r, g = torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long)
    torch.testing.assert_close(golongrl(r, g), golongrl(r, g, difficulty_reweight=False))
    for seed in range(100):
        gen = _gen(seed)
        n = 24
        rewards = torch.rand(n, generator=gen).round(decimals=1)
        groups = torch.randint(0, 5, (n,), generator=gen)
        domains = groups % 2
        plain = golongrl(rewards, groups, domain_ids=domains, difficulty_reweight=False)
        full = golongrl(rewards, groups, domain_ids=domains)
        assert torch.equal(torch.sign(full), torch.sign(plain)), seed
        nz = plain != 0
        ratio = (full[nz] / plain[nz]).double()
        assert bool(((ratio >= math.exp(-0.5) - 1e-6) & (ratio <= math.exp(0.5) + 1e-6)).all()), seed


def test_golongrl_quarter_and_three_quarter_solved_factors() -> None:
    w = difficulty_weight(torch.tensor([0.25, 0.75]))
    torch.testing.assert_close(w, torch.tensor([E**0.25, E**-0.25]))
    one = torch.tensor([1.0, -1.0])
    torch.testing.assert_close(reweight(one, w[:1].expand(2)), torch.tensor([1.2840, -0.7788]), atol=1e-4, rtol=0)
    torch.testing.assert_close(reweight(one, w[1:].expand(2)), torch.tensor([0.7788, -1.2840]), atol=1e-4, rtol=0)
    # through the estimator: one prompt, one of four solved -> p̂ = 1/4 (μ̃ = μ_u = μ_task = 0.25)
    r, g = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long)
    a_hat = golongrl(r, g, difficulty_reweight=False)
    torch.testing.assert_close(golongrl(r, g), torch.cat([a_hat[:1] * E**0.25, a_hat[1:] / E**0.25]))
    r3 = 1 - r  # three of four: p̂ = 3/4
    a3 = golongrl(r3, g, difficulty_reweight=False)
    torch.testing.assert_close(golongrl(r3, g), torch.cat([a3[:1] * E**0.25, a3[1:] / E**0.25]))


def test_golongrl_scaling_one_task_leaves_it_unchanged_and_keeps_relative_spread() -> None:
    gen = _gen(3)
    groups = _groups(6, 4)
    domains = (groups >= 3).long()  # prompts 0-2: task 0, prompts 3-5: task 1
    rewards = torch.rand(24, generator=gen)
    rewards[:4] *= 0.1  # prompt 0 much less spread than prompts 1, 2
    scaled = torch.where(domains == 1, rewards * 7.5, rewards)
    for rw in (False, True):
        before = golongrl(rewards, groups, domain_ids=domains, delta=0.0, difficulty_reweight=rw)
        after = golongrl(scaled, groups, domain_ids=domains, delta=0.0, difficulty_reweight=rw)
        torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    a_hat = golongrl(rewards, groups, domain_ids=domains, delta=0.0, difficulty_reweight=False)
    g = grpo(rewards, groups, eps=0.0)
    for u in range(3):
        sd_u = float(rewards[groups == u].std())
        want = sd_u / _task_sigma(rewards, groups, [0, 1, 2])
        assert float(a_hat[groups == u].std()) == pytest.approx(want, rel=1e-4)
        assert float(g[groups == u].std()) == pytest.approx(1.0, rel=1e-4)  # GRPO: every prompt unit variance
    assert float(a_hat[groups == 0].std()) < 0.2 * float(a_hat[groups == 1].std())


def _task_sigma(r: torch.Tensor, g: torch.Tensor, prompts: list[int]) -> float:
    return math.sqrt(sum(float(r[g == u].std()) ** 2 for u in prompts) / len(prompts))


def _golongrl_spec(r: torch.Tensor, g: torch.Tensor, dom: torch.Tensor, alpha: float) -> torch.Tensor:
    """TMN-Reweight written out from the paper, per task and prompt, in float64."""
    out = torch.zeros(len(r), dtype=torch.float64)
    x = r.double()
    for d in dom.unique():
        prompts = g[dom == d].unique()
        sigma = math.sqrt(sum(float(x[g == u].std()) ** 2 for u in prompts) / len(prompts))
        mu_task = float(x[dom == d].mean())
        for u in prompts:
            sel = g == u
            mu_u = float(x[sel].mean())
            a_hat = (x[sel] - mu_u) / (sigma + 1e-6) if sigma > 0 else torch.zeros(int(sel.sum()), dtype=torch.float64)
            mu_tilde = alpha * mu_u + (1 - alpha) * mu_task
            w = math.exp(0.5 - float((x[sel] > mu_tilde).double().mean()))
            out[sel] = torch.where(a_hat > 0, a_hat * w, a_hat / w)
    return out


@pytest.mark.parametrize("alpha", [0.8, 0.3, 0.0, 1.0])
def test_golongrl_smoothed_mean_weighs_the_prompt_by_alpha_and_the_task_by_one_minus_alpha(alpha: float) -> None:
    """μ̃_u = α·μ_u + (1 − α)·μ_task with two and three prompts per task whose means differ, so
    p̂ (the share above μ̃) depends on which mean gets which weight. The batch is built so that the
    swapped weights give another p̂ for some prompt (checked), and the estimator equals the paper's."""
    # task 0: prompts of mean 0.625 and 0.25; task 1: three prompts, means 0.875, 0.5, 0.125
    r = torch.tensor(
        [1.0, 0.8, 0.5, 0.2, 0.6, 0.2, 0.1, 0.1, 1.0, 1.0, 1.0, 0.5, 0.9, 0.5, 0.3, 0.3, 0.5, 0.0, 0.0, 0.0]
    )
    g = _groups(5, 4)
    dom = torch.tensor([0, 0, 1, 1, 1]).repeat_interleave(4)
    want = _golongrl_spec(r, g, dom, alpha)
    torch.testing.assert_close(
        golongrl(r, g, domain_ids=dom, alpha=alpha, delta=1e-6).double(), want, rtol=1e-5, atol=1e-6
    )
    swapped = _golongrl_spec(r, g, dom, 1 - alpha)
    assert not torch.allclose(swapped, want, rtol=1e-3, atol=1e-4)  # the test can tell the weights apart


def test_golongrl_one_prompt_in_a_task_is_grpo() -> None:
    gen = _gen(5)
    rewards = torch.rand(12, generator=gen)
    groups = _groups(3, 4)
    domains = torch.tensor([0] * 4 + [1] * 8)  # task 0 has one prompt
    adv = golongrl(rewards, groups, domain_ids=domains, difficulty_reweight=False)
    torch.testing.assert_close(adv[:4], grpo(rewards[:4], groups[:4]))
    assert not torch.allclose(adv[4:], grpo(rewards[4:], groups[4:]))  # two prompts: the task's σ, not each one's


def test_golongrl_statistics_are_per_domain_and_ignore_invalid_samples() -> None:
    gen = _gen(7)
    groups = _groups(6, 4)
    domains = torch.tensor([1, 0, 1, 0, 1, 0]).repeat_interleave(4)
    rewards = torch.rand(24, generator=gen)
    adv = golongrl(rewards, groups, domain_ids=domains)
    for d in (0, 1):
        sel = domains == d
        torch.testing.assert_close(adv[sel], golongrl(rewards[sel], groups[sel]))  # that domain alone
    other = torch.where(domains == 1, torch.rand(24, generator=gen) * 100, rewards)
    assert torch.equal(golongrl(other, groups, domain_ids=domains)[domains == 0], adv[domains == 0])
    valid = torch.rand(24, generator=gen) > 0.3
    junk = torch.where(valid, rewards, torch.full((24,), float("nan")))
    masked = golongrl(junk, groups, domain_ids=domains, valid=valid)
    assert torch.all(masked[~valid] == 0)
    torch.testing.assert_close(masked[valid], golongrl(rewards[valid], groups[valid], domain_ids=domains[valid]))
    with pytest.raises(ValueError, match="spans several domains"):
        golongrl(rewards[:4], groups[:4], domain_ids=torch.tensor([0, 0, 1, 1]))


# ============================================================================ DVAO


def _heads_batch(seed: int, n_groups: int = 5, size: int = 6, heads: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = _gen(seed)
    r = torch.rand(n_groups * size, heads, generator=gen, dtype=torch.float64)
    r = torch.where(torch.rand(r.shape, generator=gen, dtype=torch.float64) < 0.3, r.round(), r)
    return r, _groups(n_groups, size)


def test_dvao_is_bounded_by_the_reward_sum_advantage() -> None:
    for seed in range(100):
        r, g = _heads_batch(seed)
        w = torch.rand(3, generator=_gen(1000 + seed), dtype=torch.float64) + 0.1
        w = w / w.sum()
        a, _ = dvao_combine(r, w, g, torch.ones(len(g), dtype=torch.bool))
        a_sum = _pop_grpo((r * w).sum(1), g)
        assert bool((a.abs() <= a_sum.abs() + 1e-9).all()), seed
    # perfectly positively correlated heads (r2 = a·r1 + b, a > 0): equality
    r, g = _heads_batch(0, heads=1)
    r = torch.cat([r, 2.5 * r + 0.3], 1)
    w = torch.tensor([0.3, 0.7], dtype=torch.float64)
    a, _ = dvao_combine(r, w, g, torch.ones(len(g), dtype=torch.bool))
    torch.testing.assert_close(a, _pop_grpo((r * w).sum(1), g))


def test_dvao_equal_spreads_give_the_advantage_combination_and_one_head_is_grpo() -> None:
    gen = _gen(11)
    g = _groups(4, 5)
    r1 = torch.rand(20, generator=gen, dtype=torch.float64)
    r2 = torch.cat([r1[g == k][torch.randperm(5, generator=gen)] for k in range(4)])  # same σ per group
    w = torch.tensor([0.25, 0.75], dtype=torch.float64)
    ok = torch.ones(20, dtype=torch.bool)
    a, _ = dvao_combine(torch.stack([r1, r2], 1), w, g, ok)
    torch.testing.assert_close(a, 0.25 * _pop_grpo(r1, g) + 0.75 * _pop_grpo(r2, g))
    one = dvao(r1.float(), g)  # no heads: the scalar reward is the one head
    torch.testing.assert_close(one, _pop_grpo(r1, g).float(), atol=1e-5, rtol=1e-5)
    named = dvao(torch.zeros(20), g, reward_heads=r1[:, None].float(), head_names=["acc"])
    torch.testing.assert_close(named, one, atol=1e-5, rtol=1e-5)
    # the note author's β: β = 0 is AC for any spreads
    r, gg = _heads_batch(2, heads=2)
    a0, _ = dvao_combine(r, w, gg, torch.ones(len(gg), dtype=torch.bool), beta=0.0)
    torch.testing.assert_close(a0, 0.25 * _pop_grpo(r[:, 0], gg) + 0.75 * _pop_grpo(r[:, 1], gg))


def test_dvao_constant_head_gets_no_weight_and_stays_finite() -> None:
    r, g = _heads_batch(4, heads=2)
    const = torch.cat([r, torch.full((len(g), 1), 0.7, dtype=torch.float64)], 1)
    ok = torch.ones(len(g), dtype=torch.bool)
    w3 = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    a3, _ = dvao_combine(const, w3, g, ok)
    a2, _ = dvao_combine(r, w3[:2] / w3[:2].sum(), g, ok)
    torch.testing.assert_close(a3, a2)  # the constant head's ŵ = 0
    assert bool(torch.isfinite(a3).all())
    closed = sum(w3[k] * (const[:, k] - _group_mean(const[:, k], g)) for k in range(3)) / sum(
        w3[k] * _group_pop_std(const[:, k], g) for k in range(3)
    )
    torch.testing.assert_close(a3, closed)
    all_const = torch.ones(len(g), 2, dtype=torch.float64)
    a0, _ = dvao_combine(all_const, torch.tensor([0.5, 0.5], dtype=torch.float64), g, ok)
    assert torch.equal(a0, torch.zeros(len(g), dtype=torch.float64))


def _group_mean(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return torch.stack([x[g == k].mean() for k in g.tolist()])


def _group_pop_std(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return torch.stack([x[g == k].std(unbiased=False) for k in g.tolist()])


def test_dvao_finite_differences_match_proposition_3() -> None:
    r, g = _heads_batch(9, n_groups=2, size=5, heads=3)
    r = r + 1e-3 * torch.arange(r.numel(), dtype=torch.float64).reshape(r.shape)  # no ties, every σ > 0
    w = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    ok = torch.ones(len(g), dtype=torch.bool)
    big_g = 5
    a, _ = dvao_combine(r, w, g, ok)
    mu, sd = (
        torch.stack([_group_mean(r[:, k], g) for k in range(3)], 1),
        torch.stack([_group_pop_std(r[:, k], g) for k in range(3)], 1),
    )
    a_k = (r - mu) / sd
    s = (w * sd).sum(1)
    h = 1e-6
    for i in (0, 3, 7):
        for k in range(3):
            up, down = r.clone(), r.clone()
            up[i, k] += h
            down[i, k] -= h
            fd = (dvao_combine(up, w, g, ok)[0][i] - dvao_combine(down, w, g, ok)[0][i]) / (2 * h)
            w_tilde = w[k] * sd[i, k] / s[i]
            want = w_tilde / sd[i, k] * (1 - 1 / big_g - a[i] * a_k[i, k] / big_g)
            assert float(fd) == pytest.approx(float(want), rel=1e-5, abs=1e-8), (i, k)


def test_dvao_heads_from_the_matrix_weights_and_missing_domains() -> None:
    r, g = _heads_batch(6, n_groups=4, size=4, heads=2)
    heads = r.float().clone()
    heads[g >= 2] = float("nan")  # prompts 2, 3 come from a domain without these heads
    scalar = torch.rand(16, generator=_gen(1))
    adv = dvao(scalar, g, reward_heads=heads, head_names=["acc", "fmt"], weights={"acc": 3, "fmt": 1})
    a, _ = dvao_combine(
        r[g < 2], torch.tensor([0.75, 0.25], dtype=torch.float64), g[g < 2], torch.ones(8, dtype=torch.bool)
    )
    torch.testing.assert_close(adv[g < 2], a.float())
    torch.testing.assert_close(adv[g >= 2], _pop_grpo(scalar[g >= 2], g[g >= 2]).float(), atol=1e-5, rtol=1e-5)
    scaled = dvao(scalar, g, reward_heads=heads, head_names=["acc", "fmt"], weights={"acc": 0.3, "fmt": 0.1})
    torch.testing.assert_close(scaled, adv)  # only the ratio of the initial weights matters
    with pytest.raises(ValueError, match="weights"):
        dvao(scalar, g, weights={"acc": -1.0})


# ============================================================================ PAPO


def test_papo_fewer_than_two_correct_is_grpo() -> None:
    out = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    proc = torch.tensor([0.5, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0])  # group 1 has none correct
    g = _groups(2, 4)
    adv = papo(out, g, reward_heads=proc[:, None], head_names=["rubric"])
    torch.testing.assert_close(adv, _pop_grpo(out, g).float())


def test_papo_process_part_is_zero_for_wrong_and_standardised_over_the_correct() -> None:
    gen = _gen(13)
    for seed in range(50):
        out = (torch.rand(8, generator=gen) < 0.6).float()
        proc = torch.tensor([0.0, 0.5, 1.0])[torch.randint(0, 3, (8,), generator=gen)]
        g = torch.zeros(8, dtype=torch.long)
        total = papo(out, g, reward_heads=proc[:, None], head_names=["rubric"]).double()
        a_out = _pop_grpo(out, g, eps=1e-6)
        a_proc = total - a_out
        wrong = out == 0
        torch.testing.assert_close(a_proc[wrong], torch.zeros(int(wrong.sum()), dtype=torch.float64), atol=1e-6, rtol=0)
        c = ~wrong
        if int(c.sum()) >= 2 and float(proc[c].std(unbiased=False)) > 0:
            assert float(a_proc[c].sum()) == pytest.approx(0.0, abs=1e-5), seed
            assert float(a_proc[c].std(unbiased=False)) == pytest.approx(1.0, abs=1e-5), seed


def test_papo_all_correct_group_learns_from_the_rubric() -> None:
    out = torch.ones(4)
    proc = torch.tensor([1.0, 1.0, 0.5, 0.0])
    adv = papo(out, torch.zeros(4, dtype=torch.long), reward_heads=proc[:, None], head_names=["rubric"])
    assert bool(torch.isfinite(adv).all())
    want = (proc - proc.mean()) / proc.std(unbiased=False)  # A_out = 0 (max(σ, ε) guard), A = A_proc
    torch.testing.assert_close(adv, want)
    assert bool((adv != 0).all())
    plain = grpo(out, torch.zeros(4, dtype=torch.long))  # the outcome alone has no signal here
    assert torch.equal(plain, torch.zeros(4))


def test_papo_mixed_group_signs() -> None:
    out = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    proc = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0])  # a wrong answer's rubric score is ignored
    g = torch.zeros(6, dtype=torch.long)
    adv = papo(out, g, reward_heads=proc[:, None], head_names=["rubric"]).double()
    a_out = _pop_grpo(out, g)
    assert bool((a_out[out == 1] > 0).all())
    assert torch.equal(adv[out == 0], a_out[out == 0].float().double())  # wrong: exactly A_out
    assert float(adv[1]) < 0  # a correct answer below zero only through its poor process score
    # outcome from a head, process head under another name; a correct sample without a score is left out of C
    heads = torch.stack([out, proc], 1)
    named = papo(
        torch.zeros(6),
        g,
        reward_heads=heads,
        head_names=["correct", "steps"],
        outcome_head="correct",
        process_head="steps",
    )
    torch.testing.assert_close(named, adv.float())
    holes = heads.clone()
    holes[0, 1] = float("nan")
    left_out = papo(
        torch.zeros(6),
        g,
        reward_heads=holes,
        head_names=["correct", "steps"],
        outcome_head="correct",
        process_head="steps",
    )
    torch.testing.assert_close(left_out[0], a_out[0].float())
    c = torch.tensor([1, 2, 5])
    want = (proc[c] - proc[c].mean()) / proc[c].std(unbiased=False) + a_out[c].float()
    torch.testing.assert_close(left_out[c], want)


# ============================================================================ ALP


def test_alp_beta_zero_is_the_accuracy_reward() -> None:
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    lengths = torch.tensor([10, 200, 30, 4000])
    out = alp(r, torch.zeros(4, dtype=torch.long), lengths=lengths, beta=0.0)
    assert torch.equal(out, r)
    torch.testing.assert_close(grpo(out, torch.zeros(4, dtype=torch.long)), grpo(r, torch.zeros(4, dtype=torch.long)))


def test_alp_penalty_floor_and_all_correct() -> None:
    beta = 1e-3
    lengths = torch.arange(1, 17) * 10
    g = torch.zeros(16, dtype=torch.long)
    wrong = alp(torch.zeros(16), g, lengths=lengths, beta=beta)
    torch.testing.assert_close(-wrong, beta * lengths.float() / 16)  # floored at 1/K, not 0
    right = alp(torch.ones(16), g, lengths=lengths, beta=beta)
    torch.testing.assert_close(1 - right, beta * lengths.float() * 1.0)


def test_alp_penalty_is_linear_in_length_and_grows_with_the_solve_rate() -> None:
    beta = 1e-2
    k = 8
    n = torch.tensor([5, 9, 13, 40, 2, 70, 11, 30])
    for solved in range(k + 1):
        r = torch.tensor([1.0] * solved + [0.0] * (k - solved))
        pen = (r - alp(r, torch.zeros(k, dtype=torch.long), lengths=n, beta=beta)).double()
        coef = pen / n.double()
        torch.testing.assert_close(coef, coef[:1].expand(k))  # one coefficient per group
    same_n = torch.full((k * (k + 1),), 17)
    groups = _groups(k + 1, k)
    r = torch.cat([torch.tensor([1.0] * s + [0.0] * (k - s)) for s in range(k + 1)])
    pen = (r - alp(r, groups, lengths=same_n, beta=beta)).reshape(k + 1, k)[:, 0]
    assert bool((pen[1:] >= pen[:-1]).all()) and float(pen[-1]) > float(pen[0])


def test_alp_with_grpo_ranks_an_all_correct_group_by_length() -> None:
    lengths = torch.tensor([120, 40, 300, 80, 41, 7])
    g = torch.zeros(6, dtype=torch.long)
    adv = grpo(alp(torch.ones(6), g, lengths=lengths, beta=1e-3), g)
    order = torch.argsort(lengths)
    assert bool((adv[order][1:] < adv[order][:-1]).all())  # strictly: shorter, higher


def test_alp_uses_a_correctness_head_and_its_threshold() -> None:
    heads = torch.tensor([[1.0], [0.0], [float("nan")], [1.0]])
    r = torch.tensor([0.9, 0.2, 0.5, 0.6])  # e.g. accuracy + format, weighted
    out = alp(
        r,
        torch.zeros(4, dtype=torch.long),
        lengths=torch.full((4,), 100),
        reward_heads=heads,
        head_names=["correct"],
        correct_head="correct",
        beta=1e-3,
    )
    torch.testing.assert_close(r - out, torch.full((4,), 1e-3 * 100 * 0.5))  # two of four solved


# ============================================================================ CGPO


def test_cgpo_a_violated_judge_zeroes_the_reward() -> None:
    gen = _gen(17)
    for seed in range(30):
        n = 12
        r = torch.randn(n, generator=gen) + 2
        heads = (torch.rand(n, 3, generator=gen) > 0.3).float()
        heads[torch.rand(n, 3, generator=gen) < 0.2] = float("nan")  # that judge does not apply
        g = _groups(3, 4)
        for calibrate in (False, True):
            out = cgpo_judges(
                r,
                g,
                reward_heads=heads,
                head_names=["fmt", "safe", "style"],
                judges=["fmt", "safe"],
                calibrate=calibrate,
            )
            bad = (heads[:, :2] == 0).any(1)
            assert bool((out[bad] == 0).all()), seed
            if not calibrate:
                assert torch.equal(out[~bad], r[~bad])
            else:
                assert bool((out[~bad] > 0).all())
    # the judge decides before the advantage: a violating best answer gets the group's lowest advantage
    r = torch.tensor([5.0, 1.0, 2.0, 3.0])
    heads = torch.tensor([[0.0], [1.0], [1.0], [1.0]])
    out = cgpo_judges(r, torch.zeros(4, dtype=torch.long), reward_heads=heads, head_names=["safe"], judges=["safe"])
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="judges"):
        cgpo_judges(r, torch.zeros(4, dtype=torch.long), judges=[])


@pytest.mark.parametrize("threshold", [0.5, 0.7, 0.1, 1.0, 3.3])
def test_cgpo_a_judge_score_exactly_at_the_threshold_passes(threshold: float) -> None:
    """A judge passes when its score is >= pass_threshold: exactly at it the reward is kept (calibrated
    or not), one float32 step below it is zeroed. The scores come the learner's way (Sample.reward_heads
    through the sequence view's float32 head matrix), where 0.7 is 0.69999999 and must still pass 0.7."""
    below = float(torch.nextafter(torch.tensor(threshold), torch.tensor(-math.inf)))
    scores = [threshold, below, threshold, 2 * threshold + 1]
    samples = [
        Sample(
            Prompt(index=0, text="p", ids=[1]),
            group=0,
            response_ids=[2],
            rollout_logp=[-1.0],
            policy_version=0,
            finish_reason="stop",
            reward=float(i + 2),
            reward_heads={"safe": sc},
        )
        for i, sc in enumerate(scores)
    ]
    view = sequence_view(samples)
    for calibrate in (False, True):
        out = cgpo_judges(
            view.rewards,
            view.group_ids,
            reward_heads=view.reward_heads,
            head_names=view.head_names,
            judges=["safe"],
            pass_threshold=threshold,
            calibrate=calibrate,
        )
        passed = (out != 0).tolist()
        assert passed == [True, False, True, True], (calibrate, out.tolist())
        if not calibrate:
            assert out.tolist() == [2.0, 0.0, 4.0, 5.0]
    exact = torch.tensor([[threshold], [threshold]], dtype=torch.float64)  # float64 heads: exact too
    assert cgpo_judges(
        torch.tensor([1.0, 2.0]),
        torch.zeros(2, dtype=torch.long),
        reward_heads=exact,
        head_names=["safe"],
        judges=["safe"],
        pass_threshold=threshold,
    ).tolist() == [1.0, 2.0]


def test_cgpo_calibrated_reward_is_in_the_unit_interval_and_half_at_the_reference() -> None:
    gen = _gen(19)
    a, ref = torch.rand(50, generator=gen) * 10 - 5, torch.rand(50, generator=gen) * 10 - 5
    cal = calibrated(a, ref)
    assert bool(((cal > 0) & (cal < 1)).all())
    assert torch.equal(calibrated(a, a), torch.full((50,), 0.5))
    heads = torch.stack([torch.ones(4), torch.tensor([0.3, 0.1, 0.2, 0.3])], 1)
    r = torch.tensor([0.3, 0.5, 0.0, 1.0])
    out = cgpo_judges(
        r,
        torch.zeros(4, dtype=torch.long),
        reward_heads=heads,
        head_names=["ok", "ref"],
        judges=["ok"],
        calibrate=True,
        reference_head="ref",
    )
    assert float(out[0]) == 0.5 and bool(((out > 0) & (out < 1)).all())
    to_mean = cgpo_judges(
        r, torch.zeros(4, dtype=torch.long), reward_heads=heads, head_names=["ok", "ref"], judges=["ok"], calibrate=True
    )
    torch.testing.assert_close(to_mean, torch.sigmoid(r - r.mean()))  # ā: the group's average response


def test_codpo_pairs_best_passing_against_worst_failing() -> None:
    scores = torch.tensor([0.9, 0.2, 0.5, 0.1, 0.7, 0.3, 0.8, 0.6, 0.4])
    passed = torch.tensor([True, False, True, False, False, True, True, True, True])
    g = torch.tensor([2, 2, 2, 2, 5, 5, 9, 9, 9])
    chosen, rejected = codpo_pairs(scores, passed, g)
    assert chosen.tolist() == [0, 5, 6] and rejected.tolist() == [3, 4, -1]  # group 9: nothing failed
    valid = torch.ones(9, dtype=torch.bool)
    valid[0] = False
    chosen, _ = codpo_pairs(scores, passed, g, valid)
    assert chosen.tolist()[0] == 2


def test_cgpo_task_weights_combine_the_gradients_and_zero_removes_a_task() -> None:
    """One SGD step of the clipped policy loss with advantages scaled per domain is
    w_{t+1} − w_t = α Σ_l ρ_l ḡ_l, and ρ_l = 0 makes task l's samples irrelevant."""
    gen = _gen(23)
    n, t, v, d = 6, 5, 7, 4
    x = torch.randn(n, t, d, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, v, (n, t), generator=gen)
    mask = (torch.rand(n, t, generator=gen) > 0.2).double()
    w0 = torch.randn(d, v, generator=gen, dtype=torch.float64)
    old = torch.log_softmax(x @ (w0 + 0.3 * torch.randn(d, v, generator=gen, dtype=torch.float64)), -1)
    old = old.gather(-1, tokens[..., None])[..., 0]  # π_old ≠ π_θ: some ratios are clipped
    domains = torch.tensor([0, 0, 1, 1, 2, 2])
    names = ["code", "chat", "math"]
    adv = torch.randn(n, generator=gen, dtype=torch.float64)

    def grad(advantages: torch.Tensor) -> torch.Tensor:
        w = w0.clone().requires_grad_(True)
        logp = torch.log_softmax(x @ w, -1).gather(-1, tokens[..., None])[..., 0]
        out = ppo_clip(logp, old, advantages, mask, clip_low=0.2, clip_high=0.28)
        (g,) = torch.autograd.grad(out.loss_sum / mask.sum(), w)
        return -g  # ascent direction ḡ

    rho = {"code": 0.5, "chat": 2.0, "math": 0.0}
    lr = 0.1
    base = grad(weight_domains(adv, domains, names, rho))
    step = lr * base
    per_task = [grad(torch.where(domains == i, adv, torch.zeros(()))) for i in range(3)]
    combined = lr * sum(rho[name] * per_task[i] for i, name in enumerate(names))
    torch.testing.assert_close(step, combined, rtol=1e-10, atol=1e-12)
    other = adv.clone()
    other[domains == 2] = torch.randn(2, generator=gen, dtype=torch.float64) * 100
    assert torch.equal(grad(weight_domains(other, domains, names, rho)), base)
    assert torch.equal(weight_domains(adv, domains, names, {}), adv)
    assert torch.equal(weight_domains(adv, domains, names, {"nowhere": 3.0}), adv)


# ============================================================================ the kinds and the learner's inputs


def test_every_advantage_takes_domains_and_heads_and_the_old_ones_ignore_them() -> None:
    gen = _gen(29)
    r = torch.rand(12, generator=gen)
    g = _groups(3, 4)
    heads = torch.rand(12, 2, generator=gen)
    extra = dict(domain_ids=torch.tensor([0] * 4 + [1] * 8), reward_heads=heads, head_names=["a", "b"])
    valid = torch.ones(12, dtype=torch.bool)
    for name in algos.names("advantage"):
        fn = algos.get("advantage", name)
        critic = {"values": ValueBatch(torch.rand(12, 3, generator=gen), torch.ones(12, 3))} if takes_values(fn) else {}
        adv = fn(r, g, normalize_std=True, valid=valid, **extra, **critic)
        shape = (12, 3) if name == "gae" else (12,)  # gae: per token
        assert adv.shape == shape and adv.dtype == torch.float32 and bool(torch.isfinite(adv).all()), name
        if name in ("grpo", "dr_grpo", "rloo"):
            assert torch.equal(adv, fn(r, g, normalize_std=True, valid=valid)), name
    needed = {  # options without a default
        "cgpo_judges": {"judges": ["a"]},
        "encore": {"heads": ["a", "b"]},
        "rluf": {"weights": {"a": 0.7, "b": 0.3}},
    }
    for name in algos.names("reward_shaping"):
        fn = algos.get("reward_shaping", name)
        out = fn(
            r,
            g,
            valid=valid,
            lengths=torch.full((12,), 3),
            seq_logp=-torch.rand(12, generator=gen) * 5,
            **extra,
            **needed.get(name, {}),
        )
        assert out.shape == (12,) and out.dtype == torch.float32 and bool(torch.isfinite(out).all()), name
    assert {"alp", "cgpo_judges"} <= set(algos.names("reward_shaping"))
    assert {"golongrl", "dvao", "papo"} <= set(algos.names("advantage"))


def _sample(domain: str, group: int, reward: float, heads: dict[str, float], n_tokens: int = 3) -> Sample:
    p = Prompt(index=group, text="q", ids=[1, 2], domain=domain)
    return Sample(
        p,
        group,
        list(range(3, 3 + n_tokens)),
        [-0.5] * n_tokens,
        policy_version=0,
        finish_reason="stop",
        reward=reward,
        reward_heads=heads,
    )


def test_sequence_view_carries_domain_ids_and_the_head_matrix() -> None:
    samples = [
        _sample("math", 0, 1.0, {"correct": 1.0}),
        _sample("code", 1, 0.5, {"tests": 0.5, "format": 1.0}),
        _sample("math", 0, 0.0, {"correct": 0.0}),
        _sample("chat", 2, 0.2, {}),
    ]
    view = sequence_view(samples)
    assert view.domain_names == ["chat", "code", "math"]
    assert view.domain_ids.tolist() == [2, 1, 2, 0]
    assert view.head_names == ["correct", "format", "tests"]
    assert view.reward_heads.shape == (4, 3)
    nan = float("nan")
    torch.testing.assert_close(
        view.reward_heads,
        torch.tensor([[1.0, nan, nan], [nan, 1.0, 0.5], [0.0, nan, nan], [nan, nan, nan]]),
        equal_nan=True,
    )
    plain = sequence_view([_sample("", 0, 1.0, {})])
    assert plain.domain_names == [""] and plain.reward_heads.shape == (1, 0)


def test_restrict_to_domains_and_domain_metrics() -> None:
    old, new = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([9.0, 8.0, 7.0])
    ids, names = torch.tensor([0, 1, 0]), ["chat", "math"]
    assert restrict_to_domains(new, old, ids, names, []).tolist() == [9, 8, 7]
    assert restrict_to_domains(new, old, ids, names, ["math"]).tolist() == [1, 8, 3]
    assert restrict_to_domains(new, old, ids, names, ["code"]).tolist() == [1, 2, 3]  # not in this batch
    adv = torch.tensor([0.5, -1.0, 0.0, 2.0])
    m = domain_metrics(
        adv,
        torch.tensor([1.0, 0.0, 0.5, 1.0]),
        torch.tensor([True, True, True, False]),
        torch.tensor([0, 1, 0, 1]),
        ["chat", "math"],
    )
    assert m["advantage/chat/samples"] == 2 and m["advantage/chat/mean"] == 0.25
    assert m["advantage/chat/zero_frac"] == 0.5 and m["advantage/math/abs_mean"] == 1.0
    assert m["advantage/math/reward_mean"] == 0.0  # the invalid sample counts nowhere


def test_option_problems_name_the_option() -> None:
    assert option_problems("advantage", "golongrl", {"alpha": 0.5}) == []
    assert option_problems("advantage", "grpo", {"eps": 1e-8}) == []
    ((key, msg),) = option_problems("advantage", "golongrl", {"alfa": 0.5})
    assert key == "alfa" and "alpha, delta, difficulty_reweight" in msg
    ((key, msg),) = option_problems("advantage", "golongrl", {"alpha": 1.5})
    assert key == "alpha" and "[0, 1]" in msg
    ((key, msg),) = option_problems("advantage", "golongrl", {"difficulty_reweight": "yes"})
    assert key == "difficulty_reweight" and "bool" in msg
    assert option_problems("advantage", "golongrl", {"alpha": 1})[0:] == []  # an int is a float
    ((key, _),) = option_problems("reward_shaping", "cgpo_judges", {})
    assert key == "judges"
    ((key, msg),) = option_problems("advantage", "grpo", {"valid": None})
    assert key == "valid" and "not an option" in msg  # the learner's inputs are not options


TINY = [
    "model.hidden_size=32",
    "model.ffn_hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.max_position_embeddings=64",
    "train.seq_length=32",
    "data.synthetic_max_digits=1",
    "rollout.group_size=4",
    "rollout.prompts_per_step=4",
    "rollout.max_new_tokens=4",
    "rollout.context_length=64",
]

EXAMPLE_YAML = """
algorithm:
  advantage: golongrl
  advantage_options: {alpha: 0.8, delta: 1.0e-6}
  reward_shaping:
    - name: cgpo_judges
      domains: [chat]
      options: {judges: [safe, format_ok], calibrate: true}
    - name: alp
      domains: [math]
      options: {beta: 1.0e-3, correct_head: correct}
  domain_advantage_weights: {math: 1.0, chat: 0.5}
"""


def test_config_keys_load_from_yaml_and_bad_values_name_their_key(tmp_path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(EXAMPLE_YAML)
    cfg = load_config(RLConfig, str(path), TINY)
    validate_rl_config(cfg, 1)
    a = cfg.algorithm
    assert a.advantage_options == {"alpha": 0.8, "delta": 1e-6}
    assert [s.name for s in a.reward_shaping] == ["cgpo_judges", "alp"] and a.reward_shaping[1].domains == ["math"]
    assert a.domain_advantage_weights == {"math": 1.0, "chat": 0.5}
    bad = [
        ("algorithm.advantage_options={alpha: 2}", "algorithm.advantage_options.alpha: must be in [0, 1]"),
        ("algorithm.advantage_options={gamma: 2}", "algorithm.advantage_options.gamma: is not an option"),
        (
            "algorithm.reward_shaping=[{name: lenpen}]",
            "algorithm.reward_shaping[0].name: unknown reward shaping 'lenpen'",
        ),
        ("algorithm.reward_shaping=[{name: cgpo_judges}]", "algorithm.reward_shaping[0].options.judges: must list"),
        (
            "algorithm.reward_shaping=[{name: alp, options: {beta: -1}}]",
            "algorithm.reward_shaping[0].options.beta: must be >= 0",
        ),
        (
            "algorithm.reward_shaping=[{name: alp, domains: [math, math]}]",
            "algorithm.reward_shaping[0].domains: lists a domain twice",
        ),
        (
            "algorithm.domain_advantage_weights={math: -0.5}",
            "algorithm.domain_advantage_weights.math: must be a number >= 0",
        ),
        (
            "algorithm.domain_advantage_weights={math: high}",
            "algorithm.domain_advantage_weights.math: must be a number",
        ),
    ]
    for override, message in bad:
        cfg = load_config(RLConfig, None, TINY + ["algorithm.advantage=golongrl", override])
        with pytest.raises(ConfigError, match=_literal(message)):
            validate_rl_config(cfg, 1)
    with pytest.raises(
        ConfigError, match=_literal("rollout.group_size: is 1, but the group-relative advantage 'papo'")
    ):
        validate_rl_config(load_config(RLConfig, None, TINY + ["algorithm.advantage=papo", "rollout.group_size=1"]), 1)


def _literal(text: str) -> str:
    import re

    return re.escape(text)


def test_a_registration_without_the_kinds_signature_fails_validation() -> None:
    from mcore_rl.algos import registry

    registry.register("advantage", "two_args_only")(lambda rewards, group_ids: rewards)
    try:
        ((key, msg),) = option_problems("advantage", "two_args_only", {})
        assert key == "" and "unexpected keyword argument" in msg
    finally:
        del registry._TABLES["advantage"]["two_args_only"]
