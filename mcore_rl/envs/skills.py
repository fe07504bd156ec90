"""A skill library and the environment wrapper that puts its skills into an episode.

A library (Trace2Skill's skill document, written by `agent/skills.py` from an agent's own
trajectories: `tools/trace2skill.py`) is a list of `Patch`es, one JSON object a line. For each
episode, `SkilledEnv` chooses k of them for the start state and puts their text either

* before the first message (`into: prompt`): Trace2Skill, the policy reads them; or
* into the episode's privileged texts as `privileged/skills` (`into: privileged`), at the start
  state and every state after it: the student never sees them, a self-teacher does
  (`teachers: [{kind: privileged, context: info, context_key: privileged/skills}]`): SDAR's and
  SEED's skill-conditioned teacher ("Self-Distilled Agentic Reinforcement Learning", LongCat &
  THU, 2026).

How the k are chosen (`retrieval`, SDAR's options): `similar`, the k whose situation is most like
the start state (cosine over character 3-gram counts); `ucb`, a bandit over the skills, each scored
by the mean return of the episodes that had it plus c·sqrt(ln N / n) (N episodes credited in all,
n those that had it; a skill no episode has had yet comes first, ties by similarity), credited by
the rollout after each episode (`SkillLibrary.credit`); `random`, k drawn with the episode's reset
seed (one group, one draw); `full`, every skill. The bandit's counts live in the rollout's process
and restart with the run (they are not checkpointed).
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from mcore_rl.data.files import strict_jsonl
from mcore_rl.data.samples import Prompt
from mcore_rl.data.tool_calls import ParsedTurn
from mcore_rl.envs.base import PRIVILEGED, AgentAction, Environment, EnvReset, EnvStep

SECTIONS = ("do", "avoid")  # the skill document's sections: what worked, what ended an episode
RETRIEVALS = ("similar", "ucb", "random", "full")
Retrieval = Literal["similar", "ucb", "random", "full"]
SKILLS = "skills"  # the privileged text's name: `privileged/skills`
# the name of the lesson SEED's analyzer writes for an episode (`agent/hindsight.py`, `environment.analyzer`)
HINDSIGHT = "hindsight_skill"


@dataclass(frozen=True)
class Patch:
    """One proposed edit of the skill document: a lesson for a situation, under a section."""

    section: str
    situation: str  # the state text the lesson is about (the retrieval key)
    lesson: str
    support: int = 1  # how many trajectories proposed it


def features(text: str, n: int = 3) -> Counter[str]:
    """Character n-gram counts (line breaks kept): a similarity that needs no model."""
    padded = f" {text} "
    return Counter(padded[i : i + n] for i in range(max(len(padded) - n + 1, 1)))


def cosine(a: Counter[str], b: Counter[str]) -> float:
    dot = sum(v * b.get(k, 0) for k, v in a.items())
    norm = math.sqrt(sum(v * v for v in a.values())) * math.sqrt(sum(v * v for v in b.values()))
    return dot / norm if norm else 0.0


@dataclass
class SkillLibrary:
    """The merged skill document, and the bandit's counts for `ucb` retrieval."""

    skills: list[Patch] = field(default_factory=list)
    uses: list[int] = field(default_factory=list, compare=False)  # credited episodes that had skill i
    gains: list[float] = field(default_factory=list, compare=False)  # the sum of their returns

    def __post_init__(self) -> None:
        n = len(self.skills)
        self.uses = (list(self.uses) + [0] * n)[:n]
        self.gains = (list(self.gains) + [0.0] * n)[:n]

    def similarity(self, state: str) -> list[float]:
        q = features(state)
        return [cosine(q, features(p.situation)) for p in self.skills]

    def choose(
        self, state: str, k: int, retrieval: Retrieval = "similar", seed: int = 0, ucb_c: float = 1.0
    ) -> list[int]:
        """The indices of the skills for an episode starting in `state` (see the module docstring)."""
        n = len(self.skills)
        if retrieval == "full":
            return list(range(n))
        if retrieval == "random":
            return sorted(random.Random(seed).sample(range(n), min(k, n)))
        sim = self.similarity(state)
        key: list[tuple[float, float, int]]
        if retrieval == "similar":
            key = [(sim[i], float(self.skills[i].support), -i) for i in range(n)]
        elif retrieval == "ucb":
            total = sum(self.uses)

            def bound(i: int) -> float:
                if self.uses[i] == 0:
                    return math.inf
                return self.gains[i] / self.uses[i] + ucb_c * math.sqrt(math.log(max(total, 1)) / self.uses[i])

            key = [(bound(i), sim[i], -i) for i in range(n)]
        else:
            raise ValueError(f"retrieval {retrieval!r}: one of {', '.join(RETRIEVALS)}")
        return sorted(range(n), key=lambda i: key[i], reverse=True)[:k]

    def credit(self, chosen: Sequence[int], episode_return: float) -> None:
        """An episode that had the skills `chosen` ended with `episode_return` (the bandit's reward)."""
        for i in chosen:
            self.uses[i] += 1
            self.gains[i] += float(episode_return)

    def retrieve(self, state: str, k: int) -> list[Patch]:
        """The k skills most like `state` (ties: the better supported, then the first)."""
        return [self.skills[i] for i in self.choose(state, k)]

    def text(self, chosen: Sequence[int]) -> str:
        """The text of the chosen skills ("" for none)."""
        if not chosen:
            return ""
        lines = [f"Lessons from earlier games ({len(chosen)}):"]
        for i in chosen:
            p = self.skills[i]
            lines.append(f"- [{p.section}] situation:\n{p.situation}\n  {p.lesson}")
        return "\n".join(lines) + "\n\n"

    def render(self, state: str, k: int) -> str:
        """The prompt text of the k skills most like `state` ("" when the library is empty)."""
        return self.text(self.choose(state, k))

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for p in self.skills:
                f.write(json.dumps(asdict(p)) + "\n")

    @classmethod
    def load(cls, path: str) -> SkillLibrary:
        """The library in `path`; a line that is not a skill raises ValueError naming `path:line`."""
        skills = []
        for n, bad, row in strict_jsonl(path, "a skill"):
            try:
                p = Patch(**row)
            except TypeError as err:
                bad.fail(n, str(err))
            if p.section not in SECTIONS:
                bad.fail(n, f"section {p.section!r} (the document has {', '.join(SECTIONS)})")
            if not isinstance(p.situation, str) or not isinstance(p.lesson, str) or not p.lesson:
                bad.fail(n, "situation and lesson must be strings, the lesson non-empty")
            if not isinstance(p.support, int) or p.support < 1:
                bad.fail(n, f"support {p.support!r} (a count >= 1)")
            skills.append(p)
        return cls(skills)


class SkilledEnv(Environment):
    """`env` with k skills of `library` for its start state (see the module docstring); `chosen` holds
    their indices once reset, for `credit`."""

    def __init__(
        self,
        env: Environment,
        library: SkillLibrary,
        k: int = 3,
        *,
        into: Literal["prompt", "privileged"] = "prompt",
        retrieval: Retrieval = "similar",
        ucb_c: float = 1.0,
    ) -> None:
        self.env, self.library, self.k = env, library, k
        self.into, self.retrieval, self.ucb_c = into, retrieval, ucb_c
        self.chosen: list[int] = []
        self.skill_text = ""

    def reset(self, prompt: Prompt, seed: int) -> EnvReset:
        start = self.env.reset(prompt, seed)
        self.chosen = self.library.choose(start.state, self.k, self.retrieval, seed, self.ucb_c)
        self.skill_text = text = self.library.text(self.chosen)
        if not text:
            return start
        if self.into == "privileged":
            return replace(start, privileged={**start.privileged, SKILLS: text})
        if not start.messages:
            return start
        first = start.messages[0]
        messages = [{**first, "content": text + str(first.get("content", ""))}, *start.messages[1:]]
        return replace(start, messages=messages)

    def step(self, action: AgentAction) -> EnvStep:
        out = self.env.step(action)
        if self.into == "privileged" and self.skill_text:  # every state the episode reaches keeps them
            return replace(out, info={**out.info, PRIVILEGED + SKILLS: self.skill_text})
        return out

    def demonstrate(self, rng: random.Random) -> str | ParsedTurn | None:
        """The wrapped environment's scripted player (a warm start plays the domain through this wrapper)."""
        return self.env.demonstrate(rng)

    def credit(self, episode_return: float) -> None:
        """The episode ended with `episode_return`: the chosen skills' bandit counts."""
        self.library.credit(self.chosen, episode_return)

    def close(self) -> None:
        self.env.close()
