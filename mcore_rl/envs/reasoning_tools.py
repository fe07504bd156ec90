"""Reasoning-gym problems with tools: the policy may compute with Python or a calculator before it
answers; the generator's own scorer judges the final answer.

A turn with tool calls (parsed from the model family's format before `step`) is answered with the
tools' results; the first turn without one is the final answer, scored by the "reasoning_gym" reward
(the dataset's `score_answer` on the `<answer>` tag, or per `extract`). The tools run under the
toolset's guards (`tools/toolset.py`): schema checks, a timeout per call, answers cut to
`max_response_chars`, and `max_invalid_calls` invalid calls in a row end the episode with reward 0.
The Python tool keeps one sandboxed interpreter for the episode and closes it with the episode.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

from mcore_rl.data.samples import Prompt
from mcore_rl.data.tool_calls import ParsedTurn, ToolCall
from mcore_rl.data.tasks.reasoning_gym import (
    EXTRACTIONS,
    Extraction,
    ReasoningGymTask,
    dataset_names,
    reasoning_gym_reward,
)
from mcore_rl.envs import register_env
from mcore_rl.envs.base import PRIVILEGED, AgentAction, Environment, EnvReset, EnvStep
from mcore_rl.envs.tools import Tool, ToolLimits, Toolset
from mcore_rl.envs.tools.calculator import Calculator
from mcore_rl.envs.tools.python_tool import PythonTool
from mcore_rl.envs.tools.search import Search
from mcore_rl.rewards import RewardInput

TOOLS: dict[str, type[Tool]] = {"python": PythonTool, "calculator": Calculator, "search": Search}
SYSTEM = (
    "Solve the problem. You may call the tools to compute. "
    "When you are done, give the final answer as <answer>...</answer> without a tool call."
)
SYSTEM_NO_TOOLS = "Solve the problem. Give the final answer as <answer>...</answer>."


@dataclass(frozen=True)
class ReasoningToolsOptions:
    dataset: str = "basic_arithmetic"
    dataset_options: dict[str, Any] = field(default_factory=dict)
    tools: tuple[str, ...] = ("python", "calculator")
    max_turns: int = 4
    extract: Extraction = "auto"
    tool_timeout_s: float = 10.0
    max_response_chars: int = 1000
    max_invalid_calls: int = 3
    # the system message; None = SYSTEM (SYSTEM_NO_TOOLS without tools). "{tools}" in it becomes the
    # offered tools' specs as JSON, one a line: for a chat template that does not render `tools` itself
    # (SmolLM2's plain ChatML), the system message is the only place the model can learn of them
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tools", tuple(self.tools))
        unknown = [t for t in self.tools if t not in TOOLS]
        if unknown:
            raise ValueError(f"option 'tools': unknown tool {unknown[0]!r}; tools: {', '.join(TOOLS)}")
        if self.max_turns < 1:
            raise ValueError(f"option 'max_turns' must be >= 1, got {self.max_turns}")
        if self.dataset not in dataset_names():
            raise ValueError(f"option 'dataset': {self.dataset!r} is not a reasoning-gym dataset")
        if self.extract not in EXTRACTIONS:
            raise ValueError(f"option 'extract' must be one of {', '.join(EXTRACTIONS)}, got {self.extract!r}")
        ToolLimits(timeout_s=self.tool_timeout_s, max_response_chars=self.max_response_chars)  # checks them


def _prompts(options: ReasoningToolsOptions) -> ReasoningGymTask:
    return ReasoningGymTask(options.dataset, **options.dataset_options)


class _RLExamples:
    """The task's RL examples (question, entry) as the prompt source: the scorer needs the entry."""

    def __init__(self, task: ReasoningGymTask) -> None:
        self.task = task

    def examples(self, n: int, seed: int) -> list[tuple[str, Any]]:
        return self.task.rl_examples(n, seed)


@register_env(
    "reasoning_tools",
    options=ReasoningToolsOptions,
    prompts=lambda options: _RLExamples(_prompts(options)),
    origin="reasoning-gym dataset (option 'dataset')",
    tools=lambda options: [TOOLS[name].spec for name in options.tools],
    privileged=("solution", "outcome"),
)
class ReasoningToolsEnv(Environment):
    def __init__(self, options: ReasoningToolsOptions) -> None:
        self.options = options
        self.toolset: Toolset | None = None
        self.prompt: Prompt | None = None
        self.turns = 0
        self.seen: list[str] = []  # each tool turn's calls and what they answered, for `state`

    def _limits(self) -> ToolLimits:
        o = self.options
        return ToolLimits(
            timeout_s=o.tool_timeout_s,
            max_response_chars=o.max_response_chars,
            max_consecutive_invalid=o.max_invalid_calls,
        )

    def system_message(self) -> str:
        o = self.options
        if o.system_prompt is None:
            return SYSTEM if o.tools else SYSTEM_NO_TOOLS
        specs = "\n".join(json.dumps(TOOLS[name].spec.to_openai()["function"]) for name in o.tools)
        return o.system_prompt.replace("{tools}", specs)

    def reset(self, prompt: Prompt, seed: int) -> EnvReset:
        if not isinstance(prompt.label, dict) or "metadata" not in prompt.label:
            raise ValueError("reasoning_tools: the prompt's label is not a reasoning-gym entry")
        self.close()
        tools: list[Tool] = [TOOLS[name]() for name in self.options.tools]
        self.toolset = Toolset(tools, self._limits())
        self.prompt, self.turns, self.seen = prompt, 0, []
        messages = [{"role": "system", "content": self.system_message()}, {"role": "user", "content": prompt.text}]
        return EnvReset(
            messages=messages, tools=self.toolset.specs, state=self.state(), privileged={"solution": self.solution()}
        )

    def solution(self) -> str:
        """The privileged solution path (`base.PRIVILEGED`): the call that computes it, and the answer."""
        assert self.prompt is not None
        expression = self.calculator_expression()
        call = f"Call the calculator on {expression}. " if expression is not None else ""
        return f"{call}The answer is {self.prompt.label['answer']}."

    def calculator_expression(self) -> str | None:
        """The entry's expression, where the calculator is offered and the generator records one (as
        `basic_arithmetic` does): what the solution path and the scripted player call it on."""
        assert self.prompt is not None
        expression = (self.prompt.label.get("metadata") or {}).get("expression")
        return expression if isinstance(expression, str) and "calculator" in self.options.tools else None

    def step(self, action: AgentAction) -> EnvStep:
        assert self.prompt is not None and self.toolset is not None, "step before reset"
        self.turns += 1
        parsed = action.parsed
        entry_answer = self.prompt.label["answer"]
        if not parsed.calls and not parsed.errors:
            reward = reasoning_gym_reward(
                RewardInput(prompt=self.prompt.text, completion=action.text, label=self.prompt.label),
                self.options.extract,
            )
            right = "Right" if reward >= 1.0 else "Wrong"
            ended = {"tool_turns": self.turns - 1, PRIVILEGED + "outcome": f"{right}: the answer is {entry_answer}."}
            return EnvStep([], reward=reward, done=True, state="answered", info=ended)
        run = self.toolset.run(parsed)
        calls = "; ".join(f"{c.name} {json.dumps(c.arguments, sort_keys=True)}" for c in parsed.calls)
        answers = "; ".join(str(m.get("content") or "") for m in run.messages)
        self.seen.append(f"{calls or 'no valid call'} -> {answers}")
        info: dict[str, Any] = {"events": run.events}
        done = False
        if run.end_reason:
            done, info["end_reason"] = True, run.end_reason
        elif self.turns >= self.options.max_turns:
            done, info["end_reason"] = True, "max_turns"  # still calling tools at the last turn: no answer
        if done:
            info[PRIVILEGED + "outcome"] = f"Not answered ({info['end_reason']}): the answer is {entry_answer}."
        else:
            info[PRIVILEGED + "solution"] = self.solution()
        return EnvStep(run.messages, reward=0.0, done=done, state=self.state(), info=info)

    def state(self) -> str:
        """The turn and every call made so far with its answer: two steps of a group share a state (for
        step-level credit) only when the same calls got the same answers, not merely at the same turn."""
        return "\n".join([f"turn {self.turns}", *self.seen])

    def demonstrate(self, rng: random.Random) -> str | ParsedTurn | None:
        """A player that knows the entry: the calculator on the entry's expression first (where the
        calculator is offered and the generator records one, as `basic_arithmetic` does), then the
        reference answer in the answer tag."""
        assert self.prompt is not None, "demonstrate before reset"
        expression = self.calculator_expression()
        if self.turns == 0 and expression is not None:
            return ParsedTurn("", [ToolCall("calculator", {"expression": expression})])
        return f"<answer>{self.prompt.label['answer']}</answer>"

    def close(self) -> None:
        if self.toolset is not None:
            self.toolset.close()
            self.toolset = None
