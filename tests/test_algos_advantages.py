"""Group advantages (GRPO, Dr.GRPO, RLOO), dynamic sampling and the registry."""

from __future__ import annotations

import pytest
import torch

from mcore_rl import algos
from mcore_rl.algos.advantages import dr_grpo, grpo, make_group_ids, rloo, to_tokens
from mcore_rl.algos.dynamic_sampling import GroupRefill, nonzero_std_groups

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
    with pytest.raises(KeyError, match="dr_grpo, grpo, rloo"):
        algos.get("advantage", "nope")
    with pytest.raises(KeyError, match="kinds: "):
        algos.get("nope", "grpo")
    with pytest.raises(ValueError, match="already registered"):
        algos.register("advantage", "grpo")(lambda r, g: r)
    assert {"ppo_clip", "gspo"} <= set(algos.names("policy_loss"))
    assert {"tis", "icepop", "mis", "seq_mask_tis", "none"} <= set(algos.names("mismatch"))


# ---------------------------------------------------------------------------- dynamic sampling


def test_nonzero_std_filter() -> None:
    keep = nonzero_std_groups(REWARDS, GROUPS)
    assert keep.tolist() == [True] * 7 + [False, False, True, True]
    assert not bool(nonzero_std_groups(torch.tensor([1.0]), torch.tensor([0]))[0])  # singleton


def test_refill_collects_until_target_with_oversampling() -> None:
    refill: GroupRefill[str] = GroupRefill(target_groups=3, max_rounds=5)
    assert refill.prompts_to_request() == 3  # no keep rate seen yet
    kept = refill.add([["a1", "a2"], ["b1", "b2"], ["c1", "c2"]], [[1, 1], [0, 1], [0, 0]])
    assert kept == 1 and refill.needed == 2 and refill.keep_rate == pytest.approx(1 / 3)
    assert refill.prompts_to_request() == 6  # 2 needed / (1/3) kept
    refill.add([["d1", "d2"], ["e1", "e2"], ["f1", "f2"]], [[0, 1], [1, 0], [0.5, 0]])
    assert refill.done and refill.prompts_to_request() == 0
    assert refill.take() == [["b1", "b2"], ["d1", "d2"], ["e1", "e2"]]  # f dropped (no carry-over)
    assert refill.needed == 3 and refill.rounds == 0


def test_refill_carry_over_cap_and_exhaustion() -> None:
    refill: GroupRefill[int] = GroupRefill(target_groups=1, max_rounds=2, max_oversample=2.0, carry_over=True)
    refill.add([[1, 2], [3, 4]], [[0, 1], [1, 0]])
    assert refill.take() == [[1, 2]]
    assert refill.done  # [3, 4] was carried
    refill.take()
    refill.add([[5, 6]], [[1, 1]])
    assert refill.prompts_to_request() == 2  # keep rate 2/3 -> 1.5 -> 2, within the 2x cap
    refill.add([[7, 8]], [[0, 0]])
    assert refill.exhausted and not refill.done and refill.take() == []
    with pytest.raises(ValueError):
        refill.add([[1]], [[1.0, 2.0]])
