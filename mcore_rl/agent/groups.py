"""The multi-turn domains of a run, as the rollout sees them: one prompt in, one group of episode samples out.

This is the seam between the one rollout path and the episode runners: the scheduler's
`produce_group` hands each environment or agent prompt to `run_group` with its own `generate`
(which waits out engine outages and whose aborted requests the runners continue), in both
schedules. An environment domain's group is G episodes of its environment from one seeded state,
each episode's samples carrying its return as their reward (the reward workers never see them); an
agent domain's group is G runs of its agent program (`programs.py`), each scored by its answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from mcore_rl.agent import hindsight
from mcore_rl.agent.episodes import Episode, EpisodeSettings, run_episode
from mcore_rl.agent.programs import AgentGroups
from mcore_rl.config.rl_schema import DomainConfig, EnvironmentConfig, RLConfig
from mcore_rl.data.samples import Prompt, Sample
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.envs import env_prompts, make_env
from mcore_rl.envs.guard import EnvGuards
from mcore_rl.envs.skills import SkilledEnv, SkillLibrary
from mcore_rl.rollout.pool import Generation, GenRequest

SALT_RESET = 17  # keeps the environments' reset seeds apart from the sampling seeds


def environment_examples(domain: DomainConfig, n: int, seed: int) -> list[tuple]:
    """The (prompt text, label) pairs an environment domain draws (`data` cannot import `envs`)."""
    env = domain.environment
    if env is None:
        raise ValueError(f"domain {domain.name!r} has no environment")
    return env_prompts(env.name, **env.options).examples(n, seed)


class EpisodeGroups:
    """The environment of each multi-turn domain, and how its groups are run; the agent domains'
    groups (`agents`) are run by their own runner."""

    def __init__(
        self,
        environments: dict[str, EnvironmentConfig],
        budgets: dict[str, int],
        tokenizer: Tokenizer,
        seed: int,
        agents: AgentGroups | None = None,
        max_context: int | None = None,
        max_sample_tokens: int = 0,
    ) -> None:
        self.environments, self.budgets, self.tokenizer, self.seed = environments, budgets, tokenizer, seed
        self.agents = agents
        self.max_context = max_context  # the engines' context (an analysis prompt must fit it)
        self.max_sample_tokens = max_sample_tokens  # one sample's cap (`EpisodeSettings.max_sample_tokens`)
        # each domain's skill library (`environment.skills`), loaded once: its bandit counts are the run's
        self.libraries = {
            d: SkillLibrary.load(env.skills.path) for d, env in environments.items() if env.skills is not None
        }

    @classmethod
    def from_config(cls, cfg: RLConfig, tokenizer: Tokenizer, capped: bool = True) -> EpisodeGroups | None:
        """The run's environment and agent domains; None when it has neither. `capped`: no sample longer
        than a learner row or the engine's context (RL); the warm start's demonstrations are not (the SFT
        rows have their own length, and cut a longer example)."""
        r = cfg.rollout
        envs = {d.name: d.environment for d in cfg.data.domains if d.environment is not None}
        agents = AgentGroups.from_config(cfg, tokenizer)
        if not envs and agents is None:
            return None
        budgets = {
            d.name: min(d.max_new_tokens or r.max_new_tokens, r.max_new_tokens)
            for d in cfg.data.domains
            if d.name in envs
        }
        context = cfg.model.max_position_embeddings
        cap = min(cfg.train.seq_length, context) if context else cfg.train.seq_length
        return cls(envs, budgets, tokenizer, cfg.train.seed, agents, context, max_sample_tokens=cap if capped else 0)

    def handles(self, prompt: Prompt) -> bool:
        return self.plays(prompt) or (self.agents is not None and self.agents.handles(prompt))

    def plays(self, prompt: Prompt) -> bool:
        """The prompt is an environment's: its episodes can be stepped here in lockstep, outside the
        rollout path (held-out evaluation); an agent program's prompts run as processes on an event loop
        (`run_group`, also what evaluation calls)."""
        return prompt.domain in self.environments

    def close(self) -> None:
        """Stop the agents' proxies and kill any agent still running."""
        if self.agents is not None:
            self.agents.close()

    def reset_seed(self, prompt: Prompt) -> int:
        """The seed every episode of `prompt`'s group resets from (one initial state per group)."""
        return int(np.random.SeedSequence([self.seed, SALT_RESET, prompt.index]).generate_state(1)[0] % (2**31 - 1))

    def episodes(self, prompt: Prompt, samplings: Sequence[dict[str, Any]], budget: int | None = None) -> list[Episode]:
        """The group's episodes, one per sampling-parameter set (each with its own sampling seed);
        `budget`: the episode's token budget when the schedule cuts it (else the domain's)."""
        env = self.environments[prompt.domain]
        cap = self.budgets[prompt.domain] if budget is None else min(budget, self.budgets[prompt.domain])
        settings = EpisodeSettings(
            tool_format=env.tool_format,
            max_turns=env.max_turns,
            max_tokens_per_turn=env.max_tokens_per_turn,
            max_invalid_calls=env.max_invalid_calls,
            trajectory=env.trajectory,
            memory_k=env.memory_k,
            template_policy=env.template_policy,
            max_episode_tokens=cap,
            invalid_penalty=env.invalid_penalty,
            max_sample_tokens=self.max_sample_tokens,
            distill_span_tags=(env.distill_span_tags[0], env.distill_span_tags[1]) if env.distill_span_tags else None,
        )
        guards = EnvGuards(env.step_timeout_s, env.max_turns, env.max_observation_chars, env.truncate_side)
        seed = self.reset_seed(prompt)
        return [
            Episode(self.make_env(prompt.domain), prompt, j, seed, self.tokenizer, settings, sp, guards)
            for j, sp in enumerate(samplings)
        ]

    def make_env(self, domain: str) -> Any:
        """One episode's environment of `domain`, behind its skill library when it has one."""
        env = self.environments[domain]
        made = make_env(env.name, **env.options)
        if env.skills is None:
            return made
        s = env.skills
        return SkilledEnv(made, self.libraries[domain], s.k, into=s.into, retrieval=s.retrieval, ucb_c=s.ucb_c)

    async def run_group(
        self,
        prompt: Prompt,
        samplings: Sequence[dict[str, Any]],
        generate: Callable[[GenRequest], Awaitable[Generation]],
        fresh_version: int = 0,
    ) -> list[Sample]:
        """One group on the engines: its episodes run concurrently, each turn continued across weight
        syncs. `fresh_version`: the weights synced now, the version of a group lost before any token."""
        if self.agents is not None and self.agents.handles(prompt):
            return _group(await self.agents.run_group(prompt, samplings, generate), fresh_version)
        episodes = self.episodes(prompt, samplings)
        try:
            done = await asyncio.gather(*(run_episode(e, generate) for e in episodes))
        finally:
            for e in episodes:  # a cancelled group (the run stops) releases its environments
                e.close()
        for e in done:  # the skills' bandit learns from the episodes that ran (a failed one says nothing)
            inner = getattr(e.env, "env", None)
            if isinstance(inner, SkilledEnv) and e.error is None:
                inner.credit(e.episode_return)
        per_episode = [e.samples() for e in done]
        analyzer = self.environments[prompt.domain].analyzer
        if analyzer is not None:  # SEED: the weights that played each episode write its lesson
            skills = await hindsight.annotate(done, generate, self.tokenizer, analyzer, self.max_context)
            for samples, skill in zip(per_episode, skills, strict=True):
                hindsight.attach(samples, skill)
        return _group([s for samples in per_episode for s in samples], fresh_version)


def _group(samples: list[Sample], fresh_version: int) -> list[Sample]:
    """The samples of a group's episodes; an episode lost before its first turn has no tokens and
    takes the group's oldest version (`fresh_version` when no episode has a token), so it never makes
    the group look stale."""
    versions = [s.policy_version for s in samples if s.response_ids]
    for s in samples:
        if not s.response_ids:
            s.policy_version = min(versions, default=fresh_version)
    return samples
