"""The environment registry, guess-the-number, and the guard every environment runs behind."""

from __future__ import annotations

import math
import threading
import time

import pytest

from mcore_rl.data.samples import Prompt
from mcore_rl.data.tool_calls import ParsedTurn
from mcore_rl.envs import env_names, env_options, env_prompts, env_tools, make_env
from mcore_rl.envs.base import AgentAction, Environment, EnvReset, EnvStep
from mcore_rl.envs.guard import EnvGuards, EpisodeFailed, GuardedEnv
from mcore_rl.envs.guess_number import GuessNumberEnv
from mcore_rl.envs.truncation import truncate


def act(text: str) -> AgentAction:
    return AgentAction(text=text, parsed=ParsedTurn(content=text))


def prompt(text: str, label: object = None, index: int = 0) -> Prompt:
    return Prompt(index=index, text=text, ids=[], label=label)


# ------------------------------------------------------------------------------------------ registry


def test_registry_names_and_unknown_names() -> None:
    assert "guess_number" in env_names()
    with pytest.raises(KeyError, match="unknown environment 'nope'; registered: .*guess_number"):
        make_env("nope")


def test_unknown_or_bad_option_is_named() -> None:
    with pytest.raises(ValueError, match="environment 'guess_number' has no option 'hii'; its options: lo, hi"):
        make_env("guess_number", hii=3)
    with pytest.raises(ValueError, match="option 'hi' \\(1\\) must be above 'lo' \\(5\\)"):
        env_options("guess_number", lo=5, hi=1)


def test_prompts_are_seeded_and_carry_the_secret() -> None:
    source = env_prompts("guess_number", lo=1, hi=8)
    a, b, c = source.examples(20, seed=3), source.examples(20, seed=3), source.examples(20, seed=4)
    assert a == b and a != c
    assert {text for text, _ in a} == {"guess 1-8"}
    assert all(1 <= secret <= 8 for _, secret in a)


# ------------------------------------------------------------------------------------------ guess-the-number


def play(env: Environment, guesses: list[str]) -> list[EnvStep]:
    return [env.step(act(g)) for g in guesses]


def test_binary_search_wins_and_feedback_narrows_the_state() -> None:
    env = make_env("guess_number", lo=1, hi=16, max_guesses=6, turn_penalty=0.1)
    start = env.reset(prompt("guess 1-16", label=11), seed=0)
    assert start.messages == [{"role": "user", "content": "guess 1-16"}] and start.state == "1-16"
    steps = play(env, ["8", "12", "I say 10", "11"])
    assert [s.messages[0]["content"] for s in steps] == ["higher", "lower", "higher", "yes"]
    assert [s.state for s in steps] == ["9-16", "9-11", "11-11", "solved"]
    assert [s.done for s in steps] == [False, False, False, True]
    assert steps[-1].reward == pytest.approx(0.7) and steps[-1].info["solved"] is True


def test_invalid_guesses_are_counted_and_cost_a_turn() -> None:
    env = make_env("guess_number", lo=1, hi=4, max_guesses=2)
    env.reset(prompt("guess 1-4", label=3), seed=0)
    first, second = play(env, ["no idea", "99"])
    assert first.info["events"] == {"invalid_action": 1} and first.messages[0]["content"] == "say a number 1-4"
    assert second.done and second.reward == 0.0 and second.info["solved"] is False


def test_same_prompt_and_seed_same_start() -> None:
    """Without a label the secret comes from the reset seed: a group's copies play the same game."""

    def outcome(seed: int) -> list[str]:
        env = make_env("guess_number", lo=1, hi=100, max_guesses=3)
        env.reset(prompt("guess 1-100"), seed=seed)
        return [s.messages[0]["content"] for s in play(env, ["50", "25", "75"])]

    assert outcome(7) == outcome(7)
    assert len({tuple(outcome(s)) for s in range(8)}) > 1
    with pytest.raises(ValueError, match="secret 17 is outside 1-16"):
        GuessNumberEnv(env_options("guess_number")).reset(prompt("guess 1-16", label=17), seed=0)


def test_interval_feedback_and_a_range_per_prompt() -> None:
    """`feedback: interval` names the numbers still open; `min_span` draws a range per prompt (in the text
    and the label), so (range, secret) pairs can be held out; guesses outside the prompt's range are invalid."""
    options = {"lo": 1, "hi": 9, "min_span": 6, "max_guesses": 3, "feedback": "interval"}
    drawn = env_prompts("guess_number", **options).examples(200, 3)
    assert all(t == f"guess {lab['lo']}-{lab['hi']}" and lab["hi"] - lab["lo"] >= 5 for t, lab in drawn)
    assert all(lab["lo"] <= lab["secret"] <= lab["hi"] for _, lab in drawn)
    assert len({(t, lab["secret"]) for t, lab in drawn}) > 40
    env = make_env("guess_number", **options)
    start = env.reset(prompt("guess 3-9", label={"lo": 3, "hi": 9, "secret": 8}), seed=0)
    assert start.messages == [{"role": "user", "content": "guess 3-9"}] and start.state == "3-9"
    steps = play(env, ["2", "6", "8"])
    assert [s.messages[0]["content"] for s in steps] == ["say a number 3-9", "higher 7-9", "yes"]
    assert steps[0].info["events"] == {"invalid_action": 1} and steps[-1].reward == 1.0
    with pytest.raises(ValueError, match="option 'min_span' must be 0 .* or 2..9"):
        env_options("guess_number", lo=1, hi=9, min_span=10)
    with pytest.raises(ValueError, match="option 'feedback' must be 'direction' or 'interval'"):
        env_options("guess_number", feedback="hot")
    with pytest.raises(ValueError, match="range 0-5 is outside 1-9"):
        env.reset(prompt("guess 0-5", label={"lo": 0, "hi": 5, "secret": 2}), seed=0)


# ------------------------------------------------------------------------------------------ the guard


class Raises(Environment):
    def __init__(self, where: str) -> None:
        self.where, self.closed = where, 0

    def reset(self, prompt: Prompt, seed: int) -> EnvReset:
        if self.where == "reset":
            raise RuntimeError("board file missing")
        return EnvReset([{"role": "user", "content": "go"}])

    def step(self, action: AgentAction) -> EnvStep:
        raise KeyError("no such move")

    def close(self) -> None:
        self.closed += 1


class Hangs(Environment):
    def __init__(self, where: str) -> None:
        self.where, self.release = where, threading.Event()

    def reset(self, prompt: Prompt, seed: int) -> EnvReset:
        if self.where == "reset":
            self.release.wait(30)
        return EnvReset([{"role": "user", "content": "go"}])

    def step(self, action: AgentAction) -> EnvStep:
        self.release.wait(30)
        return EnvStep([])

    def close(self) -> None:
        self.release.set()  # a real environment would kill what it runs


class Returns(Environment):
    """Steps with whatever it is given: a huge observation, a NaN reward, a bad message, a non-step."""

    def __init__(self, step: object) -> None:
        self.out = step

    def reset(self, prompt: Prompt, seed: int) -> EnvReset:
        return EnvReset([{"role": "user", "content": "go"}])

    def step(self, action: AgentAction) -> EnvStep:
        return self.out  # type: ignore[return-value]  # invalid on purpose: what the guard must catch


def test_a_raising_reset_costs_the_episode_and_closes_it() -> None:
    env = Raises("reset")
    with pytest.raises(EpisodeFailed, match="env_error: RuntimeError: board file missing") as info:
        GuardedEnv(env).reset(prompt("p"), 0)
    assert info.value.reason == "env_error" and env.closed == 1


def test_a_raising_step_ends_the_episode_with_its_reason() -> None:
    env = Raises("step")
    guarded = GuardedEnv(env)
    guarded.reset(prompt("p"), 0)
    out = guarded.step(act("x"))
    assert out.done and out.reward == 0.0 and out.messages == []
    assert out.info["end_reason"] == "env_error" and "no such move" in out.info["end_detail"]
    assert out.info["events"] == {"env_error": 1} and env.closed == 1
    assert guarded.step(act("x")).info["end_reason"] == "step_after_done"


@pytest.mark.parametrize("where", ["reset", "step"])
def test_a_hanging_environment_times_out(where: str) -> None:
    env = Hangs(where)
    guarded = GuardedEnv(env, EnvGuards(step_timeout_s=0.3))
    t0 = time.monotonic()
    if where == "reset":
        with pytest.raises(EpisodeFailed, match="env_timeout: reset ran past 0.3 s"):
            guarded.reset(prompt("p"), 0)
    else:
        guarded.reset(prompt("p"), 0)
        out = guarded.step(act("x"))
        assert out.done and out.info["end_reason"] == "env_timeout"
    assert time.monotonic() - t0 < 5
    assert env.release.is_set()  # closed: the hung call is released by the environment's own close


def test_a_huge_observation_is_cut_and_counted() -> None:
    huge = EnvStep([{"role": "user", "content": "A" * 50_000 + "END"}], reward=1)
    guarded = GuardedEnv(Returns(huge), EnvGuards(max_observation_chars=1000, truncate_side="left"))
    guarded.reset(prompt("p"), 0)
    out = guarded.step(act("x"))
    text = out.messages[0]["content"]
    assert len(text) <= 1000 and text.endswith("END") and "chars cut" in text
    assert out.info["events"] == {"observation_truncated": 1} and not out.done
    assert isinstance(out.reward, float) and out.reward == 1.0


@pytest.mark.parametrize(
    ("step", "detail"),
    [
        (EnvStep([], reward=math.nan), "reward is nan"),
        (EnvStep([], reward="1"), "reward is '1'"),  # type: ignore[arg-type]  # a wrong type on purpose: the check is what is tested
        (EnvStep([{"role": "robot", "content": "hi"}]), "messages[0] is not a chat message"),
        (EnvStep([], done=1), "done is 1"),  # type: ignore[arg-type]  # a wrong type on purpose: the check is what is tested
        (EnvStep([], info={"events": {"x": "many"}}), "events"),
        ({"messages": []}, "step returned dict, not EnvStep"),
    ],
)
def test_an_invalid_step_ends_the_episode(step: object, detail: str) -> None:
    guarded = GuardedEnv(Returns(step))
    guarded.reset(prompt("p"), 0)
    out = guarded.step(act("x"))
    assert out.done and out.info["end_reason"] == "env_invalid" and detail in out.info["end_detail"]


def test_max_turns_ends_the_episode() -> None:
    guarded = GuardedEnv(make_env("guess_number", max_guesses=10), EnvGuards(max_turns=2))
    guarded.reset(prompt("guess 1-16", label=16), 0)
    assert not guarded.step(act("1")).done
    last = guarded.step(act("2"))
    assert last.done and last.info["end_reason"] == "max_turns"


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_truncate_keeps_the_budget(side: str) -> None:
    text, cut = truncate("0123456789" * 100, 100, side)  # type: ignore[arg-type]  # the parametrized side is a str; truncate types it as the Literal of the same three
    assert cut and len(text) <= 100
    assert truncate("short", 100) == ("short", False)


def test_binary_search_solves_every_secret_in_the_default_budget() -> None:
    """The task is learnable in principle: the optimal policy always wins within `max_guesses`."""
    options = env_options("guess_number")
    for secret in range(options.lo, options.hi + 1):
        env = make_env("guess_number")
        env.reset(prompt("guess 1-16", label=secret), seed=0)
        lo, hi = options.lo, options.hi
        while True:
            guess = (lo + hi) // 2
            out = env.step(act(str(guess)))
            if out.done:
                break
            lo, hi = (guess + 1, hi) if out.messages[0]["content"] == "higher" else (lo, guess - 1)
        assert out.info["solved"], secret


def test_env_tools_says_which_environments_need_a_tool_call_format() -> None:
    assert env_tools("guess_number") == []
    assert [t.name for t in env_tools("reasoning_tools", tools=("calculator",))] == ["calculator"]
    assert [t.name for t in env_tools("reasoning_tools")] == ["python", "calculator"]


def test_the_guard_is_an_environment() -> None:
    guarded: Environment = GuardedEnv(make_env("guess_number"))
    assert guarded.reset(prompt("guess 1-16", label=5), 0).state == "1-16"
    assert guarded.step(act("5")).reward == 1.0


class BadStart(Environment):
    def __init__(self, start: object) -> None:
        self.start = start

    def reset(self, prompt: Prompt, seed: int) -> EnvReset:
        return self.start  # type: ignore[return-value]  # invalid on purpose: what the guard must catch

    def step(self, action: AgentAction) -> EnvStep:
        return EnvStep([])


@pytest.mark.parametrize(
    ("start", "detail"),
    [
        (EnvReset([{"role": "user", "content": "go"}], tools=["python"]), "EnvReset.tools is not a list of ToolSpec"),  # type: ignore[list-item]  # a wrong type on purpose: the check is what is tested
        (EnvReset([{"role": "user"}]), "EnvReset.messages[0] is not a chat message"),
        (None, "reset returned NoneType, not EnvReset"),
    ],
)
def test_an_invalid_start_costs_the_episode(start: object, detail: str) -> None:
    with pytest.raises(EpisodeFailed, match="env_invalid") as info:
        GuardedEnv(BadStart(start)).reset(prompt("p"), 0)
    assert detail in info.value.detail
