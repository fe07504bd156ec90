"""The guard every environment runs behind: a misbehaving environment costs one turn or one episode.

The episode runner never calls an environment directly; it calls `GuardedEnv`, which runs each
`reset`, `step` and `close` in a daemon thread under a timeout and checks what comes back:

- `reset` that raises, hangs past `step_timeout_s` or returns an invalid start: `EpisodeFailed` (one
  episode lost, its reason named; the environment is closed);
- `step` that raises, hangs or returns an invalid step (a reward that is not a finite number, messages
  that are not chat messages, ...): a final `EnvStep` with `info["end_reason"]` naming it (the episode
  ends there, its turns so far keep their rewards);
- an observation past `max_observation_chars` (all messages of a step together): cut from
  `truncate_side`, counted as the event "observation_truncated" (the turn goes on);
- more than `max_turns` steps: the episode ends with the reason "max_turns".

Counts of what happened live in `EnvStep.info["events"]` (name -> count, summed per episode by the
runner) and the reason an episode ended early in `EnvStep.info["end_reason"]`; environments use the
same two keys. A hung call cannot be killed in a thread: the guard abandons it (the daemon thread ends
when the call does) and closes the environment, so an environment that may hang in C code should keep
that work in a process it kills at `close()` (as the Python tool does).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from mcore_rl.data.samples import Prompt
from mcore_rl.data.tool_calls import ToolSpec
from mcore_rl.envs.base import AgentAction, Environment, EnvReset, EnvStep, Message
from mcore_rl.envs.truncation import SIDES, TruncationSide, truncate

T = TypeVar("T")
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class EnvGuards:
    """Limits on one episode's environment. `max_turns` 0: the environment decides alone.
    `step_timeout_s` bounds a whole step, tool calls included: an environment with tools needs more than
    its calls per turn times their timeout, plus a sandbox's start (`reasoning_tools`' defaults: 4 x 10 s)."""

    step_timeout_s: float = 120.0
    max_turns: int = 0
    max_observation_chars: int = 8192
    truncate_side: TruncationSide = "right"

    def __post_init__(self) -> None:
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s}")
        if self.max_turns < 0:
            raise ValueError(f"max_turns must be >= 0, got {self.max_turns}")
        if self.max_observation_chars < 64:
            raise ValueError(f"max_observation_chars must be >= 64, got {self.max_observation_chars}")
        if self.truncate_side not in SIDES:
            raise ValueError(f"truncate_side must be one of {', '.join(SIDES)}, got {self.truncate_side!r}")


class EpisodeFailed(Exception):
    """The episode could not start (its environment's reset failed); `reason` is the counted name."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class CallTimeout(Exception):
    """A call ran past its timeout (it was abandoned, still running, in its daemon thread)."""


class _Invalid(Exception):
    """What the environment returned is not a valid reset or step."""


def call_with_timeout(fn: Callable[[], T], timeout_s: float, name: str) -> T:
    """`fn()` in a daemon thread; its exception re-raised here, `CallTimeout` if it runs past `timeout_s`."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # any failure of the environment is its episode's, reported
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"env-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise CallTimeout(f"{name} ran past {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _check_messages(messages: object, what: str) -> list[Message]:
    if not isinstance(messages, list):
        raise _Invalid(f"{what}.messages is {type(messages).__name__}, not a list of chat messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise _Invalid(f"{what}.messages[{i}] is not a chat message with a role in {ROLES} and text content")
    return messages


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


class GuardedEnv(Environment):
    """One episode's environment behind the guards (see the module docstring), itself an `Environment`
    (a runner takes it in place of the one it wraps): `reset` raises only `EpisodeFailed`, `step` and
    `close` never raise."""

    def __init__(self, env: Environment, guards: EnvGuards = EnvGuards()) -> None:
        self.env, self.guards = env, guards
        self.turns = 0
        self.done = False
        self.closed = False

    def reset(self, prompt: Prompt, seed: int) -> EnvReset:
        try:
            start = call_with_timeout(lambda: self.env.reset(prompt, seed), self.guards.step_timeout_s, "reset")
            if not isinstance(start, EnvReset):
                raise _Invalid(f"reset returned {type(start).__name__}, not EnvReset")
            _check_messages(start.messages, "EnvReset")
            if not isinstance(start.tools, list) or not all(isinstance(t, ToolSpec) for t in start.tools):
                raise _Invalid("EnvReset.tools is not a list of ToolSpec")
            if not isinstance(start.state, str):
                raise _Invalid(f"EnvReset.state is {type(start.state).__name__}, not str")
            if not isinstance(start.privileged, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in start.privileged.items()
            ):
                raise _Invalid("EnvReset.privileged is not a dict of str to str")
        except CallTimeout as exc:
            self.close()
            raise EpisodeFailed("env_timeout", str(exc)) from None
        except _Invalid as exc:
            self.close()
            raise EpisodeFailed("env_invalid", str(exc)) from None
        except Exception as exc:  # the environment's failure: this episode is lost, not the run
            self.close()
            raise EpisodeFailed("env_error", _describe(exc)) from None
        self.turns, self.done = 0, False
        start.messages, _ = self._cut(start.messages)
        return start

    def step(self, action: AgentAction) -> EnvStep:
        if self.done:
            return self._end("step_after_done", "the episode had already ended")
        self.turns += 1
        try:
            out = call_with_timeout(lambda: self.env.step(action), self.guards.step_timeout_s, "step")
            self._check_step(out)
        except CallTimeout as exc:
            return self._end("env_timeout", str(exc))
        except _Invalid as exc:
            return self._end("env_invalid", str(exc))
        except Exception as exc:  # the environment's failure ends its episode, not the run
            return self._end("env_error", _describe(exc))
        out.messages, cut = self._cut(out.messages)
        if cut:
            events = out.info.setdefault("events", {})
            events["observation_truncated"] = events.get("observation_truncated", 0) + 1
        if not out.done and self.guards.max_turns and self.turns >= self.guards.max_turns:
            out.done = True
            out.info["end_reason"] = "max_turns"
        if out.done:
            self.done = True
            self.close()
        return out

    def close(self) -> None:
        """Close the environment once, under the timeout; a failing close is logged in nothing but the
        episode's end (it must not take the runner with it)."""
        if self.closed:
            return
        self.closed = True
        try:
            call_with_timeout(self.env.close, self.guards.step_timeout_s, "close")
        except BaseException:  # a failing or hung close is abandoned: the episode already ended
            pass

    def _check_step(self, out: object) -> None:
        if not isinstance(out, EnvStep):
            raise _Invalid(f"step returned {type(out).__name__}, not EnvStep")
        _check_messages(out.messages, "EnvStep")
        reward = out.reward
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise _Invalid(f"EnvStep.reward is {reward!r}, not a finite number")
        if not isinstance(out.done, bool):
            raise _Invalid(f"EnvStep.done is {out.done!r}, not a bool")
        if not isinstance(out.state, str):
            raise _Invalid(f"EnvStep.state is {type(out.state).__name__}, not str")
        if not isinstance(out.info, dict):
            raise _Invalid(f"EnvStep.info is {type(out.info).__name__}, not a dict")
        events = out.info.get("events", {})
        if not isinstance(events, dict) or not all(isinstance(v, int) for v in events.values()):
            raise _Invalid("EnvStep.info['events'] is not a dict of counts")
        out.reward = float(reward)

    def _cut(self, messages: list[Message]) -> tuple[list[Message], bool]:
        """The step's messages within `max_observation_chars` together (the last ones shortened first)."""
        budget, cut_any, out = self.guards.max_observation_chars, False, []
        for m in messages:
            text, cut = truncate(m["content"], max(budget, 64), self.guards.truncate_side)
            budget -= len(text)
            cut_any |= cut
            out.append({**m, "content": text})
        return out, cut_any

    def _end(self, reason: str, detail: str) -> EnvStep:
        self.done = True
        self.close()
        info: dict[str, Any] = {"end_reason": reason, "end_detail": detail, "events": {reason: 1}}
        return EnvStep(messages=[], reward=0.0, done=True, state="", info=info)
