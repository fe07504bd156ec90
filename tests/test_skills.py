"""Trace2Skill's skill library (`agent/skills.py`): the spec's merge-depth and guardrail properties, the
analysts over traces, retrieval, and the library built from real FrozenLake episodes (the real episode
runner, a scripted turn generator) put into a held-out episode's prompt."""

from __future__ import annotations

import asyncio
import os
import math

import pytest

from mcore_rl.agent.episodes import Episode, EpisodeSettings, run_episode
from mcore_rl.agent.skills import (
    Patch,
    SkillLibrary,
    Trace,
    analyse,
    library_from_traces,
    merge,
    merge_depth,
    trace_of,
)
from mcore_rl.data.samples import Prompt
from mcore_rl.data.tool_calls import ParsedTurn
from mcore_rl.envs import make_env
from mcore_rl.envs.base import AgentAction
from mcore_rl.envs.frozen_lake import FrozenLakeEnv
from mcore_rl.envs.gym_text import GymTextEnv, parse_action
from mcore_rl.envs.skills import SkilledEnv
from mcore_rl.rollout.pool import Generation, GenRequest
from tests.helpers import TOK


def test_merge_depth_is_ceil_log_b():
    """Property 1: L = ceil(log_B |P|): 1 -> 0, 16 with B = 4 -> 2, 17 with B = 4 -> 3."""
    assert merge_depth(1, 4) == 0 and merge_depth(16, 4) == 2 and merge_depth(17, 4) == 3
    for n in range(1, 70):
        for b in (2, 3, 4, 7):
            assert merge_depth(n, b) == math.ceil(round(math.log(n, b), 9))
    with pytest.raises(ValueError, match="branching"):
        merge_depth(3, 1)


@pytest.mark.parametrize("n,b", [(1, 4), (5, 2), (16, 4), (17, 4), (40, 3)])
def test_each_level_takes_n_sets_to_ceil_n_over_b_and_ends_in_one(n, b):
    """Property 2: the hierarchical merge takes L levels; with all patches distinct nothing is lost,
    with all equal they end as one patch whose support is n."""
    distinct = [Patch("do", f"s{i}", f"lesson {i}") for i in range(n)]
    merged, levels = merge(distinct, b)
    assert levels == merge_depth(n, b) and len(merged) == n and all(p.support == 1 for p in merged)
    same, levels = merge([Patch("avoid", "s", "x")] * n, b)
    assert levels == merge_depth(n, b) and same == [Patch("avoid", "s", "x", n)]


def test_one_offs_are_dropped_and_the_guardrail_refuses_unknown_sections():
    patches = [Patch("do", "a", "x"), Patch("do", "a", "x"), Patch("avoid", "b", "y"), Patch("do", "a", "z")]
    merged, _ = merge(patches, 2, min_support=2)
    assert merged == [Patch("do", "a", "x", 2)]
    with pytest.raises(ValueError, match="section 'tips'"):  # property 3: a patch to a missing part
        merge([*patches, Patch("tips", "a", "x")], 2)


def test_the_analysts_record_what_worked_and_what_ended_an_episode():
    win = Trace(("s0", "s1"), ("right", "down"), success=True)
    assert analyse(win) == [Patch("do", "s0", "From a state like this, these moves reached the goal: right, down.")]
    hole = Trace(("s0", "s1", "s2"), ("right", "down", "down"), success=False, outcome="fell in (hole)\nboard")
    (p,) = analyse(hole)
    assert p.section == "avoid" and p.situation == "s2" and "'down' lost the episode (fell in (hole))" in p.lesson
    assert analyse(Trace(("s0",), ("up",), success=False, explained=False)) == []  # no cause: dropped


def test_retrieval_ranks_the_most_similar_situation_first(tmp_path):
    lib = SkillLibrary([Patch("do", "SFFF\nFHFH\nFFFH\nHFFG", "a"), Patch("do", "SFHF\nFFFF\nHHFH\nFFFG", "b")])
    assert [p.lesson for p in lib.retrieve("SFHF\nFFFF\nHHFH\nFFFG", 2)] == ["b", "a"]
    assert [p.lesson for p in lib.retrieve("SFFF\nFHFH\nFFFF\nHFFG", 1)] == ["a"]
    assert SkillLibrary().render("x", 3) == ""
    lib.save(str(tmp_path / "lib.jsonl"))
    assert SkillLibrary.load(str(tmp_path / "lib.jsonl")) == lib


def _play(starts: list[int], plans: list[list[str]], library: SkillLibrary | None = None) -> list[Episode]:
    """One FrozenLake episode per start seed, episode i playing plans[i] (a scripted generate)."""
    settings = EpisodeSettings(trajectory="stepwise", memory_k=0, max_turns=12, max_tokens_per_turn=8)
    eps = []
    for i, seed in enumerate(starts):
        env = make_env("frozen_lake")
        eps.append(
            Episode(
                SkilledEnv(env, library) if library is not None else env,
                Prompt(index=i, text="lake", ids=[1], label={"seed": seed}),
                i,
                seed=0,
                tokenizer=TOK,
                settings=settings,
                sampling={"temperature": 1.0, "sampling_seed": 5 + i},
            )
        )

    async def generate(req: GenRequest) -> Generation:
        s = int(req.sampling_params["sampling_seed"]) - 5
        i, turn = s % 7919, s // 7919
        ids = TOK.encode(plans[i][turn] if turn < len(plans[i]) else "up")
        return Generation(ids, [-1.0] * len(ids), 0, "stop", "", "e0")

    async def main() -> None:
        await asyncio.gather(*(run_episode(e, generate) for e in eps))

    asyncio.run(main())
    return eps


def test_a_library_from_real_episodes_goes_into_a_held_out_prompt():
    def solution(seed: int) -> list[str]:
        env = make_env("frozen_lake")
        assert isinstance(env, GymTextEnv)
        env.reset(Prompt(index=0, text="x", ids=[1], label={"seed": seed}), 0)
        return env.solution() or []

    seeds = [3, 4, 5]
    wins = _play(seeds, [solution(s) for s in seeds])
    losses = _play([6], [["down"] * 12])  # walks down until a hole or the bottom wall
    actions = FrozenLakeEnv.ACTIONS

    def action_of(text: str) -> str:
        k = parse_action(text, actions)
        return actions[k] if k is not None else text

    traces = [trace_of(e, action_of=action_of) for e in wins + losses]
    assert all(t.success for t in traces[:3]) and traces[0].actions == tuple(solution(3))
    lib = library_from_traces(traces, branching=2)
    assert sum(p.section == "do" for p in lib.skills) == 3
    # a held-out episode on seed 4's map (the same start state) gets seed 4's path first in its prompt
    (ep,) = _play([4], [[]], library=lib)
    first = ep.opening[0]["content"]
    assert first.startswith("Lessons from earlier games (3):")
    assert f"these moves reached the goal: {', '.join(solution(4))}." in first.split("- [")[1]
    assert ep.opening[0]["content"].endswith(
        make_env("frozen_lake").reset(Prompt(index=0, text="x", ids=[1], label={"seed": 4}), 0).messages[0]["content"]
    )
    step = SkilledEnv(make_env("frozen_lake"), lib)
    step.reset(Prompt(index=0, text="x", ids=[1], label={"seed": 4}), 0)
    assert step.step(AgentAction("up", ParsedTurn("up"))).state  # steps pass through


def test_the_tool_measures_held_out_success_with_and_without_the_library(tmp_path):
    """`tools/trace2skill.py --policy reader` end to end on 4x4 FrozenLake: the figures per seed, and a
    library whose `do` skills (the reader plays the retrieved path) lift the held-out start states the
    evolve set also played (a map seen in evolve is solved with its path)."""
    import importlib.util
    import json
    import os
    import sys

    path = os.path.join(os.path.dirname(__file__), "..", "tools", "trace2skill.py")
    spec = importlib.util.spec_from_file_location("trace2skill", path)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    sys.modules["trace2skill"] = tool
    spec.loader.exec_module(tool)
    out = tmp_path / "t.json"
    lib = tmp_path / "lib.jsonl"
    tool.main(
        ["--policy", "reader", "--option", "size=3", "--evolve", "24", "--test", "12", "--group", "4",
         "--max-turns", "12", "--seeds", "1", "--json", str(out), "--save-library", str(lib)]
    )  # fmt: skip
    (row,) = json.loads(out.read_text())["rows"]
    assert set(row) >= {"test_without", "test_with", "skills", "test_starts_seen_in_evolve", "unseen_test_with"}
    library = SkillLibrary.load(str(lib))
    assert len(library.skills) == row["skills"] and row["skills_do"] > 0 and row["test_starts_seen_in_evolve"] > 0
    assert row["test_with"] > row["test_without"]


# ------------------------------------------------------------------------------ in a training run


def test_ucb_tries_every_skill_first_then_prefers_what_paid():
    """`retrieval: ucb`: skills no episode has had come first (nearest situation first among them); once
    each was credited, the mean return plus c·sqrt(ln N / n) decides; `full` is every skill, `random`
    one draw per reset seed."""
    lib = SkillLibrary([Patch("do", s, f"l{i}") for i, s in enumerate(["aaaa", "aaab", "zzzz"])])
    assert lib.choose("aaaa", 2, "ucb") == [0, 1]  # untried: by similarity
    lib.credit([0, 1], 0.0)
    assert lib.choose("aaaa", 2, "ucb")[0] == 2  # the untried one before the tried
    lib.credit([2], 1.0)
    lib.credit([2], 1.0)
    assert lib.choose("aaaa", 1, "ucb", ucb_c=0.0) == [2]  # mean 1.0 against 0.0
    assert lib.uses == [1, 1, 2] and lib.gains == [0.0, 0.0, 2.0]
    # with a large c the rarely tried ones win back: bonus sqrt(ln 4 / 1) against sqrt(ln 4 / 2)
    assert lib.choose("aaaa", 1, "ucb", ucb_c=10.0) == [0]
    assert lib.choose("x", 1, "full") == [0, 1, 2]
    assert lib.choose("x", 2, "random", seed=7) == lib.choose("y", 2, "random", seed=7)
    assert len(set(lib.choose("x", 2, "random", seed=7))) == 2
    assert lib == SkillLibrary(lib.skills)  # the counts are not the document


def test_a_library_file_with_a_bad_line_names_it(tmp_path):
    path = tmp_path / "lib.jsonl"
    good = '{"section": "do", "situation": "s", "lesson": "l"}'
    for bad, why in (
        ("{not json", "Expecting property name"),
        ('{"section": "maybe", "situation": "s", "lesson": "l"}', "section 'maybe'"),
        ('{"section": "do", "situation": "s"}', "lesson"),
        ('{"section": "do", "situation": "s", "lesson": "l", "support": 0}', "support 0"),
        ("[1, 2]", "expected a JSON object, got list"),
    ):
        path.write_text(good + "\n\n" + bad + "\n")
        with pytest.raises(ValueError, match=rf"{path}:3: not a skill: .*{why}"):
            SkillLibrary.load(str(path))


def test_skills_into_privileged_reach_every_step_but_never_the_prompt():
    """`into: privileged`: the policy's messages are the environment's own; `privileged/skills` is in the
    start state's texts and in every step's info, so each step sample of an episode carries it."""
    lib = SkillLibrary([Patch("do", "SFFF", "go right")])
    plain = make_env("frozen_lake")
    prompt = Prompt(index=0, text="x", ids=[1], label={"seed": 4})
    want = plain.reset(prompt, 0)
    env = SkilledEnv(make_env("frozen_lake"), lib, into="privileged")
    start = env.reset(prompt, 0)
    assert start.messages == want.messages and start.privileged["skills"] == lib.text([0])
    step = env.step(AgentAction("up", ParsedTurn("up")))
    assert step.info["privileged/skills"] == lib.text([0])
    import random

    # a warm start plays the domain through the wrapper: the scripted player is the wrapped environment's
    from mcore_rl.envs import env_prompts

    text, label = env_prompts("guess_number").examples(1, 0)[0]
    fresh = SkilledEnv(make_env("guess_number"), lib, into="privileged")
    fresh.reset(Prompt(index=0, text=text, ids=[1], label=label), 0)
    assert fresh.demonstrate(random.Random(0)) == fresh.env.demonstrate(random.Random(0)) is not None
    settings = EpisodeSettings(trajectory="stepwise", memory_k=0, max_turns=3, max_tokens_per_turn=8)
    episode = Episode(
        SkilledEnv(make_env("frozen_lake"), lib, into="privileged"),
        prompt,
        0,
        seed=0,
        tokenizer=TOK,
        settings=settings,
        sampling={"temperature": 1.0, "sampling_seed": 5},
    )

    async def generate(req: GenRequest) -> Generation:
        ids = TOK.encode("up")
        return Generation(ids, [-1.0] * len(ids), 0, "stop", "", "e0")

    asyncio.run(run_episode(episode, generate))
    samples = episode.samples()
    assert len(samples) == 3 and all(s.info["privileged/skills"] == lib.text([0]) for s in samples)
    assert all("go right" not in TOK.decode(s.prompt_ids) for s in samples)


def test_a_domains_library_is_retrieved_and_credited_on_the_rollout_path(tmp_path):
    """`environment.skills` in a recipe: the validated library is loaded once per domain; every episode
    of a group gets its skills, and the episodes' returns are credited to the skills they had (the
    bandit's counts); a teacher may read `privileged/skills` only where the domain puts them there."""
    from mcore_rl.agent.groups import EpisodeGroups
    from mcore_rl.config import RLConfig, load_config
    from mcore_rl.config.errors import ConfigError
    from mcore_rl.config.rl_validate import validate_rl_config

    demo = os.path.join(os.path.dirname(__file__), "..", "configs", "agentic_demo.yaml")
    path = tmp_path / "lib.jsonl"
    SkillLibrary([Patch("do", "guess", "Start in the middle."), Patch("avoid", "x", "Do not repeat.")]).save(str(path))
    skills = f"data.domains[0].environment.skills={{path: {path}, k: 1, into: privileged, retrieval: ucb}}"
    teacher = "teachers=[{kind: privileged, context: info, context_key: privileged/skills}]"
    cfg = load_config(RLConfig, demo, [skills, teacher, "distill.losses=[{name: sdar}]"])
    validate_rl_config(cfg, 1)
    groups = EpisodeGroups.from_config(cfg, TOK)
    assert groups is not None
    prompt = groups_prompt(cfg, groups)

    async def generate(req: GenRequest) -> Generation:
        ids = TOK.encode("50")
        return Generation(ids, [-1.0] * len(ids), 0, "stop", "", "e0")

    samplings = [{"temperature": 1.0, "sampling_seed": 11 + j} for j in range(4)]
    samples = asyncio.run(groups.run_group(prompt, samplings, generate))
    library = groups.libraries[cfg.data.domains[0].name]
    # the episodes reset together, before any credit: all four had the nearer untried skill
    first = library.uses.index(4)
    assert sorted(library.uses) == [0, 4] and library.gains[first] == sum(
        s.reward for s in samples if s.step_index == 0
    )
    assert samples and all(s.info["privileged/skills"] == library.text([first]) for s in samples)
    asyncio.run(groups.run_group(prompt, samplings, generate))
    assert library.uses == [4, 4]  # the next group tries the other one

    # the warm start plays the domain's scripted player through the same wrapper
    from mcore_rl.agent.demonstrations import environment_rows

    rows = environment_rows(cfg, TOK, 4, 0)
    assert rows and all(sum(mask) > 0 for _, mask in rows)

    def error(*overrides: str) -> str:
        with pytest.raises(ConfigError) as info:
            validate_rl_config(load_config(RLConfig, demo, list(overrides)), 1)
        return str(info.value)

    key = "data.domains[0].environment.skills"
    assert f"{key}.path: domain 'guess': '{tmp_path}/none' is not a file" in error(f"{key}={{path: {tmp_path}/none}}")
    path.write_text('{"section": "do", "situation": "s", "lesson": "l"}\n{oops\n')
    msg = error(f"{key}={{path: {path}, k: 0, ucb_c: -1}}")
    assert f"{key}.path: domain 'guess': {path}:2: not a skill" in msg
    assert f"{key}.k: domain 'guess': must be >= 1, got 0" in msg and f"{key}.ucb_c" in msg
    path.write_text('{"section": "do", "situation": "s", "lesson": "l"}\n')
    msg = error(f"{key}={{path: {path}, into: prompt}}", teacher, "distill.losses=[{name: sdar}]")
    assert "teachers[0].context_key: environment 'guess_number' (domain 'guess') gives no 'privileged/skills'" in msg


def groups_prompt(cfg, groups) -> Prompt:
    """The first training prompt of the recipe's environment domain."""
    from mcore_rl.agent.groups import environment_examples

    domain = cfg.data.domains[0]
    text, label = environment_examples(domain, 1, 0)[0]
    return Prompt(index=0, text=text, ids=TOK.encode(text), domain=domain.name, label=label)
