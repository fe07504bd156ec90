"""Privileged context from the environment: what the shipped games know and the policy must not see
(the moves from a state to the goal, how the episode ended), carried onto each sample of a multi-turn
episode for the privileged self-teacher that SDAR and SEED score with, and the config check that a
teacher reading one is routed only to environments that give it. Real gymnasium games, the real
episode runner, the real teacher's prompt building and the real config validation."""

from __future__ import annotations

import asyncio
import os

import pytest

from mcore_rl.agent.episodes import Episode, EpisodeSettings, run_episode
from mcore_rl.config.loader import load_config
from mcore_rl.config.rl_schema import RLConfig
from mcore_rl.config.rl_validate import validate_rl_config
from mcore_rl.config.rules import ConfigError
from mcore_rl.data.samples import Prompt
from mcore_rl.data.tool_calls import ParsedTurn
from mcore_rl.envs import env_entry, make_env
from mcore_rl.envs.base import AgentAction
from mcore_rl.envs.gym_text import GymTextEnv
from mcore_rl.rollout.pool import Generation, GenRequest
from tests.helpers import TOK


def _play(env: GymTextEnv, moves: list[str]) -> None:
    for m in moves:
        env.step(AgentAction(m, ParsedTurn(m)))


def _fresh(name: str, seed: int, **options) -> GymTextEnv:
    env = make_env(name, **options)
    assert isinstance(env, GymTextEnv)
    env.reset(Prompt(index=0, text="x", ids=[1], label={"seed": seed}), 0)
    return env


@pytest.mark.parametrize("name,options", [("frozen_lake", {"size": 6}), ("taxi", {})])
def test_the_solution_plays_to_the_goal_from_every_state_on_the_way(name, options):
    for seed in range(3):
        env = make_env(name, max_turns=60, **options)
        start = env.reset(Prompt(index=0, text="x", ids=[1], label={"seed": seed}), 0)
        assert set(start.privileged) == {"solution"} and "Moves from here to the goal" in start.privileged["solution"]
        assert isinstance(env, GymTextEnv)
        moves = env.solution()
        assert moves
        for t, m in enumerate(moves):
            step = env.step(AgentAction(m, ParsedTurn(m)))
            if t < len(moves) - 1:  # the state reached has its own (one move shorter) solution
                assert not step.done
                assert step.info["privileged/solution"] == env.solution_text()
                assert len(env.solution() or []) == len(moves) - t - 1
        assert step.done and step.reward > 0 and "privileged/solution" not in step.info
        assert "ended after" in step.info["privileged/outcome"]
    assert env_entry(name).privileged == ("solution", "outcome")


def test_slippery_ice_has_no_solution_and_a_hole_is_an_outcome():
    assert _fresh("frozen_lake", 1, slippery=True).solution() is None
    env = make_env("frozen_lake", slippery=True)
    assert env.reset(Prompt(index=0, text="x", ids=[1], label={"seed": 1}), 0).privileged == {}
    env = _fresh("frozen_lake", 0, size=6)
    # walk until the episode ends (a hole or the wall turns out the 20 turns)
    step = None
    for _ in range(20):
        step = env.step(AgentAction("right", ParsedTurn("right")))
        if step.done:
            break
    assert step is not None and step.done and "ended after" in step.info["privileged/outcome"]


def test_guess_number_gives_the_secret():
    env = make_env("guess_number", lo=1, hi=9)
    start = env.reset(Prompt(index=0, text="x", ids=[1], label=7), 0)
    assert start.privileged == {"solution": "The secret number is 7."}
    step = env.step(AgentAction("3", ParsedTurn("3")))
    assert step.info["privileged/solution"] == "The secret number is 7."
    step = env.step(AgentAction("7", ParsedTurn("7")))
    assert step.done and step.info["privileged/outcome"] == "Solved: 7 on guess 2."


# ------------------------------------------------------------------------------ through episodes

LAKE = Prompt(index=3, text="lake", ids=[1], label={"seed": 0}, domain="lake")


def _episodes(trajectory: str, plans: list[list[str]]) -> list[Episode]:
    """G = len(plans) episodes of one 6x6 map, episode j playing plans[j] (a scripted generate: the
    per-turn sampling seed names the episode and the turn)."""
    settings = EpisodeSettings(
        trajectory=trajectory, memory_k=1, max_turns=20, max_tokens_per_turn=8, max_episode_tokens=4096
    )
    eps = [
        Episode(
            make_env("frozen_lake", size=6),
            LAKE,
            j,
            seed=0,
            tokenizer=TOK,
            settings=settings,
            sampling={"temperature": 1.0, "sampling_seed": 5 + j},
        )
        for j in range(len(plans))
    ]

    async def generate(req: GenRequest) -> Generation:
        s = int(req.sampling_params["sampling_seed"]) - 5
        j, turn = s % 7919, s // 7919
        ids = TOK.encode(plans[j][turn] if turn < len(plans[j]) else "left")
        return Generation(ids, [-1.0] * len(ids), 0, "stop", "", "e0")

    async def main() -> None:
        await asyncio.gather(*(run_episode(e, generate) for e in eps))

    asyncio.run(main())
    return eps


def test_stepwise_samples_carry_the_privileged_texts_of_the_state_they_acted_in():
    moves = _fresh("frozen_lake", 0, size=6).solution() or []
    ok, lost = _episodes("stepwise", [moves, ["up", "left"] * 10])
    assert ok.finish == "done" and ok.episode_return == 1.0 and ok.turns == len(moves)
    samples = ok.samples()
    assert len(samples) == len(moves)
    for t, s in enumerate(samples):
        replay = _fresh("frozen_lake", 0, size=6)
        _play(replay, moves[:t])
        assert s.info["privileged/solution"] == replay.solution_text()  # of state t, not t ± 1
        assert "(goal)" in s.info["privileged/outcome"]
        assert not any(k.startswith("env/privileged") for k in s.info)
    for s in lost.samples():  # never moved: the start's solution every step; ran out of turns
        assert s.info["privileged/solution"] == samples[0].info["privileged/solution"]
        assert "ended after 20 turns (max_turns)" in s.info["privileged/outcome"]


def test_a_conversation_carries_the_start_states_solution_and_the_outcome():
    moves = _fresh("frozen_lake", 0, size=6).solution() or []
    (ep,) = _episodes("conversation", [moves])
    assert ep.finish == "done"
    (s,) = ep.samples()
    assert s.info["privileged/solution"] == f"Moves from here to the goal: {', '.join(moves)}."
    assert "(goal)" in s.info["privileged/outcome"]


def test_the_privileged_teacher_puts_the_environments_text_before_each_steps_prompt():
    from mcore_rl.train.teachers import PrivilegedTeacher  # megatron-core: ~8 s

    moves = _fresh("frozen_lake", 0, size=6).solution() or []
    (ep,) = _episodes("stepwise", [moves])
    samples = ep.samples()
    teacher = PrivilegedTeacher(
        "sdar", TOK, 512, context="info", context_key="privileged/solution", template="Hint: {context}\n"
    )
    for s, p in zip(samples, teacher.privileged_samples(samples, samples)):
        assert p is not None and p.response_ids is s.response_ids
        head = 1 if s.prompt_ids and s.prompt_ids[0] == TOK.bos_id else 0
        hint = TOK.encode(f"Hint: {s.info['privileged/solution']}\n")
        assert p.prompt_ids == s.prompt_ids[:head] + hint + s.prompt_ids[head:]


# ------------------------------------------------------------------------------ config

DEMO = os.path.join(os.path.dirname(__file__), "..", "configs", "agentic_demo.yaml")


def _validate(*overrides: str) -> str:
    cfg = load_config(RLConfig, DEMO, list(overrides))
    try:
        validate_rl_config(cfg, 1)
    except ConfigError as err:
        return str(err)
    return ""


def test_a_teacher_reading_a_privileged_text_is_checked_against_the_environment():
    sdar = "distill.losses=[{name: sdar}]"
    assert _validate(sdar, "teachers=[{kind: privileged, context: info, context_key: privileged/solution}]") == ""
    assert _validate(sdar, "teachers=[{kind: privileged, context: info, context_key: privileged/outcome}]") == ""
    assert _validate("distill.losses=[{name: stepopsd}]", "teachers=[{kind: privileged, context: peer_episode}]") == ""
    msg = _validate(sdar, "teachers=[{kind: privileged, context: info, context_key: privileged/map}]")
    assert "teachers[0].context_key: environment 'guess_number' (domain 'guess') gives no 'privileged/map'" in msg
    assert "it gives: privileged/solution, privileged/outcome" in msg
    msg = _validate(
        sdar, "teachers=[{kind: privileged, context: info, context_key: privileged/solution, domains: [other]}]"
    )
    assert "no environment domain is routed here" in msg


def test_peer_episode_context_is_the_first_successful_other_episode_in_step_order():
    """StepOPSD's hindsight (`context: peer_episode`): a failed episode's steps see the turns of the first
    successful peer episode of their group, in step order; the successful episode has no other success."""
    from mcore_rl.train.teachers import privileged_context

    moves = _fresh("frozen_lake", 0, size=6).solution() or []
    ok, lost = _episodes("stepwise", [moves, ["up", "left"] * 10])
    won, failed = ok.samples(), lost.samples()
    batch = failed + won  # batch order puts the failure first: it is no success, so it is skipped
    want = "\n".join(f"Step {k + 1}: {s.text.strip()}" for k, s in enumerate(won))
    assert all(m in want for m in moves) and want.count("Step ") == len(moves)
    for s in failed:
        assert privileged_context(s, batch, "peer_episode") == want
    assert all(privileged_context(s, batch, "peer_episode") is None for s in won)
    assert privileged_context(failed[0], batch, "peer_episode", peer_min_reward=2.0) is None
