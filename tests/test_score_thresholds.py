"""Scores exactly at a configured threshold reach it, in every function that compares a reward or a
judge score with one (`mcore_rl.algos.thresholds`). The scores take the learner's way: a Python
float in `Sample.reward` / `Sample.reward_heads`, then the float32 sequence view, where 0.7 is
0.69999999 — each test below failed while its function compared with the float64 threshold."""

from __future__ import annotations

import math

import pytest
import torch

import mcore_rl.algos  # noqa: F401  (registrations)
from mcore_rl.algos.alp import alp
from mcore_rl.algos.distill.base import DistillBatch
from mcore_rl.algos.papo import papo
from mcore_rl.algos.polaris import pass_rates, rescue_plan
from mcore_rl.algos.prof_grpo import prof_grpo
from mcore_rl.algos.registry import get
from mcore_rl.algos.rlcer import rlcer
from mcore_rl.algos.thresholds import at_least
from mcore_rl.algos.unlikeliness import unlikeliness
from mcore_rl.algos.w_reinforce import w_reinforce
from mcore_rl.data.samples import Prompt, Sample
from mcore_rl.train.packing import SequenceView, sequence_view

T = 0.7  # not a float32 number: float32(0.7) < 0.7


def view(
    rewards: list[float], heads: list[dict[str, float]] | None = None, group: list[int] | None = None
) -> SequenceView:
    """The learner's float32 view of samples with these rewards and reward heads (one group by default)."""
    heads = heads or [{} for _ in rewards]
    group = group or [0] * len(rewards)
    return sequence_view(
        [
            Sample(
                Prompt(index=g, text=f"p{g}", ids=[1]),
                group=g,
                response_ids=[2, 3],
                rollout_logp=[-1.0, -1.0],
                policy_version=0,
                finish_reason="stop",
                reward=r,
                reward_heads=h,
            )
            for r, h, g in zip(rewards, heads, group)
        ]
    )


def test_the_view_keeps_scores_as_float32_so_the_threshold_is_not_a_float32_number() -> None:
    v = view([T], [{"h": T}])
    assert v.rewards.dtype == torch.float32 and v.reward_heads.dtype == torch.float32
    assert float(v.rewards[0]) < T and float(v.reward_heads[0, 0]) < T  # what every test below relies on


@pytest.mark.parametrize("threshold", [0.7, 0.1, 0.3, 1.0, 1 / 3, 1e-8, -0.7, 12.34])
def test_at_least_is_exact_at_the_threshold_on_every_path(threshold: float) -> None:
    """Exactly at the threshold passes whether the score is a Python float, float64, float32 or
    float32 widened back to float64; one float32 step below fails; NaN fails; shape is kept."""
    below = float(torch.nextafter(torch.tensor(threshold), torch.tensor(-math.inf)))
    for x in (
        threshold,
        torch.tensor([threshold], dtype=torch.float64),
        torch.tensor([threshold]),
        torch.tensor([threshold]).double(),
    ):
        assert bool(at_least(x, threshold))
    for x in (below, torch.tensor([below]), torch.tensor([below]).double()):
        assert not bool(at_least(x, threshold))
    assert not bool(at_least(float("nan"), threshold))
    assert at_least(torch.full((2, 3), threshold), threshold).shape == (2, 3)
    assert at_least(torch.tensor([1, 0]), 1.0).tolist() == [True, False]  # integer scores too


def test_at_least_rounds_to_a_coarser_dtype_of_the_scores() -> None:
    """bfloat16 scores are compared at bfloat16: bf16(0.7) reaches 0.7."""
    assert bool(at_least(torch.tensor(T, dtype=torch.bfloat16), T))


@pytest.mark.parametrize("head", [None, "correct"])
def test_alp_a_sample_exactly_at_the_solved_threshold_is_solved(head: str | None) -> None:
    """3 of 4 correct at 0.7: p_solved = 3/4, so the penalty is β·N·3/4 (a miss gives the floor 1/4)."""
    scores = [T, T, T, 0.0]
    v = view(scores, [{"correct": s} for s in scores])
    out = alp(
        v.rewards,
        v.group_ids,
        reward_heads=v.reward_heads,
        head_names=v.head_names,
        lengths=v.mask.sum(1).long(),
        beta=0.01,
        correct_head=head,
        solved_threshold=T,
    )
    torch.testing.assert_close(out, (v.rewards.double() - 0.01 * 2 * 0.75).float())


@pytest.mark.parametrize("head", [None, "outcome"])
def test_papo_outcomes_exactly_at_the_threshold_are_the_correct_subset(head: str | None) -> None:
    """Two correct at 0.7 with different rubric scores: A_proc = ±1 on them (|C| = 2), not 0."""
    outs = [T, T, 0.0]
    v = view(outs, [{"outcome": o, "rubric": p} for o, p in zip(outs, [1.0, 0.0, 0.5])])
    a = papo(
        v.rewards,
        v.group_ids,
        reward_heads=v.reward_heads,
        head_names=v.head_names,
        outcome_head=head,
        correct_threshold=T,
    ).double()
    a_out = (v.rewards.double() - v.rewards.double().mean()) / v.rewards.double().std(unbiased=False)
    torch.testing.assert_close(a - a_out, torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64), atol=1e-5, rtol=0)


def test_unlikeliness_scales_a_reward_exactly_at_the_threshold() -> None:
    """Both correct at 0.7: the more likely one is scaled by 1 − β(G − 1)/G = 0.875, the other by 1."""
    v = view([T, T])
    out = unlikeliness(v.rewards, v.group_ids, seq_logp=torch.tensor([-1.0, -2.0]), correct_threshold=T)
    torch.testing.assert_close(out, v.rewards * torch.tensor([0.875, 1.0]))


def test_w_reinforce_a_reward_exactly_at_the_threshold_is_positive() -> None:
    v = view([T, 0.0])
    assert w_reinforce(v.rewards, v.group_ids, lam=0.1, correct_threshold=T).tolist() == pytest.approx([0.1, -1.0])


@pytest.mark.parametrize("head", [None, "outcome"])
def test_prof_grpo_an_outcome_exactly_at_the_threshold_is_on_the_correct_side(head: str | None) -> None:
    """One correct (0.7) among six, keep 2, PROF-BOTH: the balanced split keeps it (k+ = 1). Were it
    wrong, the two kept would be the wrong ones of highest −PRM, and its PRM is the highest."""
    outs = [T, 0.0, 0.0, 0.0, 0.0, 0.0]
    prm = [0.9, 0.1, 0.2, 0.3, 0.4, 0.5]
    v = view(outs, [{"outcome": o, "prm": p} for o, p in zip(outs, prm)])
    keep = prof_grpo(
        v.rewards,
        v.group_ids,
        reward_heads=v.reward_heads,
        head_names=v.head_names,
        keep=2,
        variant="both",
        outcome_head=head,
        correct_threshold=T,
    )
    assert keep.tolist() == [True, True, False, False, False, False]


@pytest.mark.parametrize("head", [None, "outcome"])
def test_rlcer_an_outcome_exactly_at_the_threshold_is_plus_one(head: str | None) -> None:
    outs = [T, 0.0]
    v = view(outs, [{"outcome": o} for o in outs])
    out = rlcer(
        v.rewards,
        v.group_ids,
        reward_heads=v.reward_heads,
        head_names=v.head_names,
        outcome_head=head,
        correct_threshold=T,
    )
    assert out.tolist() == [1.0, -1.0]


def test_polaris_pass_rate_and_rescue_count_a_reward_exactly_at_correct_reward() -> None:
    """Group 0 has one correct sample (0.7) of two: pass rate 1/2, nothing to rescue; group 1 none."""
    v = view([T, 0.0, 0.0, 0.0], group=[0, 0, 1, 1])
    assert pass_rates(v.rewards, v.group_ids, correct_reward=T) == {0: 0.5, 1: 0.0}
    assert rescue_plan(v.rewards, v.group_ids, [True] * 4, correct_reward=T) == {1: 3}


def test_rlrt_gates_on_a_reward_exactly_at_the_success_threshold() -> None:
    """The learner hands distillation its rewards as float32: a rollout at 0.7 succeeds."""
    v = view([T, 0.0])
    s = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    batch = DistillBatch(
        student_logp=s,
        old_logp=s.clone(),
        teacher_logp=s - math.log(2.0),
        mask=torch.ones_like(s),
        rewards=v.rewards.float(),
        group_ids=v.group_ids,
        advantages=torch.tensor([1.0, -1.0], dtype=torch.float64),
    )
    out = get("distill", "rlrt")(batch, success_threshold=T)
    assert float(out.metrics["rlrt/gated_frac"]) == 0.5
    assert out.token_advantage[0].abs().min() > 0 and out.token_advantage[1].abs().max() == 0
