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
   state (cosine over character 3-gram counts) and `SkilledEnv` puts them before the first message
   (`envs/skills.py`: the library's file, retrieval and the wrapper; in a training run a domain's
   `environment.skills`, into the prompt or into a self-teacher's privileged context).

Not built: the paper's LLM analysts and merger (rules instead), its file-and-line patches (and their
overlapping-range guardrail: patches here add lessons, they never edit a line). Measured in
docs/agentic.md ("Trace2Skill"): `tools/trace2skill.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from mcore_rl.agent.episodes import Episode
from mcore_rl.envs.base import PRIVILEGED
from mcore_rl.envs.skills import SECTIONS, Patch, SkillLibrary

__all__ = ["Patch", "SkillLibrary", "Trace", "analyse", "library_from_traces", "merge", "trace_of"]


@dataclass(frozen=True)
class Trace:
    """One episode as the analysts read it: `states[t]` is the state action t was taken in."""

    states: tuple[str, ...]
    actions: tuple[str, ...]
    success: bool
    outcome: str = ""  # how it ended, in words (the environment's `privileged/outcome`, or its finish)
    explained: bool = True  # did the environment end it (a hole, a crash), not a guard (turns, tokens)


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


def library_from_traces(traces: Iterable[Trace], branching: int = 4, min_support: int = 1) -> SkillLibrary:
    """The skill library of `traces`: the analysts' patches, merged (`merge`)."""
    patches = [p for t in traces for p in analyse(t)]
    return SkillLibrary(merge(patches, branching, min_support)[0])
