"""Group advantages (GRPO, Dr.GRPO, RLOO), dynamic sampling and the registry."""

from __future__ import annotations

import pytest
import torch

from mcore_rl import algos
from mcore_rl.algos.advantages import dr_grpo, grpo, make_group_ids, rloo, to_tokens, too_few_valid_frac
from mcore_rl.algos.critic import ValueBatch, takes_values
from mcore_rl.algos.dynamic_sampling import nonzero_std_groups

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 1.0, 1.0, 0.25, 0.75])
GROUPS = torch.tensor([7, 7, 7, 7, 3, 3, 3, 9, 9, 42, 42])  # unsorted labels, unequal sizes


def test_grpo_zero_mean_unit_std_per_group() -> None:
    adv = grpo(REWARDS, GROUPS)
    for g in GROUPS.unique():
        a = adv[GROUPS == g]
        assert abs(float(a.mean())) < 1e-6
        if float(REWARDS[GROUPS == g].std()) > 0:
            assert float(a.std()) == pytest.approx(1.0, abs=1e-4)  # Bessel std, as computed
    assert torch.equal(adv[GROUPS == 9], torch.zeros(2))  # constant group: no signal
    torch.testing.assert_close(adv[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 / (1 / 3) ** 0.5, atol=1e-5, rtol=0)


def test_grpo_without_std_and_dr_grpo_are_centered_rewards() -> None:
    want = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, -0.5, 0.5, 0.0, 0.0, -0.25, 0.25])
    torch.testing.assert_close(grpo(REWARDS, GROUPS, normalize_std=False), want)
    torch.testing.assert_close(dr_grpo(REWARDS, GROUPS), want)


def test_rloo_is_leave_one_out() -> None:
    adv = rloo(REWARDS, GROUPS)
    for i in range(len(REWARDS)):
        others = [float(REWARDS[j]) for j in range(len(REWARDS)) if j != i and GROUPS[j] == GROUPS[i]]
        assert float(adv[i]) == pytest.approx(float(REWARDS[i]) - sum(others) / len(others), abs=1e-6)


def test_singletons_get_zero_and_shapes_are_checked() -> None:
    r, g = torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1])
    for fn in (grpo, dr_grpo, rloo):
        assert float(fn(r, g)[2]) == 0.0
    with pytest.raises(ValueError):
        grpo(r, torch.tensor([0, 0]))


def test_group_ids_and_token_broadcast() -> None:
    assert make_group_ids(2, 3).tolist() == [0, 0, 0, 1, 1, 1]
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert to_tokens(torch.tensor([2.0, -1.0]), mask).tolist() == [[2, 2, 0], [-1, 0, 0]]


def test_registry_lookup_and_error_lists_names() -> None:
    assert algos.get("advantage", "rloo") is rloo
    with pytest.raises(KeyError, match="dr_grpo, dvao, gae, gagpo, gigpo, golongrl, grpo, hgpo, papo, rloo, steppo"):
        algos.get("advantage", "nope")
    with pytest.raises(KeyError, match="kinds: "):
        algos.get("nope", "grpo")
    with pytest.raises(ValueError, match="already registered"):
        algos.register("advantage", "grpo")(lambda r, g: r)
    assert {"ppo_clip", "gspo"} <= set(algos.names("policy_loss"))
    assert {"tis", "icepop", "mis", "seq_mask_tis", "none"} <= set(algos.names("mismatch"))


# ---------------------------------------------------------------------------- validity mask

ESTIMATORS = {
    "grpo": lambda r, g, **kw: grpo(r, g, **kw),
    "grpo_mean_only": lambda r, g, **kw: grpo(r, g, normalize_std=False, **kw),
    "dr_grpo": lambda r, g, **kw: dr_grpo(r, g, **kw),
    "rloo": lambda r, g, **kw: rloo(r, g, **kw),
}


def _random_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 24, (1,), generator=g))
    groups = torch.randint(0, 6, (n,), generator=g) * 7 - 3  # unsorted, negative, gaps
    rewards = torch.where(
        torch.rand(n, generator=g) < 0.5, torch.randint(0, 2, (n,), generator=g).float(), torch.randn(n, generator=g)
    )
    valid = torch.rand(n, generator=g) < 0.7
    return rewards, groups, valid


def test_failed_samples_leave_the_group_statistics() -> None:
    """The issue's group: two right answers and two whose reward failed (scored 0)."""
    rewards, groups = torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long)
    ok = torch.tensor([True, True, False, False])
    torch.testing.assert_close(grpo(rewards, groups), torch.tensor([0.866, 0.866, -0.866, -0.866]), atol=1e-3, rtol=0)
    for name, fn in ESTIMATORS.items():
        assert fn(rewards, groups, valid=ok).tolist() == [0.0] * 4, name  # the two valid ones are equal: no signal
    mixed = torch.tensor([1.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(
        grpo(mixed, groups, valid=ok), torch.tensor([0.7071, -0.7071, 0.0, 0.0]), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_masked_advantages_equal_those_of_the_valid_samples_alone(name: str) -> None:
    fn = ESTIMATORS[name]
    for seed in range(200):
        rewards, groups, valid = _random_batch(seed)
        adv = fn(rewards, groups, valid=valid)
        assert adv.dtype == torch.float32 and adv.shape == rewards.shape
        assert torch.all(adv[~valid] == 0), seed
        if valid.any():
            torch.testing.assert_close(adv[valid], fn(rewards[valid], groups[valid]), atol=1e-5, rtol=1e-5)
        # what an invalid sample scored does not matter, not even NaN or inf
        junk = rewards.clone()
        junk[~valid] = torch.tensor([float("nan"), float("inf"), -1e9, 3.0]).repeat(len(rewards))[: int((~valid).sum())]
        assert torch.equal(fn(junk, groups, valid=valid), adv), seed
        assert torch.equal(fn(rewards, groups, valid=torch.ones_like(valid)), fn(rewards, groups)), seed


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_groups_with_fewer_than_two_valid_samples_get_zero(name: str) -> None:
    fn = ESTIMATORS[name]
    for seed in range(200):
        rewards, groups, valid = _random_batch(seed)
        adv = fn(rewards, groups, valid=valid)
        per_group = {int(g): int(valid[groups == g].sum()) for g in groups.unique()}
        for g, k in per_group.items():
            if k < 2:
                assert torch.all(adv[groups == g] == 0), (seed, g)
        want = sum(k < 2 for k in per_group.values()) / len(per_group)
        assert too_few_valid_frac(groups, valid) == pytest.approx(want), seed
    assert too_few_valid_frac(torch.tensor([], dtype=torch.long)) == 0.0
    assert too_few_valid_frac(torch.tensor([0, 0, 1])) == pytest.approx(0.5)  # a group of one has no baseline


def test_every_registered_advantage_takes_the_validity_mask() -> None:
    rewards, groups = torch.tensor([1.0, 0.0, 5.0, 0.0, 1.0]), torch.tensor([0, 0, 0, 1, 1])
    valid = torch.tensor([True, True, False, True, True])
    # ±1-style or best-of-N advantages without a group baseline; the critic's (gae, steppo: it is the baseline)
    no_baseline = {"w_reinforce", "craft", "gae", "steppo"}
    for name in algos.names("advantage"):
        fn = algos.get("advantage", name)
        critic = {"values": ValueBatch(torch.zeros(5, 1), torch.ones(5, 1))} if takes_values(fn) else {}
        adv = fn(rewards, groups, normalize_std=True, valid=valid, **critic)
        assert float(adv[2]) == 0.0, name
        if name not in no_baseline:
            assert float(adv[:2].sum()) == pytest.approx(0.0, abs=1e-6), name
    with pytest.raises(ValueError, match="valid"):
        grpo(rewards, groups, valid=valid[:3])


# ---------------------------------------------------------------------------- dynamic sampling


def test_nonzero_std_filter() -> None:
    keep = nonzero_std_groups(REWARDS, GROUPS)
    assert keep.tolist() == [True] * 7 + [False, False, True, True]
    assert not bool(nonzero_std_groups(torch.tensor([1.0]), torch.tensor([0]))[0])  # singleton


def test_zero_variance_tolerance_is_explicit_and_configurable() -> None:
    """[0.1, 0.1, 0.1] in float64 has a std of ~1.7e-17 (computed from sums): constant for the default tolerance, kept only
    with tol=0 (the old, accidental behaviour); the tolerance is a config key with a checked value."""
    from mcore_rl.algos.dynamic_sampling import DEFAULT_STD_TOLERANCE, is_constant
    from mcore_rl.config import validate_rl_config
    from mcore_rl.config.errors import ConfigError
    from tests.helpers import tiny

    from mcore_rl.algos.advantages import group_stats

    rewards = torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0, 1.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    assert 0 < float(group_stats(rewards, groups)[2][0].sqrt()) < 1e-15  # the group statistics' std: ~1.7e-17
    assert nonzero_std_groups(rewards, groups).tolist() == [False] * 3 + [True] * 3
    assert nonzero_std_groups(rewards, groups, tol=0.0).tolist() == [True] * 6
    assert is_constant(rewards[:3].tolist()) and not is_constant(rewards[:3].tolist(), tol=0.0)
    assert is_constant([0.5]) and not is_constant([0.5, 0.5 + 10 * DEFAULT_STD_TOLERANCE])
    cfg = tiny("algorithm.dynamic_sampling.enabled=true")
    assert cfg.algorithm.dynamic_sampling.std_tolerance == DEFAULT_STD_TOLERANCE
    validate_rl_config(cfg, 1)
    with pytest.raises(ConfigError, match="algorithm.dynamic_sampling.std_tolerance"):
        validate_rl_config(
            tiny("algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.std_tolerance=-1"), 1
        )
