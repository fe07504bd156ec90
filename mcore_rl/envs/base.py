"""What an environment is: an interactive task the policy acts in over several turns.

An episode starts from one prompt of the domain's stream (`reset(prompt, seed)`: the same prompt and
seed give the same initial state, so a group starts G copies of one state), then alternates a model
turn (`step(action)`) with the environment's answer: messages to append to the conversation (tool
results, observations, feedback), a reward, whether the episode is over, and a short text of the
state reached (step-level credit groups steps by it). Environments speak chat messages, never token
ids: rendering them with the model's chat template is the trajectory's job, so one environment works
for every model family.

Privileged context: what the environment knows and the policy must not see, for a self-teacher that
does (SDAR, SEED: the policy scoring its own actions with this text before the prompt). The start
state's in `EnvReset.privileged`, the state reached in `EnvStep.info["privileged/<name>"]`; the
names an environment gives are registered with it (`register_env(privileged=...)`) so a teacher that
reads one is checked before workers start. Shipped names: `solution` (the moves from the state to
the goal, from the state it is about) and `outcome` (how the episode ended, in its last step's info).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from mcore_rl.data.samples import Prompt
from mcore_rl.data.tool_calls import ParsedTurn, ToolSpec

Message = dict[str, Any]  # an OpenAI-style chat message: role, content (and name / tool_call_id for tools)
PRIVILEGED = "privileged/"  # the prefix of privileged texts in `EnvStep.info` and in `Sample.info`


@dataclass
class EnvReset:
    """The start of an episode: the opening messages (system, user), the tools offered, the state text,
    and privileged texts about the start state (name -> text, never shown to the policy)."""

    messages: list[Message]
    tools: list[ToolSpec] = field(default_factory=list)
    state: str = ""
    privileged: dict[str, str] = field(default_factory=dict)


@dataclass
class AgentAction:
    """One model turn as the environment sees it: the decoded text, its parsed tool calls, and whether it
    was cut at the per-turn token cap (`truncated`)."""

    text: str
    parsed: ParsedTurn
    truncated: bool = False


@dataclass
class EnvStep:
    """The environment's answer to a turn. `reward` is this step's reward (the episode's return is their
    sum unless the environment says otherwise in `info`); `messages` are appended before the next turn."""

    messages: list[Message]
    reward: float = 0.0
    done: bool = False
    state: str = ""
    info: dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """One episode's environment. Built fresh per episode by its registered factory; not shared."""

    @abstractmethod
    def reset(self, prompt: Prompt, seed: int) -> EnvReset: ...

    @abstractmethod
    def step(self, action: AgentAction) -> EnvStep: ...

    def close(self) -> None:
        """Release what the episode holds (a sandbox, a subprocess); called once, also after a failure."""
        return None

    def demonstrate(self, rng: random.Random) -> str | ParsedTurn | None:
        """The next turn of the environment's scripted player, from the state reached: what the SFT
        warm start's demonstrations are made of (`agent/demonstrations.py`). Text, or prose with tool
        calls (written in the episode's tool-call format by the caller: environments know no format).
        None: no player."""
        return None
