"""The rollout manager: prompts -> G completions each from the engine(s) -> rewards -> groups.

Runs on global rank 0 (which holds the engines). Each completion becomes a `Sample` carrying its
provenance: the weight version the engine generated it with and μ, the engine's log-prob of every
response token. Sampling is seeded per sample from (run seed, purpose, prompt stream index, sample
index), so the same prompt at the same step draws the same tokens in a rerun or a resumed run.

Rewards come from `DomainRewards`: one `RewardRunner` per distinct reward head of the run's
domains, which calls a sync reward in worker processes that it kills at the timeout: a verifier
that raises, hangs or exits marks its sample with `reward_error` (and `error_reward`), and the run
goes on. Each sample is scored by its domain's heads (`Sample.reward_heads`) and its reward is
their weighted sum. Each domain samples with its own top-p/top-k, response budget and group size.
With dynamic sampling (DAPO), groups whose rewards are all equal are dropped and more prompts are
drawn until the batch is full or the round budget is spent.

Recipes (`mcore_rl/hooks.py`) act on the rollout through their hooks, in registration order: a
recipe with a second source of samples writes the first `co_samples(step, G)` samples of each
training group (marked with its `source`, carrying its μ); `repair_round` / `observe_round` see
every round of scored training groups, `finish_batch` the kept batch; their counts are logged as
`rollout/repair/*`.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Sequence

import numpy as np

from mcore_rl.config.rl_schema import RLConfig
from mcore_rl.algos.dynamic_sampling import GroupRefill, is_constant
from mcore_rl.data.domains import DomainSpec, MixtureSource, RewardHead, domain_specs
from mcore_rl.data.prompts import PromptSource
from mcore_rl.data.samples import Prompt, Sample, compact_routing
from mcore_rl.hooks import Recipe
from mcore_rl.progress import progress
from mcore_rl.rewards import RewardFunction, RewardInput, RewardRunner, get_reward_fn
from mcore_rl.rollout.pool import EnginePool, GenRequest
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
                {"finish_reason": samples[i].finish_reason, "domain": samples[i].prompt.domain},
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
                s.reward_heads[h.name] = res.reward
                s.info.update(res.info)
                total += h.weight * res.reward
                if res.error is not None:
                    errors.append(res.error if len(heads) == 1 else f"{h.name}: {res.error}")
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


def build_reward_runner(cfg: RLConfig) -> DomainRewards:
    """The rewards of the run's domains (the single-source config: `reward.name`, one head)."""
    rc = cfg.reward
    rewards = DomainRewards(domain_specs(cfg), rc.timeout_s, rc.error_reward, rc.max_concurrency)
    rewards.start()
    return rewards


@dataclass
class RolloutStats:
    prompts_drawn: int = 0
    groups_kept: int = 0
    rounds: int = 0
    seconds_generate: float = 0.0
    seconds_reward: float = 0.0
    fallback: bool = False  # dynamic sampling kept no group; the last round was used unfiltered
    recipes: dict[str, float] = field(default_factory=dict)  # the recipes' `rollout_metrics`
    repair: dict[str, float] = field(default_factory=dict)  # the recipes' group repairs (rollout/repair/*)
    temperature: float = math.nan  # the sampling temperature of the batch (a stage's)

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/prompts_drawn": float(self.prompts_drawn),
            "rollout/groups_kept": float(self.groups_kept),
            "rollout/rounds": float(self.rounds),
            "time/generate_s": self.seconds_generate,
            "time/reward_s": self.seconds_reward,
            "rollout/dynamic_sampling_fallback": float(self.fallback),
            **self.recipes,
            "rollout/temperature": self.temperature,
            **{f"rollout/repair/{k}": v for k, v in self.repair.items()},
        }


class RolloutManager:
    """Generates and scores groups of samples (rank 0 only)."""

    def __init__(
        self,
        engines: EnginePool,
        prompts: PromptSource | MixtureSource,
        rewards: DomainRewards,
        cfg: RLConfig,
        recipes: Sequence[Recipe] = (),
    ) -> None:
        self.engines, self.prompts, self.rewards, self.cfg = engines, prompts, rewards, cfg
        self.recipes = list(recipes)  # their rollout-side hooks (mcore_rl/hooks.py)
        sources = [r for r in self.recipes if r.source is not None]
        if len(sources) > 1:
            raise ValueError(f"recipes {[r.name for r in sources]} each generate part of a group; at most one may")
        self.co_source: Recipe | None = sources[0] if sources else None  # a second source of samples
        self.domains = rewards.specs
        self.step = 0  # the rollout step being collected (the distillation horizon grows with it)
        self.repair_counts: dict[str, float] = {}

    def co_count(self, group_size: int) -> int:
        """How many of a training group's `group_size` samples the second source draws at this step."""
        return self.co_source.co_samples(self.step, group_size) if self.co_source is not None else 0

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
        import time

        seed = self.cfg.train.seed
        sizes = [n if n is not None else self.group_size(p) for p in prompts]
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
        # the first co_count(k) samples of each training group from the recipe that has a second source
        counts = [self.co_count(k) if train else 0 for k in sizes]
        explore = [j < w for k, w in zip(sizes, counts) for j in range(k)]
        start = time.perf_counter()
        gens = self._generate_mixed(reqs, explore, on_done)
        self.last_generate_s = time.perf_counter() - start
        owners = [p for p, k in zip(prompts, sizes) for _ in range(k)]
        samples = []
        version = self.engines.weight_version if any(explore) else 0  # the policy's: the batch trains at it
        for p, g, x in zip(owners, gens, explore):
            lp = list(g.output_logprobs if not mask else g.output_sampling_logprobs)
            if len(lp) != len(g.output_ids):
                raise RuntimeError(f"engine {g.engine} returned {len(lp)} log-probs for {len(g.output_ids)} tokens")
            if x:  # the second source's μ; its version is the policy's (staleness is the policy's), its engine marked
                src = self.co_source.source if self.co_source is not None else "policy"
                assert src is not None  # a recipe with a second source names it (`Recipe.source`)
                samples.append(
                    Sample(
                        p,
                        p.index,
                        list(g.output_ids),
                        lp,
                        version,
                        g.finish_reason,
                        g.text,
                        f"{src}@{g.engine}",
                        source=src,
                    )
                )
            else:
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
                samples[-1].sampling_mask_ids, samples[-1].sampling_mask_counts = flat_masks(g.output_sampling_masks)
        start = time.perf_counter()
        self.score(samples)
        self.last_reward_s = time.perf_counter() - start
        ends = np.cumsum([0] + sizes)
        return [samples[ends[i] : ends[i + 1]] for i in range(len(prompts))]

    def _generate_mixed(
        self, reqs: list[GenRequest], explore: list[bool], on_done: Callable[[], None] | None = None
    ) -> list[Any]:
        """The generations of `reqs` in order: those marked in `explore` from the second source
        (sent first, so they run while the policy's engines generate), the others from the policy's."""
        if not any(explore):
            return self.engines.generate(reqs, on_done)
        assert self.co_source is not None
        pending = self.co_source.co_submit([r for r, x in zip(reqs, explore) if x])
        mine = iter(self.engines.generate([r for r, x in zip(reqs, explore) if not x], on_done))
        second = pending.result()
        if on_done is not None:
            for _ in second:
                on_done()
        theirs = iter(second)
        return [next(theirs) if x else next(mine) for x in explore]

    def recipe_metrics(self, groups: list[list[Sample]]) -> dict[str, float]:
        out: dict[str, float] = {}
        for r in self.recipes:
            out.update(r.rollout_metrics(groups, self.step))
        return out

    def score(self, samples: list[Sample]) -> None:
        self.rewards.score_sync(samples)

    def _train_groups(self, prompts: Sequence[Prompt]) -> list[list[Sample]]:
        # a transient bar under the run's: a real model's rollout takes minutes
        total = sum(self.group_size(p) for p in prompts)
        with progress(total, "rollout", "sample", enabled=self.cfg.logging.progress_bar, leave=False) as bar:
            groups = self.generate(prompts, None, self.temperature, SALT_TRAIN, train=True, on_done=bar.update)
        self.prompts.observe(groups)  # per-prompt accuracy, for a stage's filter of solved prompts
        return self.repair(groups)

    def _count(self, key: str, n: float) -> None:
        self.repair_counts[key] = self.repair_counts.get(key, 0.0) + float(n)

    def repair(self, groups: list[list[Sample]]) -> list[list[Sample]]:
        """One round's scored groups after every recipe's `repair_round`, then `observe_round`."""
        for r in self.recipes:
            groups, counts = r.repair_round(groups, self)
            for k, v in counts.items():
                self._count(k, v)
        for r in self.recipes:
            self.repair_counts.update(r.observe_round(groups))
        return groups

    @property
    def tokenizer(self) -> Any:
        src = self.prompts
        return src.tokenizer if isinstance(src, PromptSource) else next(iter(src.sources.values())).tokenizer

    def collect(self, step: int | None = None) -> tuple[list[list[Sample]], RolloutStats]:
        """One rollout batch: `prompts_per_step` groups of their domains' group sizes (dynamic
        sampling: groups with non-constant rewards, possibly fewer when the round budget runs out).
        `step`: the training step, which picks the mixture's stage."""
        r, ds = self.cfg.rollout, self.cfg.algorithm.dynamic_sampling
        if step is not None:
            self.prompts.set_step(step)
            self.step = step
        stats = RolloutStats(temperature=self.temperature)
        self.repair_counts = {}
        if not ds.enabled:
            prompts = self.prompts.take(r.prompts_per_step)
            groups = self._train_groups(prompts)
            stats.prompts_drawn, stats.groups_kept, stats.rounds = len(prompts), len(groups), 1
            stats.seconds_generate, stats.seconds_reward = self.last_generate_s, self.last_reward_s
            groups = self._finish(groups, stats)
            stats.recipes = self.recipe_metrics(groups)
            return groups, stats
        refill: GroupRefill[Sample] = GroupRefill(
            r.prompts_per_step, max_rounds=ds.max_rounds, max_oversample=ds.max_oversample, tol=ds.std_tolerance
        )
        groups = []
        while not refill.done and not refill.exhausted:
            prompts = self.prompts.take(refill.prompts_to_request())
            groups = self._train_groups(prompts)
            refill.add(groups, [[s.reward for s in g] for g in groups])
            stats.prompts_drawn += len(prompts)
            stats.seconds_generate += self.last_generate_s
            stats.seconds_reward += self.last_reward_s
        stats.rounds = refill.rounds
        batch = refill.take()
        stats.groups_kept = len(batch)
        if not batch:  # no group with a reward signal in the whole budget: train on the last round
            stats.fallback = True  # (zero advantages: the update only moves by the KL/entropy terms)
            batch = groups
        batch = self._finish(batch, stats)
        stats.recipes = self.recipe_metrics(batch)
        return batch, stats

    def _finish(self, groups: list[list[Sample]], stats: RolloutStats) -> list[list[Sample]]:
        """The recipes' `finish_batch` on the final batch; the repair counts into `stats`."""
        for r in self.recipes:
            groups, counts = r.finish_batch(groups, self)
            for k, v in counts.items():
                self._count(k, v)
        stats.repair = dict(self.repair_counts)
        return groups


def reward_metrics(groups: list[list[Sample]], prefix: str = "reward", per_domain: bool = False) -> dict[str, float]:
    """Reward and response-length statistics of a batch; `per_domain`: also by domain
    (`reward/<domain>/mean`, `reward/<domain>/<head>`, `response/<domain>/length_mean`, ...)."""
    samples = [s for g in groups for s in g]
    if not samples:
        return {}
    out = _reward_stats(groups, prefix)
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
