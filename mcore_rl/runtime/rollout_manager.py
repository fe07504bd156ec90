"""The rollout manager: prompts -> n completions each from the engine(s) -> rewards -> groups.

Runs on global rank 0 (which holds the engines). Each completion becomes a `Sample` carrying its
provenance: the weight version the engine generated it with and μ, the engine's log-prob of every
response token. Sampling is seeded per sample from (run seed, purpose, prompt stream index, sample
index), so the same prompt at the same step draws the same tokens in a rerun or a resumed run.

Rewards come from `DomainRewards`: one `RewardRunner` per distinct reward head of the run's
domains, which calls a sync reward in worker processes that it kills at the timeout: a verifier
that raises, hangs or exits marks its sample with `reward_error` (and `error_reward`), and the run
goes on. Each sample is scored by its domain's heads (`Sample.reward_heads`) and its reward is
their weighted sum. Each domain samples with its own top-p/top-k, response budget and group size.
Training batches are drawn by the rollout scheduler (`runtime/rollouts.py` over `scheduler.py`),
which uses this module's sampling parameters, seeds and rewards; the manager itself generates the
batches that are not trained on: held-out evaluation (`evaluate.py`) and the recipes' validation
batches.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from mcore_rl.agent.episodes import run_lockstep
from mcore_rl.agent.groups import EpisodeGroups
from mcore_rl.agent.programs import score_answers
from mcore_rl.config.rl_schema import RLConfig
from mcore_rl.algos.dynamic_sampling import is_constant
from mcore_rl.data.domains import DomainSpec, MixtureSource, RewardHead, domain_specs
from mcore_rl.data.prompts import PromptSource
from mcore_rl.data.samples import Prompt, Sample, compact_routing
from mcore_rl.rewards import RewardFunction, RewardInput, RewardRunner, get_reward_fn
from mcore_rl.rollout.pool import EmbeddedEnginePool, EnginePool, GenRequest, HTTPEnginePool, PoolLoop
import mcore_rl.data.tasks  # noqa: F401  (registers the tasks' rewards)
from mcore_rl.train.distillation import generation_budget

# salts that keep the sampling seeds of different purposes apart
SALT_TRAIN, SALT_VALIDATION, SALT_EVAL = 1, 2, 3


def sample_seed(seed: int, salt: int, index: int, j: int) -> int:
    return int(np.random.SeedSequence([seed, salt, index, j]).generate_state(1)[0] % (2**31 - 1))


def split_groups(flat: list[Sample], groups: Sequence[Sequence[Sample]]) -> list[list[Sample]]:
    """`flat` cut into lists of the sizes of `groups`."""
    out, k = [], 0
    for g in groups:
        out.append(flat[k : k + len(g)])
        k += len(g)
    return out


def _head_key(h: RewardHead) -> tuple[str, str]:
    return h.name, json.dumps(h.options, sort_keys=True, default=str)


class DomainRewards:
    """The reward heads of every domain: one `RewardRunner` per distinct (reward, options), each
    sample scored by the heads of its domain; `Sample.reward` = Σ weight × head."""

    def __init__(
        self, specs: dict[str, DomainSpec], timeout_s: float, error_reward: float, max_concurrency: int
    ) -> None:
        self.specs = specs
        heads = {_head_key(h): h for spec in specs.values() for h in spec.rewards}
        per = max(1, max_concurrency // len(heads))  # the workers of all heads together
        self.runners = {
            key: RewardRunner(
                RewardFunction(
                    get_reward_fn(h.name),
                    timeout_s=timeout_s,
                    error_reward=error_reward,
                    name=h.name,
                    options=dict(h.options),
                ),
                max_concurrency=per,
            )
            for key, h in heads.items()
        }

    def start(self) -> None:
        for r in self.runners.values():
            r.start()  # the workers load the functions while the engines start

    def close(self) -> None:
        for r in self.runners.values():
            r.close()

    def _jobs(self, samples: Sequence[Sample]) -> list[tuple[tuple[str, str], list[int]]]:
        jobs = []
        for key in self.runners:
            idx = [
                i
                for i, s in enumerate(samples)
                if any(_head_key(h) == key for h in self.specs[s.prompt.domain].rewards)
            ]
            if idx:
                jobs.append((key, idx))
        return jobs

    @staticmethod
    def _inputs(samples: Sequence[Sample], idx: list[int]) -> tuple[list[RewardInput], list[int]]:
        inputs = [
            RewardInput(
                samples[i].prompt.text,
                samples[i].text,
                samples[i].prompt.label,
                {
                    "finish_reason": samples[i].finish_reason,
                    "domain": samples[i].prompt.domain,
                    # the policy's tokens, for rewards that read them (a learned reward model)
                    "prompt_ids": samples[i].prompt.ids,
                    "response_ids": samples[i].response_ids,
                },
            )
            for i in idx
        ]
        return inputs, [samples[i].group for i in idx]

    def _combine(self, samples: Sequence[Sample], jobs: list, results: list) -> None:
        by_key = {key: dict(zip(idx, res)) for (key, idx), res in zip(jobs, results)}
        for i, s in enumerate(samples):
            heads = self.specs[s.prompt.domain].rewards
            s.reward_heads, s.info, errors, total = {}, {}, [], 0.0
            for h in heads:
                res = by_key[_head_key(h)][i]
                s.reward_heads[h.head_name] = res.reward
                s.info.update(res.info)
                total += h.weight * res.reward
                if res.error is not None:
                    errors.append(res.error if len(heads) == 1 else f"{h.head_name}: {res.error}")
            s.reward = total
            s.reward_error = "; ".join(errors) if errors else None

    async def score(self, samples: Sequence[Sample]) -> None:
        """Score `samples` (from a running event loop): every head's runner at once."""
        jobs = self._jobs(samples)
        results = await asyncio.gather(*(self.runners[key].score(*self._inputs(samples, idx)) for key, idx in jobs))
        self._combine(samples, jobs, list(results))

    def score_sync(self, samples: Sequence[Sample]) -> None:
        jobs = self._jobs(samples)
        if len(jobs) == 1:
            key, idx = jobs[0]
            results = [self.runners[key].score_sync(*self._inputs(samples, idx))]
        else:

            async def run() -> list:
                return list(await asyncio.gather(*(self.runners[k].score(*self._inputs(samples, i)) for k, i in jobs)))

            results = asyncio.run(run())
        self._combine(samples, jobs, results)


def with_judge_urls(specs: dict[str, DomainSpec], judge_urls: Mapping[str, list[str]]) -> dict[str, DomainSpec]:
    """The domains' reward heads with each `judge: <name>` option made the group's servers (`url`)."""
    for spec in specs.values():
        for h in spec.rewards:
            if "judge" in h.options:
                name = h.options.pop("judge")
                if name not in judge_urls:
                    raise ValueError(f"reward {h.name!r}: judge group {name!r} is not among the run's judges")
                h.options["url"] = list(judge_urls[name])
    return specs


def build_reward_runner(cfg: RLConfig, judge_urls: Mapping[str, list[str]] | None = None) -> DomainRewards:
    """The rewards of the run's domains (the single-source config: `reward.name`, one head);
    `judge_urls`: the servers of each judge group the heads name (`judges:`, `rollout/judges.py`)."""
    rc = cfg.reward
    specs = with_judge_urls(domain_specs(cfg), judge_urls or {})
    rewards = DomainRewards(specs, rc.timeout_s, rc.error_reward, rc.max_concurrency)
    rewards.start()
    return rewards


class RolloutManager:
    """Generates and scores groups of samples (rank 0 only)."""

    def __init__(
        self, engines: EnginePool, prompts: PromptSource | MixtureSource, rewards: DomainRewards, cfg: RLConfig
    ) -> None:
        self.engines, self.prompts, self.rewards, self.cfg = engines, prompts, rewards, cfg
        self.domains = rewards.specs
        # where agent episodes run from here (evaluation): the pool's loop, shared with the rollout scheduler
        self.engine_loop = PoolLoop(engines) if isinstance(engines, (EmbeddedEnginePool, HTTPEnginePool)) else None
        self.step = 0  # the training step the rollouts are for (the distillation horizon grows with it)
        # the multi-turn domains: their prompts' groups are episodes of an environment (`mcore_rl.agent`)
        self.episodes = EpisodeGroups.from_config(cfg, self.tokenizer) if cfg.data.domains else None

    def budget(self, prompt: Prompt) -> int:
        """New tokens of a training rollout of `prompt`: its budget, cut at the distillation horizon."""

        return generation_budget(self.cfg, prompt, self.step)

    @property
    def temperature(self) -> float:
        """The sampling temperature of the training stream now (a stage's, else rollout.temperature)."""
        t = self.prompts.temperature
        return t if t is not None else self.cfg.rollout.temperature

    def group_size(self, prompt: Prompt) -> int:
        spec = self.domains.get(prompt.domain)
        return spec.group_size if spec is not None else self.cfg.rollout.group_size

    def sampling_params(
        self, temperature: float, seed: int | None, max_new_tokens: int | None = None, domain: str | None = None
    ) -> dict[str, Any]:
        """SGLang sampling parameters; `max_new_tokens`: the prompt's own budget (at most the rollout's);
        `domain`: its top-p / top-k (else rollout.top_p / top_k)."""
        r = self.cfg.rollout
        spec = self.domains.get(domain) if domain is not None else None
        sp: dict[str, Any] = {
            "temperature": temperature,
            "max_new_tokens": min(max_new_tokens or r.max_new_tokens, r.max_new_tokens),
        }
        if temperature > 0:
            sp.update(top_p=spec.top_p if spec else r.top_p, top_k=spec.top_k if spec else r.top_k)
            if seed is not None:
                sp["sampling_seed"] = seed
        return sp

    def generate(
        self,
        prompts: Sequence[Prompt],
        n: int | None,
        temperature: float,
        salt: int,
        train: bool = False,
        on_done: Callable[[], None] | None = None,
    ) -> list[list[Sample]]:
        """n completions of each prompt (None: its domain's group size), scored: one group per
        prompt, in prompt order (`train`: training rollouts, cut at the distillation horizon;
        `on_done()` after each completion, for a progress bar)."""
        seed = self.cfg.train.seed
        sizes = [n if n is not None else self.group_size(p) for p in prompts]
        episodic = [i for i, p in enumerate(prompts) if self.episodes is not None and self.episodes.handles(p)]
        if episodic:  # an environment's or agent's prompts are scored by their episodes, not by a reward function
            groups: list[list[Sample]] = [[] for _ in prompts]
            ran = self.episode_groups([prompts[i] for i in episodic], [sizes[i] for i in episodic], temperature, salt)
            for i, group in zip(episodic, ran):
                groups[i] = group
                if on_done is not None:
                    for _ in range(sizes[i]):
                        on_done()
            rest = [i for i in range(len(prompts)) if i not in set(episodic)]
            if rest:
                others = self.generate([prompts[i] for i in rest], n, temperature, salt, train, on_done)
                for i, group in zip(rest, others):
                    groups[i] = group
            return groups
        routed = train and self.cfg.algorithm.routing_replay == "r3"  # routing replay: the engine's experts
        # sampling-mask replay: every sampled request (training, and a validation batch whose μ the learner
        # compares with π: with engines in logprobs_mode processed, μ is renormalised either way)
        mask = temperature > 0 and self.cfg.rollout.sampling_mask_replay
        reqs = [
            GenRequest(
                p.ids,
                self.sampling_params(
                    temperature,
                    sample_seed(seed, salt, p.index, j),
                    self.budget(p) if train else p.max_new_tokens,
                    p.domain,
                ),
                return_routed_experts=routed,
                return_sampling_mask=mask,
            )
            for p, k in zip(prompts, sizes)
            for j in range(k)
        ]
        start = time.perf_counter()
        gens = self.engines.generate(reqs, on_done)
        self.last_generate_s = time.perf_counter() - start
        owners = [p for p, k in zip(prompts, sizes) for _ in range(k)]
        samples = []
        for p, g in zip(owners, gens):
            lp = list(g.output_logprobs if not mask else g.output_sampling_logprobs or ())
            if len(lp) != len(g.output_ids):
                raise RuntimeError(f"engine {g.engine} returned {len(lp)} log-probs for {len(g.output_ids)} tokens")
            samples.append(
                Sample(
                    p,
                    p.index,
                    list(g.output_ids),
                    lp,
                    g.weight_version,
                    g.finish_reason,
                    g.text,
                    g.engine,
                    routed_experts=compact_routing(g.routed_experts),
                )
            )
            if mask:
                samples[-1].sampling_mask_ids, samples[-1].sampling_mask_counts = flat_masks(
                    g.output_sampling_masks or ()
                )
        start = time.perf_counter()
        self.score(samples)
        self.last_reward_s = time.perf_counter() - start
        ends = np.cumsum([0] + sizes)
        return [samples[ends[i] : ends[i + 1]] for i in range(len(prompts))]

    def episode_groups(
        self, prompts: Sequence[Prompt], sizes: Sequence[int], temperature: float, salt: int
    ) -> list[list[Sample]]:
        """The groups of environment prompts outside the training stream (held-out evaluation, validation
        batches): every episode advanced in lockstep, one batched generation per round, each episode's
        samples carrying its return; agent-program prompts among them go to `agent_groups`."""
        assert self.episodes is not None
        seed = self.cfg.train.seed
        if not all(self.episodes.plays(p) for p in prompts):  # agent programs among them: run apart
            out: list[list[Sample]] = [[] for _ in prompts]
            for played in (True, False):
                mine = [i for i, p in enumerate(prompts) if self.episodes.plays(p) == played]
                if not mine:
                    continue
                run = self.episode_groups if played else self.agent_groups
                for i, group in zip(mine, run([prompts[i] for i in mine], [sizes[i] for i in mine], temperature, salt)):
                    out[i] = group
            return out
        groups = [
            self.episodes.episodes(
                p,
                [
                    self.sampling_params(temperature, sample_seed(seed, salt, p.index, j), None, p.domain)
                    for j in range(k)
                ],
            )
            for p, k in zip(prompts, sizes)
        ]
        start = time.perf_counter()
        run_lockstep([e for g in groups for e in g], lambda reqs: self.engines.generate(reqs))
        self.last_generate_s = time.perf_counter() - start
        return [[s for e in g for s in e.samples()] for g in groups]

    def agent_groups(
        self, prompts: Sequence[Prompt], sizes: Sequence[int], temperature: float, salt: int
    ) -> list[list[Sample]]:
        """The groups of agent-program prompts outside the training stream (held-out evaluation): each
        episode the agent process as in training, its answer scored by the domain's reward; a lost
        episode (the program failed) scores 0 here, as a wrong answer."""
        episodes, loop = self.episodes, self.engine_loop
        assert episodes is not None and episodes.agents is not None
        if loop is None:
            raise RuntimeError("agent domains need an embedded or HTTP engine pool to be evaluated")
        agents, seed = episodes.agents, self.cfg.train.seed

        async def play() -> list[list[Sample]]:
            groups = await asyncio.gather(
                *(
                    agents.run_group(
                        p,
                        [
                            self.sampling_params(temperature, sample_seed(seed, salt, p.index, j), None, p.domain)
                            for j in range(k)
                        ],
                        self.engines.agenerate,
                        "eval" if salt == SALT_EVAL else "validation",
                    )
                    for p, k in zip(prompts, sizes)
                )
            )
            await score_answers([s for g in groups for s in g], self.rewards.score)
            return list(groups)

        start = time.perf_counter()
        out: list[list[Sample]] = loop.run(play())
        self.last_generate_s = time.perf_counter() - start
        return out

    def score(self, samples: list[Sample]) -> None:
        self.rewards.score_sync(samples)

    @property
    def tokenizer(self) -> Any:
        src = self.prompts
        return src.tokenizer if isinstance(src, PromptSource) else next(iter(src.sources.values())).tokenizer


def reward_metrics(groups: list[list[Sample]], prefix: str = "reward", per_domain: bool = False) -> dict[str, float]:
    """Reward and response-length statistics of a batch; `per_domain`: also by domain
    (`reward/<domain>/mean`, `reward/<domain>/<head>`, `response/<domain>/length_mean`, ...)."""
    samples = [s for g in groups for s in g]
    if not samples:
        return {}
    out = _reward_stats(groups, prefix)
    unparsed = [s.info["judge_unparsed"] for s in samples if "judge_unparsed" in s.info]
    if unparsed:  # judge rewards: samples whose judge answered without a verdict (scored its lowest)
        out[f"{prefix}/judge_unparsed_frac"] = float(np.mean([u > 0 for u in unparsed]))
    if per_domain:
        for d in sorted({s.prompt.domain for s in samples}):
            mine = [g for g in groups if g and g[0].prompt.domain == d]
            for key, value in _reward_stats(mine, prefix).items():
                head, _, leaf = key.partition("/")
                out[f"{head}/{d}/{leaf}"] = value
            flat_samples = [s for g in mine for s in g]
            out[f"rollout/{d}/samples"] = float(len(flat_samples))
            for name in flat_samples[0].reward_heads:
                vals = [s.reward_heads[name] for s in flat_samples if name in s.reward_heads]
                out[f"{prefix}/{d}/head/{name}"] = float(np.mean(vals))
    return out


def _reward_stats(groups: list[list[Sample]], prefix: str) -> dict[str, float]:
    samples = [s for g in groups for s in g]
    rewards = np.array([s.reward for s in samples], dtype=np.float64)
    lengths = np.array([len(s.response_ids) for s in samples], dtype=np.float64)
    flat = [is_constant([s.reward for s in g]) for g in groups if g]  # DEFAULT_STD_TOLERANCE
    return {
        f"{prefix}/mean": float(rewards.mean()),
        f"{prefix}/std": float(rewards.std()),
        f"{prefix}/error_frac": float(np.mean([s.reward_error is not None for s in samples])),
        f"{prefix}/zero_std_group_frac": float(np.mean(flat)) if flat else math.nan,
        "response/length_mean": float(lengths.mean()),
        "response/truncated_frac": float(np.mean([s.finish_reason == "length" for s in samples])),
    }


def flat_masks(masks: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Per-token supports (a `Generation`'s) as `Sample`'s flat ids and per-token counts."""
    return [int(i) for m in masks for i in m], [len(m) for m in masks]
