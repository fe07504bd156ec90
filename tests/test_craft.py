"""RLUF's CRAFT (CGPO's CRRAFT) as the advantage "craft": best-of-N of the combined reward per group,
judges' violations never kept, reward-weighted SFT through the "reinforce" policy loss, its options
checked before workers start."""

from __future__ import annotations

import pytest
import torch

from mcore_rl.algos import registry
from mcore_rl.algos.cgpo import cgpo_judges
from mcore_rl.algos.craft import best_of_n, craft
from mcore_rl.algos.multi_reward import option_problems
from mcore_rl.algos.policy_loss import reinforce
from mcore_rl.algos.rluf import rluf

GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])


def test_best_of_4_picks_the_argmax_of_the_combined_reward():
    """RLUF's property 3: with the helpfulness / safety / Love RMs combined (0.7 / 0.3 / 0.1), each
    group of 4 keeps exactly its argmax; the advantage is that reward, every other sample's 0."""
    torch.manual_seed(0)
    heads = torch.randn(8, 3, dtype=torch.float64)
    names = ["helpful", "safe", "love"]
    weights = {"helpful": 0.7, "safe": 0.3, "love": 0.1}
    combined = rluf(torch.zeros(8), GROUPS, reward_heads=heads, head_names=names, weights=weights)
    expected = heads @ torch.tensor([0.7, 0.3, 0.1], dtype=torch.float64)
    assert torch.allclose(combined.double(), expected, atol=1e-6)
    # a positive reward (calibrated, as CRRAFT trains), so every group has a sample above min_reward
    reward = torch.sigmoid(combined)
    adv = craft(reward, GROUPS)
    for g in (0, 1):
        idx = (GROUPS == g).nonzero().flatten()
        best = int(idx[torch.argmax(reward[idx])])
        assert adv[best] == pytest.approx(float(reward[best]))
        assert int((adv[idx] != 0).sum()) == 1
    assert registry.get("advantage", "craft") is craft


def test_judges_violations_are_never_kept_and_ties_go_to_the_first_drawn():
    """After `cgpo_judges` (calibrated), a violation is exactly 0 and is never the best of its group
    even when its reward model scored it highest; a group where all fail trains nothing."""
    rm = torch.tensor([5.0, 1.0, 2.0, 0.5, 3.0, 3.0, 3.0, 3.0])
    judge = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])  # sample 0 and group 1: all fail
    shaped = cgpo_judges(
        rm, GROUPS, reward_heads=judge[:, None], head_names=["format"], judges=["format"], calibrate=True
    )
    assert shaped[0] == 0 and bool((shaped[4:] == 0).all()) and bool((shaped[1:4] > 0).all())
    adv = craft(shaped, GROUPS)
    assert adv.nonzero().flatten().tolist() == [2]  # the best feasible sample, not the RM's favourite
    assert 0 < float(adv[2]) < 1  # weighted by the calibrated reward σ(r − r̄)
    # ties: the first drawn; keep=k the top k; unweighted: A = 1; invalid samples never kept
    tie = torch.tensor([0.4, 0.7, 0.7, 0.1, 0.2, 0.2, 0.9, 0.2])
    assert craft(tie, GROUPS).nonzero().flatten().tolist() == [1, 6]
    assert craft(tie, GROUPS, keep=2, weighted=False).tolist() == [0, 1, 1, 0, 1, 0, 1, 0]
    valid = torch.tensor([True, False, True, True, True, True, False, True])
    assert craft(tie, GROUPS, valid=valid).nonzero().flatten().tolist() == [2, 4]
    assert best_of_n(tie, GROUPS, torch.ones(8, dtype=torch.bool), keep=9).all()
    assert craft(tie, GROUPS, min_reward=0.5).nonzero().flatten().tolist() == [1, 6]
    assert craft(tie, GROUPS, min_reward=0.95).abs().sum() == 0


def test_with_the_reinforce_loss_it_is_reward_weighted_sft_on_the_best():
    """The gradient of the policy loss "reinforce" with CRAFT's advantages equals the gradient of
    −Σ_best R·Σ_t log π(y_t) (reward-weighted SFT on the kept samples), the loss
    summed over each sequence's tokens (`seq-mean-token-sum`'s sum)."""
    torch.manual_seed(1)
    logits = torch.randn(8, 5, 11, requires_grad=True)
    targets = torch.randint(0, 11, (8, 5))
    mask = torch.ones(8, 5)
    mask[3, 3:] = 0
    reward = torch.rand(8)
    adv = craft(reward, GROUPS)
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    out = reinforce(logp, logp.detach(), adv, mask, agg="seq-mean-token-sum")
    (grad,) = torch.autograd.grad(out.loss_sum, logits, retain_graph=True)
    best = adv != 0
    sft = -(reward[best][:, None] * logp[best] * mask[best]).sum()
    (want,) = torch.autograd.grad(sft, logits)
    assert torch.allclose(grad, want, atol=1e-6)
    assert grad[~best].abs().sum() == 0  # the samples not kept do not move the policy


def test_options_are_checked_before_workers_start():
    assert option_problems("advantage", "craft", {"keep": 2, "weighted": False}) == []
    assert option_problems("advantage", "craft", {"keep": 0})[0][0] == "keep"
    assert option_problems("advantage", "craft", {"top": 1})[0][0] == "top"


def test_a_recipe_with_craft_validates_and_a_bad_option_is_named():
    import pathlib

    from mcore_rl.config import ConfigError, RLConfig, load_config, validate_rl_config

    demo = str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")

    recipe = ["algorithm.advantage=craft", "algorithm.policy_loss=reinforce", "algorithm.kl_coef=0.05"]
    validate_rl_config(load_config(RLConfig, demo, [*recipe, "algorithm.advantage_options={keep: 1}"]), 1)
    bad = load_config(RLConfig, demo, [*recipe, "algorithm.advantage_options={keep: 0}"])
    with pytest.raises(ConfigError, match=r"algorithm.advantage_options.keep: must be an integer >= 1"):
        validate_rl_config(bad, 1)
