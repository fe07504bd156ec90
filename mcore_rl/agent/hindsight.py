"""SEED's analyzer: the policy writes a hindsight skill for each episode it just played.

"SEED: Self-Evolving On-Policy Distillation for Agentic Reinforcement Learning" (THU & ZJU & Tongji,
2026). After a group's episodes finish, the same weights that played them (θ_old: the engines that
sampled the episode) are prompted as an *analyzer* with the episode's transcript (its task, each
state and move, how it ended and its return) and write a short lesson. The lesson goes into every
sample of that episode as `privileged/hindsight_skill`, so that a self-teacher
(`teachers: [{kind: privileged, context: info, context_key: privileged/hindsight_skill}]`) re-scores
the sampled actions with the lesson in front of the prompt and SEED's gated term
(`distill.losses: [{name: seed}]`) distils it; at test time no skill is used.

The analyzer's tokens are never trained (they are not samples): one request per episode, greedy by
default, on the rollout's own engines, through the group's own `generate` (engine outages are waited
out as for a turn). An analysis cut off by a weight sync, or an empty one, leaves the episode without
a skill: the teacher gives its samples no score, and GRPO's part of the loss is unchanged.

Stage 1 of the paper (SFT on skills an external model wrote for the base policy's trajectories)
uses the same prompt: `sft_example` turns an episode and an annotator's skill into an SFT line
(`tools/make_seed_sft.py`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

from mcore_rl.agent.episodes import Episode
from mcore_rl.agent.trajectory import ChatFormat
from mcore_rl.config.rl_schema import AnalyzerConfig
from mcore_rl.data.samples import Sample
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.envs.base import PRIVILEGED
from mcore_rl.envs.skills import HINDSIGHT
from mcore_rl.rollout.pool import Generation, GenRequest

logger = logging.getLogger(__name__)
_warned_no_fit = False  # the context-too-small warning is given once per process

INFO_KEY = PRIVILEGED + HINDSIGHT
LESSON_FLAG = "episode/hindsight_lesson"
SALT_ANALYSIS = 15485863  # keeps the analysis's sampling seed apart from the turns'

DEFAULT_INSTRUCTION = (
    "You are reviewing an agent's attempt at a task. Read the transcript and write one short, general "
    "lesson (one or two sentences) that would help the agent do better on tasks like this one. "
    "Write only the lesson."
)


def transcript(episode: Episode) -> str:
    """The episode as the analyzer reads it: the task, each state and move, how it ended."""
    lines = [f"Task: {episode.prompt.text.strip()}"]
    for t, action in enumerate(episode.actions):
        state = episode.states[t] if t < len(episode.states) else ""
        if state:
            lines.append(f"State {t + 1}: {state.strip()}")
        lines.append(f"Move {t + 1}: {action.strip()}")
    outcome = episode.last_privileged.get(PRIVILEGED + "outcome", "")
    lines.append(f"End: {outcome.strip() or episode.finish}; return {episode.episode_return:g}.")
    return "\n".join(lines)


def analysis_messages(episode: Episode, cfg: AnalyzerConfig) -> list[dict[str, str]]:
    """The analyzer's chat: the instruction (`DEFAULT_INSTRUCTION` when the config gives none) and the
    transcript (cut in the middle when too long)."""
    text = transcript(episode)
    cap = cfg.max_transcript_chars
    if len(text) > cap:
        text = text[: cap // 2] + "\n...\n" + text[-(cap - cap // 2) :]
    return [{"role": "user", "content": f"{cfg.instruction or DEFAULT_INSTRUCTION}\n\n{text}"}]


def analysis_ids(
    chat: ChatFormat, episode: Episode, cfg: AnalyzerConfig, max_context: int | None = None
) -> list[int] | None:
    """The analyzer's prompt ids, the transcript cut (halving its cap) until prompt and lesson fit the
    engine's context (`max_context`; None: no limit), which refuses a longer prompt; None when not even
    a 64-character one fits."""
    cap = cfg.max_transcript_chars
    while True:
        ids = chat.prompt_ids(analysis_messages(episode, replace(cfg, max_transcript_chars=cap)))
        if max_context is None or len(ids) + cfg.max_new_tokens <= max_context:
            return ids
        if cap <= 64:
            return None
        cap = max(64, cap // 2)


def skill_of(generation: Generation) -> str | None:
    """The lesson an analysis wrote; None when it was aborted (a sync, an engine lost) or is empty."""
    if generation.finish_reason == "abort":
        return None
    text = generation.text.strip()
    return text or None


async def annotate(
    episodes: Sequence[Episode],
    generate: Callable[[GenRequest], Awaitable[Generation]],
    tokenizer: Tokenizer,
    cfg: AnalyzerConfig,
    max_context: int | None = None,
) -> list[str | None]:
    """Each episode's hindsight skill, written by the engines that played it (None: none written;
    an episode an error cost is not analysed)."""
    chat = ChatFormat(tokenizer)

    async def one(e: Episode) -> str | None:
        if e.error is not None or not e.actions:
            return None
        sp: dict[str, Any] = {
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "stop_token_ids": list(chat.stop_ids),
        }
        if "sampling_seed" in e.sampling:  # reproducible, and apart from the episode's own turns
            sp["sampling_seed"] = (int(e.sampling["sampling_seed"]) + SALT_ANALYSIS) % (2**31 - 1)
        ids = analysis_ids(chat, e, cfg, max_context)
        if ids is None:
            global _warned_no_fit
            if not _warned_no_fit:
                _warned_no_fit = True
                logger.warning(
                    "hindsight analysis: the instruction and a 64-character transcript do not fit the engine's "
                    "context of %s tokens with max_new_tokens=%d; episodes that long get no lesson",
                    max_context,
                    cfg.max_new_tokens,
                )
            return None
        # through the group's own `generate`: an outage is waited out and an engine that refuses the
        # request fails the group, exactly as for its turns (`analysis_ids` made the prompt fit)
        return skill_of(await generate(GenRequest(ids, sp)))

    return list(await asyncio.gather(*(one(e) for e in episodes)))


def attach(samples: Sequence[Sample], skill: str | None) -> None:
    """Give an episode's samples its skill (`privileged/hindsight_skill`; none when it has none) and
    whether it has one (`episode/hindsight_lesson`, counted per batch as `episode/hindsight_lessons`:
    an analyzer that never fits the context shows as 0 there)."""
    for s in samples:
        s.info = {**s.info, LESSON_FLAG: int(skill is not None), **({INFO_KEY: skill} if skill is not None else {})}


def sft_example(episode: Episode, skill: str, tokenizer: Tokenizer, cfg: AnalyzerConfig) -> dict[str, str]:
    """SEED's stage 1: one SFT line (`mcore-rl sft`'s jsonl, prompt/response) teaching the policy to
    write `skill` for `episode` — the analyzer's own prompt, rendered with the chat template."""
    chat = ChatFormat(tokenizer)
    prompt = chat.render(analysis_messages(episode, cfg), add_generation_prompt=True)
    return {"prompt": prompt, "response": skill.strip() + chat.closing}
