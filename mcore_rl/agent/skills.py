"""Trace2Skill: "Trace2Skill: Distill Trajectory-Local Lessons into Transferable Agent Skills" (Qwen LM
App Team & PKU & ZJU, 2026) — a skill library built from an agent's own trajectories, put into its
prompt; no weight changes.

The paper's pipeline, as built here:

1. A fixed policy plays an *evolve* set; each episode is a `Trace` (the states it acted in, its
   actions, whether it succeeded, how it ended).
2. Analysts turn each trace into `Patch`es of the skill document: a success gives the path that
   worked from its start state (section `do`); a failure the environment explains (it ended the
   episode without reward: a hole, a crash) gives the last move from the state before it (section
   `avoid`). A failure without a cause (out of turns, out of tokens) gives nothing: the paper drops
   failures its analysts cannot explain. The paper's analysts are LLM agents that can inspect
   artifacts; these are rules over the trace, so what they write is the trace's own record, not a
   generalisation an LLM would make.
3. The patch pool is merged hierarchically, B at a time, in L = ceil(log_B |P|) levels (`merge`):
   equal patches are one patch with their support added up; after the last level, patches seen
   fewer than `min_support` times (one-off edits) are dropped. A guardrail refuses a patch to a
   section the document does not have (`SECTIONS`).
4. At test time the library retrieves the k skills whose situation is most like the episode's start
   state (cosine over character 3-gram counts) and `SkilledEnv` puts them before the first message.

Not built: the paper's LLM analysts and merger (rules instead), its file-and-line patches (and their
overlapping-range guardrail: patches here add lessons, they never edit a line). Measured in
docs/agentic.md ("Trace2Skill"): `tools/trace2skill.py`.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace

from mcore_rl.agent.episodes import Episode
from mcore_rl.data.samples import Prompt
from mcore_rl.envs.base import PRIVILEGED, AgentAction, Environment, EnvReset, EnvStep

SECTIONS = ("do", "avoid")  # the skill document's sections: what worked, what ended an episode


@dataclass(frozen=True)
class Trace:
    """One episode as the analysts read it: `states[t]` is the state action t was taken in."""

    states: tuple[str, ...]
    actions: tuple[str, ...]
    success: bool
    outcome: str = ""  # how it ended, in words (the environment's `privileged/outcome`, or its finish)
    explained: bool = True  # did the environment end it (a hole, a crash), not a guard (turns, tokens)


@dataclass(frozen=True)
class Patch:
    """One proposed edit of the skill document: a lesson for a situation, under a section."""

    section: str
    situation: str  # the state text the lesson is about (the retrieval key)
    lesson: str
    support: int = 1  # how many trajectories proposed it


def analyse(trace: Trace) -> list[Patch]:
    """The analysts: the trajectory-local lessons of one trace (see the module docstring)."""
    if not trace.actions or not trace.states:
        return []
    if trace.success:
        moves = ", ".join(a.strip() for a in trace.actions)
        return [Patch("do", trace.states[0], f"From a state like this, these moves reached the goal: {moves}.")]
    if not trace.explained:
        return []
    t = len(trace.actions) - 1
    situation = trace.states[min(t, len(trace.states) - 1)]
    why = f" ({trace.outcome.splitlines()[0]})" if trace.outcome else ""
    return [Patch("avoid", situation, f"From a state like this, '{trace.actions[t].strip()}' lost the episode{why}.")]


def trace_of(episode: Episode, success_min: float = 1.0, action_of: Callable[[str], str] = str.strip) -> Trace:
    """A finished episode as a trace: success is a return of at least `success_min`; `action_of` reads
    the move out of a turn's text (the whole text by default); the environment explains an episode
    it ended itself (finish "done")."""
    n = len(episode.actions)
    outcome = episode.last_privileged.get(PRIVILEGED + "outcome", "") or str(episode.finish)
    return Trace(
        states=tuple(episode.states[:n]),
        actions=tuple(action_of(a) for a in episode.actions),
        success=episode.episode_return >= success_min,
        outcome=outcome,
        explained=episode.finish == "done",
    )


def merge_depth(n: int, branching: int) -> int:
    """L = ceil(log_B n) in integers: the merge levels that bring n patches (or patch sets) to one."""
    if branching < 2:
        raise ValueError(f"branching must be >= 2, got {branching}")
    levels, width = 0, 1
    while width < n:
        width *= branching
        levels += 1
    return levels


def merge_one(sets: Sequence[Sequence[Patch]]) -> list[Patch]:
    """One merger: B patch sets into one; equal (section, situation, lesson) become one patch whose
    support is the sum, in order of first appearance."""
    support: dict[tuple[str, str, str], int] = {}
    for patches in sets:
        for p in patches:
            k = (p.section, p.situation, p.lesson)
            support[k] = support.get(k, 0) + p.support
    return [Patch(s, sit, lesson, n) for (s, sit, lesson), n in support.items()]


def merge(patches: Sequence[Patch], branching: int = 4, min_support: int = 1) -> tuple[list[Patch], int]:
    """(the merged patches, the levels it took): every patch starts as a set of its own, each level
    merges B neighbouring sets (n sets -> ceil(n / B)), until one is left; then one-offs (support
    < `min_support`) are dropped. The guardrail first refuses patches to unknown sections."""
    for p in patches:
        if p.section not in SECTIONS:
            raise ValueError(f"patch to section {p.section!r}: the skill document has {', '.join(SECTIONS)}")
    sets: list[list[Patch]] = [[p] for p in patches]
    levels = 0
    while len(sets) > 1:
        sets = [merge_one(sets[i : i + branching]) for i in range(0, len(sets), branching)]
        levels += 1
    merged = merge_one(sets) if sets else []
    return [p for p in merged if p.support >= min_support], levels


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
    """The merged skill document: patches, retrieved by the similarity of their situation to a state."""

    skills: list[Patch] = field(default_factory=list)

    @classmethod
    def from_traces(cls, traces: Iterable[Trace], branching: int = 4, min_support: int = 1) -> SkillLibrary:
        patches = [p for t in traces for p in analyse(t)]
        return cls(merge(patches, branching, min_support)[0])

    def retrieve(self, state: str, k: int) -> list[Patch]:
        """The k skills most like `state` (ties: the better supported, then the first)."""
        q = features(state)
        scored = [(cosine(q, features(p.situation)), p.support, -i, p) for i, p in enumerate(self.skills)]
        scored.sort(key=lambda x: (x[0], x[1], x[2]), reverse=True)
        return [p for *_, p in scored[:k]]

    def render(self, state: str, k: int) -> str:
        """The prompt text of the k retrieved skills ("" when the library is empty)."""
        found = self.retrieve(state, k)
        if not found:
            return ""
        lines = [f"Lessons from earlier games ({len(found)}):"]
        for p in found:
            lines.append(f"- [{p.section}] situation:\n{p.situation}\n  {p.lesson}")
        return "\n".join(lines) + "\n\n"

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for p in self.skills:
                f.write(json.dumps(asdict(p)) + "\n")

    @classmethod
    def load(cls, path: str) -> SkillLibrary:
        with open(path, encoding="utf-8") as f:
            return cls([Patch(**json.loads(line)) for line in f if line.strip()])


class SkilledEnv(Environment):
    """`env` with the library's k skills for its start state before the first message's content."""

    def __init__(self, env: Environment, library: SkillLibrary, k: int = 3) -> None:
        self.env, self.library, self.k = env, library, k

    def reset(self, prompt: Prompt, seed: int) -> EnvReset:
        start = self.env.reset(prompt, seed)
        text = self.library.render(start.state, self.k)
        if not text or not start.messages:
            return start
        first = start.messages[0]
        messages = [{**first, "content": text + str(first.get("content", ""))}, *start.messages[1:]]
        return replace(start, messages=messages)

    def step(self, action: AgentAction) -> EnvStep:
        return self.env.step(action)

    def close(self) -> None:
        self.env.close()
