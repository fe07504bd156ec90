"""Step-level credit (GiGPO, HGPO, GAGPO, StepPO's step GAE): each spec's testable properties, checked
against direct loops over the formulas; option and config errors that name their key; and the
per-turn baseline bias on guess-the-number played through the real `Episode` and environment.
The learner's call site is checked in `test_algos_credit.py`'s spawned world."""

from __future__ import annotations

import importlib.util
import math
import random
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import pytest
import torch

from mcore_rl import algos
from mcore_rl.algos.advantages import grpo, to_tokens
from mcore_rl.algos.gagpo import gagpo, grouped_gae
from mcore_rl.algos.gigpo import anchor_step_advantage, gigpo
from mcore_rl.algos.hgpo import context_groups, hgpo, level_weights
from mcore_rl.algos.multi_reward import option_problems
from mcore_rl.algos.policy_loss import sequence_log_ratio
from mcore_rl.algos.step_credit import (
    StepBatch,
    effective_step_rewards,
    moments_within,
    normalized_within,
    state_key,
    step_returns,
)
from mcore_rl.algos.steppo import step_gae, steppo
from mcore_rl.algos.critic import takes_values
from mcore_rl.config import ConfigError, RLConfig, load_config, validate_rl_config

# An episode: (group, [(state text, step reward), ...], the episode's reward)
Episodes = Sequence[tuple[int, Sequence[tuple[str, float]], float]]


def batch(episodes: Episodes) -> tuple[torch.Tensor, torch.Tensor, StepBatch]:
    """(rewards [N], group ids [N], steps) of the episodes' step samples, episode by episode."""
    rewards, groups, ep, st, keys, rs = [], [], [], [], [], []
    count: dict[int, int] = {}
    for g, steps, reward in episodes:
        e = count.get(g, 0)
        count[g] = e + 1
        for t, (state, r) in enumerate(steps):
            rewards.append(reward)
            groups.append(g)
            ep.append(e)
            st.append(t)
            keys.append(state_key(state))
            rs.append(r)
    return (
        torch.tensor(rewards, dtype=torch.float64),
        torch.tensor(groups),
        StepBatch(torch.tensor(ep), torch.tensor(st), torch.tensor(keys), torch.tensor(rs, dtype=torch.float64)),
    )


def flat(episodes: Episodes) -> list[tuple[int, int, int, str]]:
    """(group, episode index in the batch, step, state) per sample, in the batch's order."""
    return [(g, e, t, s) for e, (g, steps, _) in enumerate(episodes) for t, (s, _) in enumerate(steps)]


def returns_by_loop(episodes: Episodes, gamma: float) -> list[float]:
    out = []
    for _, steps, reward in episodes:
        r = [x for _, x in steps]
        r[-1] += reward - sum(r)  # the remainder of the episode's reward on its last step
        out += [sum(gamma**k * x for k, x in enumerate(r[t:])) for t in range(len(r))]
    return out


def zscore(x: float, xs: Sequence[float], eps: float = 1e-6) -> float:
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((v - mean) ** 2 for v in xs) / (len(xs) - 1))
    return (x - mean) / (std + eps)


# Guess-the-number-like episodes: the group's episodes start from one state ("1-8"); a step's reward
# is 0, but the last, and an invalid turn costs 0.1. Group 1 reuses group 0's state texts.
GAMES: Episodes = [
    (0, [("1-8", 0.0), ("5-8", 0.0), ("7-8", 1.0)], 1.0),
    (0, [("1-8", 0.0), ("5-8", 1.0)], 1.0),
    (0, [("1-8", -0.1), ("1-8", 0.0), ("1-4", 0.0)], -0.1),
    (0, [("1-8", 0.0), ("1-4", 1.0)], 1.0),
    (1, [("1-8", 0.0), ("5-8", 0.0)], 0.0),
    (1, [("1-8", 0.0), ("5-8", 0.0), ("7-8", 1.0)], 1.0),
]


def test_registered_as_advantages_and_the_step_input_is_declared() -> None:
    assert algos.get("advantage", "gigpo") is gigpo
    assert algos.get("advantage", "hgpo") is hgpo
    assert algos.get("advantage", "gagpo") is gagpo
    assert algos.get("advantage", "steppo") is steppo and takes_values(steppo)  # it reads the critic


def test_step_returns_put_the_episodes_remainder_on_its_last_step() -> None:
    rewards, gids, steps = batch(GAMES)
    rewards = rewards + 0.5  # a reward shaping: the undiscounted return of step 0 is still the reward
    shaped = [(g, s, r + 0.5) for g, s, r in GAMES]
    for gamma in (1.0, 0.9):
        torch.testing.assert_close(
            step_returns(rewards, gids, steps, gamma), torch.tensor(returns_by_loop(shaped, gamma), dtype=torch.float64)
        )
    first = steps.step == 0
    torch.testing.assert_close(step_returns(rewards, gids, steps, 1.0)[first], rewards[first])
    assert float(effective_step_rewards(rewards, gids, steps)[2]) == pytest.approx(1.5)


def test_gigpo_is_the_episode_advantage_plus_omega_times_the_anchor_state_advantage() -> None:
    rewards, gids, steps = batch(GAMES)
    gamma, omega = 0.9, 0.5
    rets = returns_by_loop(GAMES, gamma)
    samples = flat(GAMES)
    want = []
    for i, (g, e, _, s) in enumerate(samples):
        episode_rewards = [r for gg, _, r in GAMES if gg == g]  # each episode once
        a_e = zscore(GAMES[e][2], episode_rewards)
        anchor = [rets[j] for j, (gg, _, _, ss) in enumerate(samples) if gg == g and ss == s]
        a_s = zscore(rets[i], anchor) if len(anchor) > 1 else 0.0
        want.append(a_e + omega * a_s)
    got = gigpo(rewards, gids, steps=steps, step_weight=omega, gamma=gamma)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32))
    # a repeated state inside one episode ("1-8" twice in episode 2) joins its anchor group twice;
    # group 1's "1-8" is not group 0's
    alone = anchor_step_advantage(rewards, gids, steps, None, True, gamma, 1e-6)[[2, 14]]  # "7-8", once per group
    assert torch.equal(alone, torch.zeros(2).double())


def test_gigpo_step_term_is_zero_without_shared_states_and_it_counts_each_episode_once() -> None:
    unique = [(0, [(f"{e}-{t}", 0.0) for t in range(e + 1)], float(e % 2)) for e in range(4)]
    rewards, gids, steps = batch(unique)
    assert torch.equal(anchor_step_advantage(rewards, gids, steps, None, True, 0.95, 1e-6), torch.zeros(10).double())
    adv = gigpo(rewards, gids, steps=steps)
    per_episode = grpo(torch.tensor([0.0, 1.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(adv, per_episode[steps.episode])
    # GRPO over the step samples counts the 4-step episode 4 times: its baseline leans to it
    assert not torch.allclose(grpo(rewards, gids), adv)
    torch.testing.assert_close(gigpo(rewards, gids, steps=steps, step_weight=0.0), adv)


def test_gigpo_on_one_step_episodes_from_one_state_is_one_plus_omega_times_grpo() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    gids = torch.tensor([0, 0, 0, 1, 1, 1])
    steps = StepBatch(torch.tensor([0, 1, 2, 0, 1, 2]), torch.zeros(6).long(), torch.full((6,), 7), torch.zeros(6))
    torch.testing.assert_close(gigpo(r, gids, steps=steps, step_weight=0.5), 1.5 * grpo(r, gids))
    torch.testing.assert_close(gigpo(r, gids, steps=steps, step_weight=0.0), grpo(r, gids))
    torch.testing.assert_close(gigpo(r, gids), grpo(r, gids))  # no steps: one-step episodes, own states


def test_invalid_steps_leave_every_statistic_and_get_zero() -> None:
    rewards, gids, steps = batch(GAMES)
    lost = [0, 1, 2, 10, 11]  # two episodes whose environment failed (every sample carries the error)
    valid = torch.ones(len(rewards), dtype=torch.bool)
    valid[lost] = False
    for name in ("gigpo", "hgpo", "gagpo"):
        fn = algos.get("advantage", name)
        adv = fn(rewards, gids, steps=steps, valid=valid)
        assert torch.equal(adv[lost], torch.zeros(5)), name
        moved = rewards.clone()
        moved[lost] = 99.0  # their rewards move no other sample's advantage
        moved_steps = StepBatch(steps.episode, steps.step, steps.state_key, steps.step_reward.clone())
        moved_steps.step_reward[lost] = 99.0
        torch.testing.assert_close(adv, fn(moved, gids, steps=moved_steps, valid=valid), msg=name)


# ---------------------------------------------------------------------------------------------- HGPO


def test_hgpo_weights_are_proportional_to_k_plus_one_to_the_alpha_and_sum_to_one() -> None:
    torch.testing.assert_close(level_weights(4, 1.0), torch.tensor([1, 2, 3, 4, 5], dtype=torch.float64) / 15)
    torch.testing.assert_close(level_weights(2, 0.0), torch.full((3,), 1 / 3, dtype=torch.float64))
    for k, a in ((0, 1.0), (4, 2.0), (7, 0.5)):
        assert float(level_weights(k, a).sum()) == pytest.approx(1.0)


def test_hgpo_groups_are_nested_and_short_windows_need_the_whole_prefix() -> None:
    rng = random.Random(0)
    eps: list = [
        (g, [(rng.choice("abc"), 0.0) for _ in range(rng.randint(1, 5))], float(rng.random() < 0.5))
        for g in (0, 0, 0, 0, 0, 0, 1, 1, 1)
    ]
    rewards, gids, steps = batch(eps)
    samples = flat(eps)
    levels = [context_groups(gids, steps, k).tolist() for k in range(5)]
    n = len(samples)
    for k in range(1, 5):
        for i in range(n):
            for j in range(n):
                if levels[k][i] == levels[k][j]:
                    assert levels[k - 1][i] == levels[k - 1][j]  # G_k ⊆ G_{k-1}
                    (gi, ei, ti, _), (gj, ej, tj, _) = samples[i], samples[j]
                    hist_i = [s for s, _ in eps[ei][1][max(ti - k, 0) : ti + 1]]
                    hist_j = [s for s, _ in eps[ej][1][max(tj - k, 0) : tj + 1]]
                    assert gi == gj and hist_i == hist_j
                    if ti < k:  # the whole prefix from s_0
                        assert tj == ti


def test_hgpo_with_k0_is_gigpos_step_advantage_and_with_the_episode_term_gigpo() -> None:
    rewards, gids, steps = batch(GAMES)
    a0 = anchor_step_advantage(rewards, gids, steps, None, True, 0.95, 1e-6).float()
    torch.testing.assert_close(hgpo(rewards, gids, steps=steps, levels=0), a0)
    torch.testing.assert_close(
        hgpo(rewards, gids, steps=steps, levels=0, episode_weight=1.0), gigpo(rewards, gids, steps=steps)
    )


def test_hgpo_with_identical_histories_is_its_level_zero_and_context_splits_otherwise() -> None:
    same = [(0, [("s", 0.0), ("t", 0.0), ("u", r)], r) for r in (1.0, 0.0, 0.0, 1.0)]
    rewards, gids, steps = batch(same)
    level0 = hgpo(rewards, gids, steps=steps, levels=0)
    for alpha in (0.0, 1.0, 2.0):
        torch.testing.assert_close(hgpo(rewards, gids, steps=steps, levels=4, alpha=alpha), level0)
    # the same current state "x" after different histories: level 1 splits it, so HGPO differs from
    # GiGPO's step term, and a level that is one step alone is skipped (weights renormalised)
    split = [
        (0, [("a", 0.0), ("x", 1.0)], 1.0),
        (0, [("a", 0.0), ("x", 0.0)], 0.0),
        (0, [("b", 0.0), ("x", 0.0)], 0.0),
        (0, [("b", 0.0), ("x", 0.0)], 0.0),
    ]
    rewards, gids, steps = batch(split)
    got = hgpo(rewards, gids, steps=steps, levels=1, alpha=1.0, gamma=1.0)
    rets = [1.0, 0.0, 0.0, 0.0]  # the returns of the four "x" steps
    x = [1, 3, 5, 7]
    for i, xi in enumerate(x):
        level1 = rets[:2] if i < 2 else rets[2:]
        want = (1 * zscore(rets[i], rets) + 2 * zscore(rets[i], level1)) / 3
        assert float(got[xi]) == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert not torch.allclose(got, hgpo(rewards, gids, steps=steps, levels=0, gamma=1.0))


# --------------------------------------------------------------------------------------------- GAGPO


def test_gagpo_without_state_collisions_has_no_signal() -> None:
    unique = [(0, [(f"{e}-{t}", 0.0) for t in range(3)], float(e % 2)) for e in range(4)]
    rewards, gids, steps = batch(unique)
    assert torch.equal(grouped_gae(rewards, gids, steps, None, 0.95, 0.8), torch.zeros(12).double())
    assert torch.equal(gagpo(rewards, gids, steps=steps), torch.zeros(12))


def test_gagpo_gae_limits_and_closed_form() -> None:
    rewards, gids, steps = batch(GAMES)
    gamma = 0.9
    rets = returns_by_loop(GAMES, gamma)
    samples = flat(GAMES)
    value = [
        sum(rets[j] for j, (gg, _, _, ss) in enumerate(samples) if (gg, ss) == (g, s))
        / sum(1 for gg, _, _, ss in samples if (gg, ss) == (g, s))
        for g, _, _, s in samples
    ]
    torch.testing.assert_close(  # λ = 1: the return minus the state's value
        grouped_gae(rewards, gids, steps, None, gamma, 1.0), torch.tensor(rets).double() - torch.tensor(value).double()
    )
    r = effective_step_rewards(rewards, gids, steps).tolist()
    last = [i == len(samples) - 1 or samples[i + 1][1] != samples[i][1] for i in range(len(samples))]
    delta = [r[i] + (0.0 if last[i] else gamma * value[i + 1]) - value[i] for i in range(len(samples))]
    torch.testing.assert_close(grouped_gae(rewards, gids, steps, None, gamma, 0.0), torch.tensor(delta).double())
    lam = 0.8
    closed = []
    for i in range(len(samples)):  # Σ_l (γλ)^l δ_{t+l} over the rest of the episode
        total, j, lag = 0.0, i, 0
        while True:
            total += (gamma * lam) ** lag * delta[j]
            if last[j]:
                break
            j, lag = j + 1, lag + 1
        closed.append(total)
    torch.testing.assert_close(grouped_gae(rewards, gids, steps, None, gamma, lam), torch.tensor(closed).double())
    adv = gagpo(rewards, gids, steps=steps, gamma=gamma, lam=lam).double()
    for g in (0, 1):  # normalised over the rollout group: mean 0, population std 1
        a = adv[gids == g]
        assert float(a.mean()) == pytest.approx(0.0, abs=1e-6)
        assert float(a.std(unbiased=False)) == pytest.approx(1.0, abs=1e-4)


def test_the_action_level_ratio_is_the_geometric_mean_of_the_token_ratios() -> None:
    old = torch.log(torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.3, 0.3]]))
    new = torch.log(torch.tensor([[0.6, 0.1, 0.3], [0.6, 0.6, 0.6]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    ratio = sequence_log_ratio(new, old, mask).exp()
    tokens = (new - old).exp()
    assert float(ratio[0]) == pytest.approx(float(tokens[0].prod() ** (1 / 3)))
    assert float(ratio[1]) == pytest.approx(2.0)  # every token ratio 2: the action's is 2
    assert float(tokens[0].min()) <= float(ratio[0]) <= float(tokens[0].max())
    one = torch.tensor([[1.0, 0.0, 0.0]])
    assert float(sequence_log_ratio(new[:1], old[:1], one).exp()) == pytest.approx(float(tokens[0, 0]))  # m = 1
    assert float(sequence_log_ratio(old, old, mask).exp()[0]) == 1.0  # π_θ = π_old


# -------------------------------------------------------------------------------------------- StepPO


def test_step_gae_limits_and_one_token_actions_are_token_level_gae() -> None:
    r = torch.tensor([0.7])
    steps = StepBatch(torch.tensor([0]), torch.tensor([0]), torch.tensor([1]), torch.tensor([0.7]))
    v = torch.tensor([0.25])
    assert float(step_gae(r, torch.tensor([0]), steps, v, gamma=0.9, lam=1.0)[0]) == pytest.approx(0.45)
    # one episode of 5 one-token steps: token-level GAE over those tokens with the same values
    rs, vs = [0.0, 0.1, 0.0, -0.2, 1.0], [0.3, 0.5, 0.2, 0.4, 0.9]
    gamma, lam = 0.99, 0.95
    steps = StepBatch(torch.zeros(5).long(), torch.arange(5), torch.arange(5), torch.tensor(rs))
    got = step_gae(torch.full((5,), sum(rs)), torch.zeros(5).long(), steps, torch.tensor(vs), gamma, lam)
    want, running = [0.0] * 5, 0.0
    for t in reversed(range(5)):
        nxt = vs[t + 1] if t + 1 < 5 else 0.0
        running = rs[t] + gamma * nxt - vs[t] + gamma * lam * running
        want[t] = running
    torch.testing.assert_close(got, torch.tensor(want).double())
    # broadcast to the step's action tokens, 0 on the rest
    mask = torch.tensor([[1, 1, 0]] * 5)
    tokens = to_tokens(got, mask)
    assert torch.equal(tokens[:, 2], torch.zeros(5)) and torch.equal(tokens[:, 0], tokens[:, 1])


# ------------------------------------------------------------------------------------- options, config


def test_bad_options_name_the_option() -> None:
    assert option_problems("advantage", "gigpo", {"step_weight": -1.0})[0][0] == "step_weight"
    assert option_problems("advantage", "gigpo", {"gamma": 0.0})[0][0] == "gamma"
    assert option_problems("advantage", "hgpo", {"levels": -1})[0][0] == "levels"
    assert option_problems("advantage", "hgpo", {"alpha": -1.0})[0][0] == "alpha"
    assert option_problems("advantage", "gagpo", {"lam": 1.5})[0][0] == "lam"
    assert option_problems("advantage", "gagpo", {"omega": 1.0})[0][0] == "omega"  # not an option of gagpo
    assert option_problems("advantage", "hgpo", {"levels": 2, "alpha": 0.5, "episode_weight": 1.0}) == []


def _errors(cfg: RLConfig) -> str:
    with pytest.raises(ConfigError) as e:
        validate_rl_config(cfg, 1)
    return str(e.value)


def test_a_step_level_estimator_needs_stepwise_episodes_in_every_domain() -> None:
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    demo = os.path.join(root, "configs", "agentic_demo.yaml")
    for name, options in (("gigpo", "{step_weight: 0.5}"), ("hgpo", "{levels: 2}"), ("gagpo", "{lam: 0.9}")):
        validate_rl_config(
            load_config(RLConfig, demo, [f"algorithm.advantage={name}", f"algorithm.advantage_options={options}"]), 1
        )
    msg = _errors(load_config(RLConfig, os.path.join(root, "configs", "demo.yaml"), ["algorithm.advantage=gigpo"]))
    assert "algorithm.advantage: 'gigpo' is a step-level estimator" in msg and "single-turn" in msg
    cfg = load_config(RLConfig, demo, ["algorithm.advantage=hgpo"])
    assert cfg.data.domains[0].environment is not None
    cfg.data.domains[0].environment.trajectory = "conversation"
    assert "data.domains[0].environment.trajectory: is 'conversation'" in _errors(cfg)
    msg = _errors(
        load_config(RLConfig, demo, ["algorithm.advantage=gagpo", "algorithm.advantage_options={gamma: 2.0}"])
    )
    assert "algorithm.advantage_options.gamma" in msg
    msg = _errors(load_config(RLConfig, demo, ["algorithm.advantage=gigpo", "rollout.group_size=1"]))
    assert "rollout.group_size" in msg


# ------------------------------------------------------------------------------ the per-turn baseline


def _bias_tool() -> ModuleType:
    """benchmarks/turn_baseline_bias.py as a module (benchmarks/ is not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "turn_baseline_bias.py"
    spec = importlib.util.spec_from_file_location("turn_baseline_bias", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_per_turn_index_baseline_is_biased_by_the_episode_length_and_gigpo_is_not() -> None:
    """Guess-the-number through the real `Episode`: a right guess ends the game, so the policy decides
    the length. The per-episode baseline (GiGPO's episode term) gives each length the return's own
    difference (shrunk by 1 − 1/G); the per-turn-index one moves with the length (a length bias)."""
    tool = _bias_tool()
    samples = tool.play_groups(100, 8, 0.3, 0)
    assert {s.info["episode/turns"] for s in samples} == {1, 2, 3}
    table = tool.bias_table(samples, 8)
    episode = table["per episode (gigpo, step_weight 0): deviation"]
    turn = table["per turn index (counter-example): deviation"]
    assert all(abs(episode[t]) < 0.05 for t in (1, 2, 3)), episode
    assert turn[1] - turn[3] > 0.15, turn  # the baseline grows with the turns the episode played


def test_moments_within_is_the_loop_over_each_sets_valid_values():
    """The one helper every step-level estimator takes its statistics from: per sample, count, mean and
    population variance of the valid values sharing its id (NaN on an invalid sample never counts);
    `normalized_within` divides by Bessel's std (GiGPO, HGPO) or the population std (GAGPO)."""
    rng = random.Random(3)
    ids = torch.tensor([rng.choice([7, -2, 40, 5]) for _ in range(40)])
    values = torch.tensor([rng.gauss(0, 2) for _ in range(40)], dtype=torch.float64)
    ok = torch.tensor([rng.random() > 0.3 for _ in range(40)])
    values[~ok] = float("nan")
    count, mean, var = moments_within(values, ids, ok)
    for adv_bessel in (True, False):
        adv, defined = normalized_within(values, ids, ok, True, 1e-6, bessel=adv_bessel)
        for i in range(40):
            same = [float(values[j]) for j in range(40) if ids[j] == ids[i] and ok[j]]
            n = len(same)
            assert count[i] == n
            if n:
                mu = sum(same) / n
                pvar = sum((x - mu) ** 2 for x in same) / n
                assert math.isclose(float(mean[i]), mu, abs_tol=1e-12)
                assert math.isclose(float(var[i]), pvar, abs_tol=1e-12)
                if ok[i] and n > 1:
                    std = math.sqrt(pvar * n / (n - 1) if adv_bessel else pvar)
                    assert bool(defined[i])
                    assert math.isclose(float(adv[i]), (float(values[i]) - mu) / (std + 1e-6), rel_tol=1e-9)
            assert bool(defined[i]) == (bool(ok[i]) and n > 1)
