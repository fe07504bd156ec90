"""The environments that ship: FrozenLake and Taxi as text, code repair over the code tasks, and
reasoning-gym with tools. Real gymnasium games, the real sandbox and the tasks' own scorers."""

from __future__ import annotations

from typing import Any

import pytest

from mcore_rl.data.samples import Prompt
from mcore_rl.data.tool_calls import ParsedTurn, ToolCall, parse_tool_calls, render_tool_calls
from mcore_rl.envs import env_entry, env_names, env_options, env_prompts, make_env
from mcore_rl.envs.base import AgentAction, Environment
from mcore_rl.envs.guard import EnvGuards, GuardedEnv
from mcore_rl.envs.gym_text import parse_action
from mcore_rl.envs.tools import ToolLimits

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def act(text: str, *calls: ToolCall) -> AgentAction:
    return AgentAction(text=text, parsed=ParsedTurn(content=text, calls=list(calls)))


def first_prompt(name: str, seed: int = 0, **options: Any) -> Prompt:
    text, label = env_prompts(name, **options).examples(1, seed)[0]
    return Prompt(index=0, text=text, ids=[], label=label)


def test_every_shipped_environment_is_registered_with_its_prompt_origin() -> None:
    assert {"code_repair", "frozen_lake", "guess_number", "reasoning_tools", "taxi"} <= set(env_names())
    assert env_entry("code_repair").origin == "task humaneval or tiny_code"
    assert env_entry("reasoning_tools").origin.startswith("reasoning-gym dataset")


def test_parse_action_takes_the_last_action_word() -> None:
    moves = ("left", "down", "right", "up")
    assert parse_action("Not left... I go RIGHT.", moves) == 2
    assert parse_action("upright", moves) is None  # whole words only


# ------------------------------------------------------------------------------------------ frozen lake

# with this seed the 4x4 map is (P = S at the start):
#   SFHF / FFFH / FFFF / HHFG
LAKE = {"seed": 1654615998}


def lake(**options: Any) -> Environment:
    env = make_env("frozen_lake", **options)
    env.reset(Prompt(0, "frozen lake 4x4 #0", [], LAKE), seed=0)
    return env


def test_frozen_lake_reaches_the_goal() -> None:
    env = lake()
    steps = [env.step(act(m)) for m in ["down", "I will go right", "down", "right", "down", "right"]]
    assert [s.reward for s in steps] == [0, 0, 0, 0, 0, 1.0]
    assert steps[-1].done and steps[-1].info["outcome"] == "goal"
    assert steps[0].state == "SFHF\nPFFH\nFFFF\nHHFG" and steps[0].messages[0]["content"] == steps[0].state
    env.close()


def test_frozen_lake_hole_invalid_moves_and_max_turns() -> None:
    env = lake()
    bad = env.step(act("jump"))
    assert bad.info["events"] == {"invalid_action": 1} and not bad.done
    assert "Say one move: left, down, right, up." in bad.messages[0]["content"]
    env.step(act("right"))
    hole = env.step(act("right"))
    assert hole.done and hole.reward == 0.0 and hole.info["outcome"] == "hole"
    short = lake(max_turns=2)
    short.step(act("left"))
    assert short.step(act("left")).info["end_reason"] == "max_turns"


def test_a_group_shares_the_map_and_prompts_differ() -> None:
    a, b = first_prompt("frozen_lake"), first_prompt("frozen_lake")
    assert a.label == b.label
    starts = {make_env("frozen_lake").reset(first_prompt("frozen_lake", s), 0).state for s in range(6)}
    assert len(starts) > 1  # different prompts, different maps


# ------------------------------------------------------------------------------------------ taxi


def test_taxi_delivers_the_passenger() -> None:
    env = make_env("taxi")
    start = env.reset(Prompt(0, "taxi #0", [], {"seed": 3}), seed=0)
    # taxi at row 0, col 2; passenger at R (0, 0); destination Y (4, 0) — gymnasium's map, wall between cols 1 and 2 at rows 0-1
    assert "Passenger at R; destination Y." in start.messages[0]["content"]
    moves = [
        "south",
        "south",
        "west",
        "west",
        "north",
        "north",
        "pickup",
        "south",
        "south",
        "south",
        "south",
        "dropoff",
    ]
    steps = [env.step(act(m)) for m in moves]
    assert steps[6].reward == -1.0 and "@" in steps[6].state and "Passenger in the taxi" in steps[6].state
    assert steps[-1].reward == 20.0 and steps[-1].done and steps[-1].info["return"] == pytest.approx(9.0)
    env.close()


# ------------------------------------------------------------------------------------------ code repair


def test_code_repair_on_tiny_code_feedback_then_a_fix() -> None:
    env = make_env("code_repair", task="tiny_code", max_attempts=3)
    env.reset(Prompt(0, "f(x)=3x+1", [], "lambda x:3*x+1"), seed=0)
    first = env.step(act("lambda x:3*x"))
    assert not first.done and first.reward == 0.0
    assert first.messages[0]["content"] == "wrong 0/5: test 0: AssertionError" and first.state == "attempt 1: wrong"
    second = env.step(act("lambda x:1+3*x"))
    assert second.done and second.reward == 1.0 and second.messages[0]["content"] == "pass"
    assert second.info["attempts"] == 2


def test_code_repair_reward_comes_from_the_checker_not_the_program() -> None:
    """A program that prints "pass" or exits 0 early does not pass: the checker's tests decide."""
    env = make_env("code_repair", task="tiny_code", max_attempts=1)
    env.reset(Prompt(0, "f(x)=2x", [], None), seed=0)
    out = env.step(act("print('pass') or exit(0)"))
    assert out.done and out.reward == 0.0 and out.messages[0]["content"] != "pass"


def test_code_repair_on_humaneval() -> None:
    prompt = first_prompt("code_repair", task="humaneval")
    problem = prompt.label
    env = make_env("code_repair", task="humaneval", max_attempts=2)
    env.reset(prompt, seed=0)
    wrong = env.step(act("    return None\n"))
    assert not wrong.done and wrong.messages[0]["content"].startswith("wrong")
    right = env.step(act(problem["canonical_solution"]))
    assert right.done and right.reward == 1.0


# ------------------------------------------------------------------------------------------ reasoning-gym with tools


@pytest.fixture(scope="module")
def arithmetic() -> Prompt:
    return first_prompt("reasoning_tools", dataset="basic_arithmetic")


def test_reasoning_with_the_python_tool(arithmetic: Prompt) -> None:
    env = GuardedEnv(make_env("reasoning_tools", tools=("python", "calculator")))
    start = env.reset(arithmetic, seed=0)
    assert [t.name for t in start.tools] == ["python", "calculator"]
    expression = arithmetic.label["metadata"]["expression"]
    first = env.step(act("", ToolCall("python", {"code": f"v = {expression}"}, "call_0")))
    second = env.step(act("", ToolCall("python", {"code": "print(int(v))"}, "call_1")))
    assert second.messages[0]["content"].strip() == str(arithmetic.label["answer"])  # state kept between calls
    assert first.info["events"] == {"tool_call": 1} and not second.done
    final = env.step(act(f"<answer>{second.messages[0]['content'].strip()}</answer>"))
    assert final.done and final.reward == 1.0
    wrong = GuardedEnv(make_env("reasoning_tools", tools=("calculator",)))
    wrong.reset(arithmetic, seed=0)
    assert wrong.step(act("<answer>12</answer>")).reward == 0.0


def test_reasoning_invalid_calls_end_the_episode(arithmetic: Prompt) -> None:
    env = make_env("reasoning_tools", tools=("calculator",), max_invalid_calls=2)
    env.reset(arithmetic, seed=0)
    first = env.step(act("", ToolCall("python", {"code": "1"}, "call_0")))
    assert first.messages[0]["content"] == "error: unknown tool 'python'; tools: calculator" and not first.done
    second = env.step(act("", ToolCall("calculator", {"expr": "1"}, "call_1")))
    assert second.done and second.info["end_reason"] == "max_invalid_calls" and second.reward == 0.0
    env.close()


def test_reasoning_tools_max_turns_and_bad_options(arithmetic: Prompt) -> None:
    env = make_env("reasoning_tools", tools=("calculator",), max_turns=1)
    env.reset(arithmetic, seed=0)
    out = env.step(act("", ToolCall("calculator", {"expression": "1+1"}, "call_0")))
    assert out.done and out.info["end_reason"] == "max_turns"
    with pytest.raises(ValueError, match="option 'tools': unknown tool 'shell'"):
        make_env("reasoning_tools", tools=("shell",))
    with pytest.raises(ValueError, match="option 'dataset': 'nope' is not a reasoning-gym dataset"):
        make_env("reasoning_tools", dataset="nope")


def test_reasoning_tools_states_differ_when_the_calls_or_answers_do(arithmetic: Prompt) -> None:
    """Step-level credit groups the steps of a group by their state text: steps after the same calls with
    the same answers share it; at the same turn after other calls (or a call that failed) they do not."""
    expression = arithmetic.label["metadata"]["expression"]

    def state_after(*calls: ToolCall) -> tuple[str, str]:
        env = make_env("reasoning_tools", tools=("calculator",))
        start = env.reset(arithmetic, seed=0)
        step = env.step(act("", *calls))
        env.close()
        return start.state, step.state

    same = state_after(ToolCall("calculator", {"expression": expression}, "call_0"))
    assert same == state_after(ToolCall("calculator", {"expression": expression}, "call_7"))  # the id is not state
    other = state_after(ToolCall("calculator", {"expression": "1 + 1"}, "call_0"))
    invalid = state_after(ToolCall("calculator", {"expr": expression}, "call_0"))
    assert same[0] == other[0] == invalid[0]  # one start state per group
    assert len({same[1], other[1], invalid[1]}) == 3 and all(s.startswith("turn 1") for s in (same[1], other[1]))


def test_reasoning_tools_privileged_solution_and_outcome(arithmetic: Prompt) -> None:
    """The texts a self-teacher may read (never the policy): the solution path from the start and at
    every state, how the episode ended at its end."""
    expression, answer = arithmetic.label["metadata"]["expression"], arithmetic.label["answer"]
    assert env_entry("reasoning_tools").privileged == ("solution", "outcome")
    env = make_env("reasoning_tools", tools=("calculator",))
    start = env.reset(arithmetic, seed=0)
    assert start.privileged == {"solution": f"Call the calculator on {expression}. The answer is {answer}."}
    assert all(str(answer) not in m["content"] for m in start.messages if m["role"] != "system")
    called = env.step(act("", ToolCall("calculator", {"expression": expression}, "call_0")))
    assert called.info["privileged/solution"] == start.privileged["solution"]
    right = env.step(act(f"<answer>{answer}</answer>"))
    assert right.info["privileged/outcome"] == f"Right: the answer is {answer}."
    env.reset(arithmetic, seed=0)
    assert env.step(act("<answer>-1</answer>")).info["privileged/outcome"] == f"Wrong: the answer is {answer}."
    short = make_env("reasoning_tools", tools=("calculator",), max_turns=1)
    short.reset(arithmetic, seed=0)
    ended = short.step(act("", ToolCall("calculator", {"expression": expression}, "call_0")))
    assert ended.info["privileged/outcome"] == f"Not answered (max_turns): the answer is {answer}."
    python_only = make_env("reasoning_tools", tools=("python",))  # no calculator: no call in the solution
    assert python_only.reset(arithmetic, seed=0).privileged == {"solution": f"The answer is {answer}."}
    env.close()
    short.close()
    python_only.close()


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_reasoning_tools_from_the_model_familys_own_text(arithmetic: Prompt, fmt: str) -> None:
    """The model's text in its family's format, parsed by `parse_tool_calls`, drives the episode; a
    malformed call is answered as invalid, not raised."""
    expression = arithmetic.label["metadata"]["expression"]
    call = ToolCall("calculator", {"expression": expression})
    env = GuardedEnv(make_env("reasoning_tools", tools=("calculator",)))
    env.reset(arithmetic, seed=0)
    computed = env.step(
        AgentAction(render_tool_calls("", [call], fmt), parse_tool_calls(render_tool_calls("", [call], fmt), fmt))
    )
    value = computed.messages[0]["content"]
    assert float(value) == pytest.approx(float(arithmetic.label["answer"]))
    broken = (
        '<tool_call>{"name": "calculator", "arguments": </tool_call>'
        if fmt == "hermes"
        else '{"name": "calculator", "parameters": '
    )
    bad = env.step(AgentAction(broken, parse_tool_calls(broken, fmt)))
    assert bad.info["events"] == {"invalid_call": 1} and "could not be parsed" in bad.messages[0]["content"]
    answer = f"The result is <answer>{round(float(value))}</answer>"
    final = env.step(AgentAction(answer, parse_tool_calls(answer, fmt)))
    assert final.done and final.reward == 1.0


def test_the_default_step_timeout_fits_a_turn_of_tool_calls() -> None:
    """A turn of reasoning_tools may make `max_calls_per_turn` calls of `tool_timeout_s` each, after a
    sandbox start: the guard's default must not cut such a turn."""
    options = env_options("reasoning_tools")
    worst = ToolLimits().max_calls_per_turn * options.tool_timeout_s + 10.0  # a start under load: up to 8 s seen
    assert EnvGuards().step_timeout_s > worst
