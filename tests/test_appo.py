"""APPO (`algos/appo.py`, `recipes/appo.py`): the spec's testable properties of the branching score,
the dual-group advantage and the (1 + b·Â^ftu) loss; the tree rollouts on the real embedded engine;
the config rules."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

import mcore_rl.algos  # noqa: F401  (registrations)
from mcore_rl.algos import registry
from mcore_rl.algos.advantages import grpo
from mcore_rl.algos.appo import (
    allot_branches,
    appo,
    appo_loss,
    branch_points,
    branching_scores,
    future_log_ratio,
    future_ratio,
    zscore_rows,
)
from mcore_rl.algos.multi_reward import OptionError
from mcore_rl.algos.policy_loss import ppo_clip
from mcore_rl.data.samples import Prompt, Sample, SampleMarks
from mcore_rl.rollout.engine.core import Request
from mcore_rl.rollout.engine.sampling import SamplingParams
from tests.helpers import TINY, TOK, make_engine, run, tiny, tiny_model


def _rand(n: int, t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    new = old + 0.3 * torch.randn(n, t, generator=g, dtype=torch.float64)
    ent = torch.rand(n, t, generator=g, dtype=torch.float64) * 2
    mask = torch.ones(n, t, dtype=torch.float64)
    mask[1, 7:] = 0
    return new, old, ent, mask


# ---------------------------------------------------------------- property 2: the future ratio


def test_future_log_ratio_is_the_backward_recursion_and_the_explicit_sum():
    new, old, _, mask = _rand(3, 9)
    lr, gamma = new - old, 0.9
    g = future_log_ratio(lr, mask, gamma)
    m = lr * mask
    explicit = torch.stack([(m[:, i:] * gamma ** torch.arange(9 - i, dtype=torch.float64)).sum(1) for i in range(9)], 1)
    torch.testing.assert_close(g, explicit)
    nxt = torch.cat([g[:, 1:], torch.zeros(3, 1, dtype=torch.float64)], 1)
    torch.testing.assert_close(g, m + gamma * nxt)  # G_i = log ρ_i + γ G_{i+1}, G_{T+1} = 0
    assert not torch.equal(g, future_log_ratio(lr, mask, 1.0))  # γ is used


# ---------------------------------------------------------------- property 1: π_θ = π_old


def test_on_policy_ratio_is_one_and_the_advantage_is_grpo_times_one_plus_b():
    _, old, _, mask = _rand(4, 6)
    assert torch.equal(future_ratio(old - old, mask, 0.95, 0.2), torch.ones(4, 6, dtype=torch.float64))
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0])
    gids = torch.zeros(4, dtype=torch.long)
    base = appo(rewards, gids)
    torch.testing.assert_close(base, grpo(rewards, gids))  # no branches, one group: GRPO
    logp = old.float().clone().requires_grad_()
    for b in (0.0, 0.5):
        out = appo_loss(logp, old.float(), base, mask.float(), ftu_coef=b, gamma=0.95)
        ref = ppo_clip(logp, old.float(), base * (1 + b), mask.float())
        torch.testing.assert_close(out.loss_sum, ref.loss_sum)
        ga = torch.autograd.grad(out.loss_sum, logp)[0]
        gr = torch.autograd.grad(ref.loss_sum, logp)[0]
        torch.testing.assert_close(ga, gr)


def test_ftu_scaling_off_policy_weights_each_token_by_its_clipped_future_ratio_never_flipping_a_sign():
    new, old, _, mask = _rand(2, 5)
    logp = new.float().clone().requires_grad_()
    adv = torch.tensor([1.0, -2.0])
    b, clip = 0.7, 0.1
    out = appo_loss(logp, old.float(), adv, mask.float(), ftu_coef=b, gamma=1.0, clip=clip)
    ftu = future_ratio(new - old, mask, 1.0, clip).float()
    assert ftu.min() >= 1 - clip - 1e-6 and ftu.max() <= 1 + clip + 1e-6 and not torch.all(ftu == 1)
    ref = ppo_clip(logp, old.float(), adv[:, None] * (1 + b * ftu), mask.float())
    torch.testing.assert_close(out.loss_sum, ref.loss_sum)
    assert torch.all(torch.sign(adv[:, None] * (1 + b * ftu)) == torch.sign(adv)[:, None])


# ---------------------------------------------------------------- property 3: dual groups


def test_init_and_branch_sets_are_each_zero_mean_and_a_branch_never_moves_the_init_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.2, 0.0, 1.0])
    gids = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])
    branch = torch.tensor([False, False, True, True, True, False, False, True])
    adv = appo(rewards, gids, branches=branch).double()
    for g in (0, 1):
        for is_b in (False, True):
            sel = (gids == g) & (branch == is_b)
            if int(sel.sum()) > 1:
                assert abs(float(adv[sel].sum())) < 1e-9
    # a different branch set leaves the init advantages as they were; pooling them would not
    other = rewards.clone()
    other[2:5] = torch.tensor([1.0, 1.0, 1.0])
    assert torch.equal(appo(other, gids, branches=branch)[~branch], adv.float()[~branch])
    pooled = grpo(rewards, gids)
    assert not torch.allclose(pooled[~branch], adv.float()[~branch])
    # mean-only and invalid samples, as grpo does within each set
    valid = torch.ones(8, dtype=torch.bool)
    valid[0] = False
    a2 = appo(rewards, gids, branches=branch, valid=valid, normalize_std=False)
    assert a2[0] == 0 and abs(float(a2[1])) < 1e-6  # the init set of group 0 is sample 1 alone: no baseline


def test_the_estimator_is_registered_and_the_learner_passes_branches_from_the_marks():
    from mcore_rl.algos.multi_reward import takes_input
    from mcore_rl.train.rl_step import branch_flags

    assert registry.get("advantage", "appo") is appo and takes_input(appo, "branches")
    assert not takes_input(registry.get("advantage", "grpo"), "branches")
    p = Prompt(index=0, text="q", ids=[1, 2])
    ss = [Sample(p, 0, [3], [-0.1], 0, "stop"), Sample(p, 0, [3], [-0.1], 0, "stop", marks=SampleMarks(branch_of=0))]
    assert branch_flags(ss).tolist() == [False, True]


# ---------------------------------------------------------------- property 4: selection


def test_selection_returns_exactly_b_positions_and_is_invariant_to_affine_entropy():
    new, old, ent, mask = _rand(3, 12, seed=3)
    s = branching_scores(new, old, ent, mask, gamma=0.9, clip=0.2)
    pts = branch_points(s, mask, 4)
    assert pts.shape == (3, 4) and bool((pts >= 0).all())
    for n in range(3):
        assert len(set(pts[n].tolist())) == 4 and all(mask[n, p] == 1 for p in pts[n].tolist())
        top = torch.where(mask[n] > 0, s[n], torch.full_like(s[n], -torch.inf)).topk(4).indices
        assert set(pts[n].tolist()) == set(top.tolist())
    s2 = branching_scores(new, old, 3.5 * ent + 7.0, mask, gamma=0.9, clip=0.2)
    torch.testing.assert_close(s, s2)
    assert torch.equal(branch_points(s2, mask, 4), pts)
    s_neg = branching_scores(new, old, -ent, mask, gamma=0.9, clip=0.2)  # a < 0 is not invariant
    assert not torch.allclose(s, s_neg)


def test_a_row_with_fewer_candidates_than_b_gives_all_of_them_then_minus_one():
    mask = torch.zeros(2, 5)
    mask[0, :2] = 1
    scores = torch.tensor([[0.1, 0.5, 9.0, 9.0, 9.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    assert branch_points(scores, mask, 3).tolist() == [[1, 0, -1], [-1, -1, -1]]
    with pytest.raises(OptionError):
        branch_points(scores, mask, 0)


def test_a_constant_factor_drops_out_on_policy_the_score_is_the_entropy_z_score():
    _, old, ent, mask = _rand(2, 8, seed=5)
    s = branching_scores(old, old, ent, mask)  # ρ ≡ 1: Ω constant
    z, varies = zscore_rows(ent, mask)
    assert bool(varies.all())
    torch.testing.assert_close(s, z)


def test_branches_are_dealt_round_robin_in_rank_order_over_the_points():
    pts = torch.tensor([[4, 1, 7], [2, -1, -1]])
    assert allot_branches(pts, 4) == [(0, 4), (1, 2), (0, 1), (0, 7)]
    assert allot_branches(pts, 6) == [(0, 4), (1, 2), (0, 1), (0, 7), (0, 4), (1, 2)]
    assert allot_branches(torch.full((2, 3), -1), 5) == []


# ---------------------------------------------------------------- options, validated


def test_options_are_checked_with_the_option_named():
    from mcore_rl.algos.multi_reward import option_problems

    assert option_problems("policy_loss", "appo", {"ftu_coef": 0.5, "gamma": 0.9}) == []
    assert option_problems("policy_loss", "appo", {"ftu_coef": -1.0}) == [("ftu_coef", "must be >= 0, got -1.0")]
    assert option_problems("policy_loss", "appo", {"clip": 1.5})[0][0] == "clip"
    assert "is not an option" in option_problems("policy_loss", "ppo_clip", {"ftu_coef": 1.0})[0][1]
    assert option_problems("advantage", "appo", {}) == []


def _errors(*overrides: str, path: str | None = None) -> str:
    from mcore_rl.config.errors import ConfigError
    from mcore_rl.config.loader import load_config
    from mcore_rl.config.rl_schema import RLConfig
    from mcore_rl.config.rl_validate import validate_rl_config

    try:
        cfg = (
            load_config(RLConfig, path, TINY + list(overrides))
            if path is None
            else load_config(RLConfig, path, list(overrides))
        )
        validate_rl_config(cfg, 1)
    except ConfigError as e:
        return str(e)
    return ""


ON = ("rollout.appo.enabled=true", "algorithm.advantage=appo", "algorithm.policy_loss=appo")


def test_config_rules_name_the_key():
    assert _errors(*ON) == ""
    assert "algorithm.advantage" in _errors("rollout.appo.enabled=true")
    assert "rollout.appo.enabled" in _errors("algorithm.advantage=appo")
    assert "rollout.appo.budget" in _errors(*ON, "rollout.appo.budget=2", "rollout.group_size=4")
    assert "rollout.appo.branch_points" in _errors(*ON, "rollout.appo.branch_points=0")
    assert "rollout.appo.clip" in _errors(*ON, "rollout.appo.clip=1.0")
    assert "algorithm.policy_loss_options.ftu_coef" in _errors(*ON, "algorithm.policy_loss_options={ftu_coef: -1.0}")
    agentic = ("rollout.appo.enabled=true", "algorithm.advantage=appo")
    assert _errors(*agentic, path="configs/agentic_demo.yaml") == ""  # step-wise episodes branch
    conversation = _errors(
        *agentic, "data.domains[0].environment.trajectory=conversation", path="configs/agentic_demo.yaml"
    )
    assert "data.domains[0].environment.trajectory" in conversation and "step-wise" in conversation, conversation


# ---------------------------------------------------------------- the tree on a real engine


class _Rollout:
    """The `RolloutContext` of `recipes/appo.py` over the real embedded engine (reward: the count of
    the digit 7 in the text, so branches are scored like any sample)."""

    def __init__(self, cfg, engine) -> None:
        self.cfg, self.engine = cfg, engine
        self.requests: list = []

    @property
    def tokenizer(self):
        return TOK

    @property
    def temperature(self) -> float:
        return 1.0

    def budget(self, prompt) -> int:
        return self.cfg.rollout.max_new_tokens

    def sampling_params(self, temperature, seed, max_new_tokens=None, domain=None):
        return {"temperature": temperature, "sampling_seed": seed, "max_new_tokens": max_new_tokens}

    async def generate_many(self, requests):
        self.requests += list(requests)
        reqs = [
            Request(f"r{i}", list(r.input_ids), SamplingParams.from_dict(dict(r.sampling_params)), return_logprob=True)
            for i, r in enumerate(requests)
        ]
        outs = run(self.engine, reqs)
        return [_generation(outs[r.rid]) for r in reqs]

    async def score_rewards(self, samples):
        for s in samples:
            s.reward = float(s.text.count("7"))


def _generation(o) -> SimpleNamespace:
    return SimpleNamespace(
        output_ids=list(o.output_ids),
        output_logprobs=[lp for lp, _ in o.output_token_logprobs],
        weight_version=0,
        finish_reason=(o.finish_reason or {}).get("type", "length"),
        text=o.text or "",
        engine="embedded:0",
        output_versions=None,
    )


def test_tree_rollouts_on_the_embedded_engine_continue_each_root_prefix():
    from mcore_rl.recipes.appo import grow_trees

    cfg = tiny(*ON, "rollout.group_size=2", "rollout.appo.branch_points=3", "rollout.max_new_tokens=12")
    engine = make_engine(tiny_model(seed=1))
    prompt = Prompt(index=3, text="7+7=", ids=TOK.encode("7+7="))
    roots_req = [
        Request(
            f"root{j}",
            list(prompt.ids),
            SamplingParams.from_dict(
                {"temperature": 1.0, "sampling_seed": j, "max_new_tokens": 12, "ignore_eos": True}
            ),
            return_logprob=True,
        )
        for j in range(2)
    ]
    outs = run(engine, roots_req)
    roots = []
    for j in range(2):
        g = _generation(outs[f"root{j}"])
        roots.append(Sample(prompt, 3, g.output_ids, g.output_logprobs, 0, g.finish_reason, g.text, g.engine))
    ctx = _Rollout(cfg, engine)
    for s in roots:
        s.reward = float(s.text.count("7"))
    (group,), counts = asyncio.run(grow_trees(ctx, [roots]))
    assert counts["branches"] == 6 and len(group) == 8  # M = N + N·B
    assert group[:2] == roots
    expected = {}
    for n, s in enumerate(roots):
        mu = torch.tensor([s.rollout_logp], dtype=torch.float64)
        m = torch.ones_like(mu)
        expected[n] = branch_points(branching_scores(mu, mu, -mu, m), m, 3)[0].tolist()
    for k, b in enumerate(group[2:]):
        n = b.marks.branch_of
        p = len(b.prompt.ids) - len(prompt.ids)
        assert b.prompt.ids == prompt.ids + roots[n].response_ids[:p]  # the root's prefix, as it was sampled
        assert p in expected[n]
        assert b.prompt.text == prompt.text and b.group == 3 and b.reward == float(b.text.count("7"))
        assert len(b.response_ids) == len(b.rollout_logp) and 1 <= len(b.response_ids) <= 12 - p  # the remaining budget
        assert b.text.startswith(TOK.decode(roots[n].response_ids[:p]))
    assert sorted((b.marks.branch_of, len(b.prompt.ids) - len(prompt.ids)) for b in group[2:]) == sorted(
        (n, p) for n in range(2) for p in expected[n]
    )
    # μ of a branch's tokens is the engine's, for that context: score one again and compare
    b = group[2]
    again = run(
        engine,
        [
            Request(
                "s",
                b.prompt.ids + b.response_ids,
                SamplingParams.from_dict({"max_new_tokens": 1}),
                return_logprob=True,
                logprob_start_len=len(b.prompt.ids) - 1,
            )
        ],
    )["s"]
    torch.testing.assert_close(
        torch.tensor([lp for lp, _ in again.input_token_logprobs[1:]]), torch.tensor(b.rollout_logp), atol=1e-4, rtol=0
    )
    assert counts["prefix_tokens"] == sum(len(b.prompt.ids) - len(prompt.ids) for b in group[2:])
    assert counts["context_tokens"] == sum(len(b.prompt.ids) for b in group[2:])


def test_episode_trees_replay_the_root_turns_and_branch_inside_a_turn():
    """Guess-the-number, step-wise, on the embedded engine: each branch episode replays its root's
    turns before the branch (every replayed context equal to the root's), continues the turn from the
    root's prefix (untrained) and plays on; its samples carry its own return."""
    from mcore_rl.agent.groups import EpisodeGroups, environment_examples
    from mcore_rl.config.loader import load_config
    from mcore_rl.config.rl_schema import RLConfig
    from mcore_rl.recipes.appo import grow_trees

    cfg = load_config(
        RLConfig, "configs/agentic_demo.yaml", [*ON, "rollout.group_size=2", "rollout.appo.branch_points=4"]
    )
    episodes = EpisodeGroups.from_config(cfg, TOK)
    assert episodes is not None
    ctx = _Rollout(cfg, make_engine(tiny_model(seed=2)))
    (text, label), *_ = environment_examples(cfg.data.domains[0], 1, 0)
    prompt = Prompt(5, text, TOK.encode(text), label, "guess")

    async def generate(req):
        return (await ctx.generate_many([req]))[0]

    samplings = [ctx.sampling_params(1.0, 100 + j) for j in range(2)]
    roots = asyncio.run(episodes.run_group(prompt, samplings, generate))
    (group,), counts = asyncio.run(grow_trees(ctx, [roots], episodes))
    assert counts["replay_mismatch"] == 0 and counts["branches"] == 8  # M = N + N·B = 10 episodes
    branches = group[len(roots) :]
    assert group[: len(roots)] == roots and all(s.marks.branch_of is not None for s in branches)
    by_root = {(s.episode, s.step_index): s for s in roots}
    seen, where = set(), set()
    for s in branches:
        if s.episode in seen:
            continue  # the first sample of each branch episode is its branched turn
        seen.add(s.episode)
        assert s.episode not in {r.episode for r in roots}
        root = by_root[(s.marks.branch_of, s.step_index)]
        p = next((i for i, m in enumerate(s.trainable) if m), len(s.trainable))
        where.add((s.step_index > 0, p > 0))
        assert s.prompt.ids == root.prompt.ids and s.info["state"] == root.info["state"]  # replayed
        assert s.response_ids[:p] == root.response_ids[:p] and s.rollout_logp[:p] == root.rollout_logp[:p]
        assert all(m == 1 for m in s.trainable[p:]) and len(s.response_ids) > p
        mates = [x for x in branches if x.episode == s.episode]
        assert len({x.reward for x in mates}) == 1 and [x.step_index for x in mates] == list(
            range(s.step_index, s.step_index + len(mates))
        )
    assert len(seen) == 8
    assert (True, False) in where and any(inside for _, inside in where)  # turns replayed; a branch inside a turn
    assert counts["prefix_tokens"] == sum(
        next(i for i, m in enumerate(x.trainable) if m) for x in branches if x.trainable
    )
    episodes.close()
