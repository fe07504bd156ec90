"""A set of tools for one episode: the model's calls checked, run, and answered as tool messages.

Nothing a call does raises into the episode runner. An unparsable call (`ParsedTurn.errors`), an
unknown tool or arguments that break the tool's schema are *invalid*: the answer names the problem
("arguments.code: required"), and `max_consecutive_invalid` of them in a row end the episode with the
reason "max_invalid_calls". A tool that raises (`ToolError` for its own clear messages, anything else
as the error's type and text) or runs past its timeout is answered with that; an answer past
`max_response_chars` is cut from `truncate_side`. Each of these is counted in `ToolRun.events`
(name -> count), which the environment puts into `EnvStep.info["events"]`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mcore_rl.data.tool_calls import ParsedTurn, ToolCall, ToolSpec
from mcore_rl.envs.base import Message
from mcore_rl.envs.guard import CallTimeout, call_with_timeout
from mcore_rl.envs.tools.schema import unsupported, validate
from mcore_rl.envs.truncation import SIDES, TruncationSide, truncate

GRACE_S = 3.0  # how long past a call's timeout the toolset waits before it abandons the call (`Tool.grace_s`)


class ToolError(Exception):
    """A tool's own failure with a message for the model ("division by zero", "no such document")."""


class ToolTimeout(ToolError):
    """A tool stopped its own work at the call's timeout (counted as "tool_timeout")."""


class Tool(ABC):
    """One tool. `run` gets arguments already checked against `spec.parameters` and the call's
    timeout (a tool that can stop its own work at it does; the toolset abandons it `grace_s` later)."""

    spec: ToolSpec
    timeout_s: float | None = None  # this tool's timeout; None: `ToolLimits.timeout_s`
    grace_s: float = GRACE_S  # how long past the timeout the toolset waits before it abandons the call

    @abstractmethod
    def run(self, arguments: dict[str, Any], timeout_s: float) -> str: ...

    def close(self) -> None:
        """Release what the tool holds for its episode (the Python tool's interpreter)."""
        return None


@dataclass(frozen=True)
class ToolLimits:
    timeout_s: float = 10.0
    max_response_chars: int = 2000
    truncate_side: TruncationSide = "middle"
    max_consecutive_invalid: int = 3  # 0: no limit
    max_calls_per_turn: int = 4  # calls past it are answered "not run" (counted), not run

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"tool timeout_s must be > 0, got {self.timeout_s}")
        if self.max_response_chars < 64:
            raise ValueError(f"max_response_chars must be >= 64, got {self.max_response_chars}")
        if self.truncate_side not in SIDES:
            raise ValueError(f"truncate_side must be one of {', '.join(SIDES)}, got {self.truncate_side!r}")
        if self.max_consecutive_invalid < 0 or self.max_calls_per_turn < 1:
            raise ValueError("max_consecutive_invalid must be >= 0 and max_calls_per_turn >= 1")


@dataclass
class ToolRun:
    """The answers to one turn's calls, in order; what happened; `end_reason` if the episode must end."""

    messages: list[Message] = field(default_factory=list)
    events: dict[str, int] = field(default_factory=dict)
    end_reason: str | None = None

    def count(self, event: str) -> None:
        self.events[event] = self.events.get(event, 0) + 1


def tool_message(call: ToolCall | None, content: str) -> Message:
    message: Message = {"role": "tool", "content": content}
    if call is not None:
        message["name"] = call.name
        if call.id:
            message["tool_call_id"] = call.id
    return message


class Toolset:
    """The tools of one episode (built fresh per episode, closed with it)."""

    def __init__(self, tools: Sequence[Tool], limits: ToolLimits = ToolLimits()) -> None:
        self.tools = {t.spec.name: t for t in tools}
        if len(self.tools) != len(tools):
            raise ValueError(f"two tools share a name: {[t.spec.name for t in tools]}")
        for tool in tools:
            bad = unsupported(tool.spec.parameters)
            if bad:
                raise ValueError(f"tool {tool.spec.name!r}: schema keywords not checked here: {', '.join(bad)}")
        self.limits = limits
        self.invalid_in_a_row = 0

    @property
    def specs(self) -> list[ToolSpec]:
        return [t.spec for t in self.tools.values()]

    def run(self, turn: ParsedTurn) -> ToolRun:
        """Answer every call of `turn` (parse errors first, as the parser reports them)."""
        out = ToolRun()
        for error in turn.errors:
            self._invalid(out, None, f"error: the tool call could not be parsed: {error}")
        for i, call in enumerate(turn.calls):
            if out.end_reason:
                break
            if i >= self.limits.max_calls_per_turn:
                out.count("tool_call_not_run")
                out.messages.append(
                    tool_message(call, f"error: not run: at most {self.limits.max_calls_per_turn} calls per turn")
                )
                continue
            tool = self.tools.get(call.name)
            if tool is None:
                names = ", ".join(self.tools) or "none"
                self._invalid(out, call, f"error: unknown tool {call.name!r}; tools: {names}")
                continue
            problems = validate(call.arguments, tool.spec.parameters) if isinstance(call.arguments, dict) else []
            if not isinstance(call.arguments, dict):
                problems = [f"arguments: expected object, got {type(call.arguments).__name__}"]
            if problems:
                self._invalid(out, call, f"error: invalid arguments for {call.name}: {'; '.join(problems)}")
                continue
            self.invalid_in_a_row = 0
            out.count("tool_call")
            out.messages.append(tool_message(call, self._answer(out, tool, call)))
        return out

    def _answer(self, out: ToolRun, tool: Tool, call: ToolCall) -> str:
        timeout = tool.timeout_s or self.limits.timeout_s
        try:
            text = call_with_timeout(lambda: tool.run(call.arguments, timeout), timeout + tool.grace_s, call.name)
        except CallTimeout:
            out.count("tool_timeout")
            return f"error: {call.name} timed out after {timeout:g} s"
        except ToolTimeout as exc:
            out.count("tool_timeout")
            text = f"error: {exc}"
        except ToolError as exc:
            out.count("tool_error")
            text = f"error: {exc}"
        except Exception as exc:  # a tool's bug is its call's answer, never the episode's end
            out.count("tool_error")
            text = f"error: {type(exc).__name__}: {exc}"
        if not isinstance(text, str):
            out.count("tool_error")
            text = f"error: {call.name} returned {type(text).__name__}, not text"
        text, cut = truncate(text, self.limits.max_response_chars, self.limits.truncate_side)
        if cut:
            out.count("tool_response_truncated")
        return text

    def _invalid(self, out: ToolRun, call: ToolCall | None, message: str) -> None:
        out.count("invalid_call")
        out.messages.append(tool_message(call, message))
        self.invalid_in_a_row += 1
        limit = self.limits.max_consecutive_invalid
        if limit and self.invalid_in_a_row >= limit:
            out.end_reason = "max_invalid_calls"

    def close(self) -> None:
        for tool in self.tools.values():
            try:
                tool.close()
            except Exception:  # one tool's failing close must not keep the others open
                pass
