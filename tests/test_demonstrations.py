"""The SFT warm start of an environment domain: its scripted player's turns (`agent/demonstrations.py`).

A demonstrated turn must be trained on exactly the ids an RL sample of that turn has (else the warm
start teaches a prompt format the rollouts never show), only the player's tokens are targets, the
held-out (prompt, state) pairs are never played, and the players are as strong as the baselines the
demo is read against (`benchmarks/guess_number_baselines.py`).
"""

from __future__ import annotations

import random

import pytest

from mcore_rl.agent.demonstrations import domain_rows, environment_rows, play
from mcore_rl.agent.groups import EpisodeGroups, environment_examples
from mcore_rl.config import RLConfig, load_config
from mcore_rl.config.errors import ConfigError
from mcore_rl.config.rl_validate import validate_rl_config
from mcore_rl.data.domains import HELD_OUT_SEED_OFFSET, domain_pools, read_domain_files, training_pool
from mcore_rl.data.prompts import VALIDATION_SEED_OFFSET
from mcore_rl.data.samples import Prompt
from mcore_rl.data.tokenizer import load_tokenizer
from mcore_rl.envs import env_has_player, make_env
from mcore_rl.envs.base import AgentAction
from mcore_rl.data.tool_calls import ParsedTurn

DEMO = "configs/agentic_demo.yaml"


def demo_config(*overrides: str) -> RLConfig:
    return load_config(RLConfig, DEMO, ["init.sft_steps=10", *overrides])


@pytest.mark.parametrize("trajectory,memory_k", [("stepwise", 0), ("stepwise", 1), ("conversation", 0)])
def test_a_played_turn_is_the_ids_of_that_turns_rl_sample(trajectory: str, memory_k: int) -> None:
    cfg = demo_config(
        f"data.domains[0].environment.trajectory={trajectory}", f"data.domains[0].environment.memory_k={memory_k}"
    )
    tok = load_tokenizer(None)
    groups = EpisodeGroups.from_config(cfg, tok)
    assert groups is not None
    prompt = Prompt(3, "guess 2-8", [], {"lo": 2, "hi": 8, "secret": 7}, "guess")
    (episode,) = groups.episodes(prompt, [{}])
    rows = play(episode, random.Random(0))
    assert 1 <= len(rows) <= 3
    end = tok.encode("<|im_end|>")
    for ids, target in rows:  # the targets: the player's digit and the end of the model's turn
        said = [i for i, t in zip(ids, target) if t]
        assert target == [0] * (len(ids) - len(said)) + [1] * len(said)
        assert said[-1:] == end and tok.decode(said[:-1]).isdigit()
    samples = episode.samples()
    if trajectory == "stepwise":  # one RL sample per step: prompt + response ids, row for row
        assert [s.prompt.ids + s.response_ids for s in samples] == [ids for ids, _ in rows]
    else:  # one growing conversation: each turn's row is a prefix of the episode's sample
        (sample,) = samples
        full = sample.prompt.ids + sample.response_ids
        assert all(full[: len(ids)] == ids for ids, _ in rows)


def test_players_are_as_strong_as_the_baselines_they_stand_for() -> None:
    """range 38.5 %, open 69.1 %, middle 96.9 % on the demo's options (20,000 games in the benchmark)."""
    options = {"lo": 1, "hi": 9, "min_span": 6, "max_guesses": 3, "feedback": "interval"}
    from mcore_rl.envs import env_prompts

    games = env_prompts("guess_number", **options).examples(3000, 5)
    for player, want in (("range", 0.385), ("open", 0.691), ("middle", 0.969)):
        rng, solved = random.Random(1), 0
        for j, (text, label) in enumerate(games):
            env = make_env("guess_number", **options, player=player)
            env.reset(Prompt(j, text, [], label), seed=j)
            for _ in range(3):
                guess = env.demonstrate(rng)
                assert guess is not None
                step = env.step(AgentAction(guess, ParsedTurn(guess)))
                if step.done:
                    solved += bool(step.info.get("solved"))
                    break
        assert abs(solved / len(games) - want) < 0.03, (player, solved / len(games))


def test_the_warm_start_never_plays_a_held_out_state() -> None:
    cfg = demo_config()
    files = read_domain_files(cfg)
    pools = domain_pools(cfg, 0, files, HELD_OUT_SEED_OFFSET, VALIDATION_SEED_OFFSET, environment_examples)
    train = training_pool(cfg, 0, environment_examples)
    held = {(t, repr(label)) for t, label in pools.eval}
    assert held and train and not held & {(t, repr(label)) for t, label in train}
    # the rows come from the pool given: one prompt in, every row opens with it
    tok = load_tokenizer(None)
    groups = EpisodeGroups.from_config(cfg, tok)
    assert groups is not None
    rows = domain_rows(groups, "guess", [("guess 4-9", {"lo": 4, "hi": 9, "secret": 6})], 20, 0)
    opening = tok.encode("<|im_start|>user\nguess 4-9<|im_end|>\n")
    assert len(rows) == 20 and all(ids[: len(opening)] == opening for ids, _ in rows)
    # the whole warm start: turns shared out by the mixture weights, seeded
    first, again = environment_rows(cfg, tok, 200, 7), environment_rows(cfg, tok, 200, 7)
    assert len(first) == 200 and first == again


def test_warm_start_rules_name_the_key() -> None:
    def errors(cfg: RLConfig) -> str:
        try:
            validate_rl_config(cfg, 1)
        except ConfigError as err:
            return str(err)
        return ""

    assert env_has_player("guess_number") and not env_has_player("frozen_lake")
    assert errors(demo_config()) == ""
    cfg = demo_config()
    env = cfg.data.domains[0].environment
    assert env is not None
    env.name, env.options = "frozen_lake", {}
    assert "init.sft_steps: the SFT warm start trains on the answers of task or reasoning-gym domains" in errors(cfg)
    cfg = demo_config()
    cfg.data.domains[0].environment.options["player"] = "best"  # type: ignore[union-attr]  # the demo has one
    assert "option 'player' must be 'open', 'range' or 'middle', got 'best'" in errors(cfg)


def test_a_player_turn_longer_than_the_turn_budget_is_refused() -> None:
    cfg = demo_config()
    cfg.data.domains[0].environment.options.update(lo=10, hi=19)  # type: ignore[union-attr]  # the demo has one
    tok = load_tokenizer(None)
    groups = EpisodeGroups.from_config(cfg, tok)
    assert groups is not None
    (episode,) = groups.episodes(Prompt(0, "guess 10-19", [], {"lo": 10, "hi": 19, "secret": 15}, "guess"), [{}])
    with pytest.raises(
        ValueError, match=r"has 3 tokens, more than a model turn may have \(2: environment.max_tokens_per_turn\)"
    ):
        play(episode, random.Random(0))
    # a whole domain of such turns stops the warm start with that error (a few would be left out)
    pool = [(f"guess 10-{hi}", {"lo": 10, "hi": hi, "secret": 12}) for hi in (15, 16, 17)]
    with pytest.raises(ValueError, match="more than a model turn may have"):
        domain_rows(groups, "guess", pool, 10, 0)


def test_the_reasoning_tools_player_calls_the_calculator_in_the_domains_format() -> None:
    from mcore_rl.config.rl_schema import DomainConfig, EnvironmentConfig

    cfg = load_config(RLConfig, None, ["init.sft_steps=10", "rollout.max_new_tokens=200"])
    env = EnvironmentConfig(
        name="reasoning_tools",
        options={"dataset": "basic_arithmetic", "tools": ["calculator"], "max_turns": 2},
        tool_format="hermes",
        max_turns=2,
        max_tokens_per_turn=120,
    )
    cfg.data.domains = [DomainConfig(name="arith", environment=env)]
    tok = load_tokenizer(None)
    groups = EpisodeGroups.from_config(cfg, tok, capped=False)
    assert groups is not None
    text, label = training_pool(cfg, 0, environment_examples)[0][:2]
    (episode,) = groups.episodes(Prompt(0, text, [], label, "arith"), [{}])
    rows = play(episode, random.Random(0))
    said = [tok.decode([i for i, t in zip(ids, target) if t]) for ids, target in rows]
    expression = label["metadata"]["expression"]
    assert said == [
        f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call><|im_end|>',
        f"<answer>{label['answer']}</answer><|im_end|>",
    ]
    assert episode.events == {"tool_call": 1} and episode.episode_return == 1.0
    # environments know no tool-call format: a domain without one cannot carry the player's calls
    env.tool_format = "none"
    (episode,) = groups.episodes(Prompt(0, text, [], label, "arith"), [{}])
    with pytest.raises(ValueError, match="the scripted player calls tools, but the domain's environment.tool_format"):
        play(episode, random.Random(0))


def test_the_tool_demo_recipe_plays_stepwise_within_its_rows_and_keys_states_by_the_call() -> None:
    """configs/agentic_tool_demo.yaml: valid with every step-level estimator; its scripted player's two
    steps (the call, the answer) fit the warm start's rows, and the answer step's state names the call
    and what the calculator said (the state step-level credit groups by)."""
    recipe = "configs/agentic_tool_demo.yaml"
    for name in ("grpo", "gigpo", "hgpo", "gagpo"):
        validate_rl_config(load_config(RLConfig, recipe, [f"algorithm.advantage={name}"]), 1)
    cfg = load_config(RLConfig, recipe, ["init.sft_steps=10"])
    tok = load_tokenizer(None)
    groups = EpisodeGroups.from_config(cfg, tok, capped=False)  # as the warm start plays
    assert groups is not None
    text, label = training_pool(cfg, 0, environment_examples)[0][:2]
    (episode,) = groups.episodes(Prompt(0, text, [], label, "calc"), [{}])
    rows = play(episode, random.Random(0))
    assert len(rows) == 2 and all(len(ids) <= cfg.init.sft.train.seq_length for ids, _ in rows)
    assert episode.episode_return == 1.0
    states = [s.info["state"] for s in episode.samples()]
    expression = label["metadata"]["expression"]
    assert states[0] == "turn 0" and states[1].startswith("turn 1\ncalculator")
    assert expression in states[1] and states[1].endswith(f"-> {label['answer']}")
