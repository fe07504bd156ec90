"""The rollouts of `mcore-rl train`, trainer side (rank 0): the one path, both schedules.

`PoolBackend` is the scheduler's world in a real run: the training prompt stream, the engine pool
(embedded engines in this process; or HTTP: `mcore-rl serve` processes the trainer started, or
SGLang servers), the reward runner (worker processes), and the recipes' rollout-side hooks.
`Rollouts` runs the `RolloutScheduler` and is called synchronously by the trainer (`next_batch`,
`step_done`, ...):

* `rollout.runtime: sync` is the scheduler's synchronous schedule (`SchedulerConfig.rounds`,
  max_staleness 0): each batch is drawn when the learner asks for it, in rounds of groups. Over
  embedded engines the scheduler runs on an event loop of the trainer's thread that turns only
  while a batch is drawn (the engines are stepped from it, `EmbeddedEnginePool.agenerate`).
* `rollout.runtime: async`: the scheduler streams groups on the HTTP pool's event-loop thread
  within the staleness gate, so generation and scoring go on while the trainer thread trains.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Literal
from collections.abc import Awaitable, Callable, Sequence

from mcore_rl.agent.programs import score_answers
from mcore_rl.algos.dynamic_sampling import is_constant
from mcore_rl.config import RLConfig
from mcore_rl.data.prompts import PromptSource
from mcore_rl.data.samples import Prompt, Sample
from mcore_rl.hooks import Recipe
from mcore_rl.progress import progress
from mcore_rl.rollout.pool import EmbeddedEnginePool, Generation, GenRequest, HTTPEnginePool, PoolLoop
from mcore_rl.runtime.rollout_manager import SALT_TRAIN, DomainRewards, RolloutManager, flat_masks, sample_seed
from mcore_rl.runtime.scheduler import RolloutScheduler, SchedulerConfig

if TYPE_CHECKING:
    from mcore_rl.train.teachers import Teachers

# continuation part p of a sample draws with seed salt SALT_TRAIN + 16 * p (part 0: the sync loop's)
_PART_SALT_STRIDE = 16


class PoolBackend:
    """The scheduler's world in a run: the prompt stream, the engine pool (embedded or HTTP), the
    rewards, and the recipes' rollout-side hooks (their group steps and batch steps)."""

    def __init__(
        self,
        pool: EmbeddedEnginePool | HTTPEnginePool,
        prompts: PromptSource,
        rewards: DomainRewards,
        manager: RolloutManager,
        cfg: RLConfig,
        teachers: Teachers | None = None,
        recipes: Sequence[Recipe] = (),
    ) -> None:
        self.pool, self.prompts, self.rewards, self.manager, self.cfg = pool, prompts, rewards, manager, cfg
        self.teachers = teachers  # engine teachers score right after the rewards (asynchronous runtime)
        self.recipes = list(recipes)  # their rollout-side hooks (mcore_rl/hooks.py)
        sources = [r for r in self.recipes if r.source is not None]
        if len(sources) > 1:
            raise ValueError(f"recipes {[r.name for r in sources]} each generate part of a group; at most one may")
        self.co_source: Recipe | None = sources[0] if sources else None  # a second source of samples
        self.repair_counts: dict[str, float] = {}  # the recipes' group repairs since the last batch
        self.on_done: Callable[[], None] | None = None  # after each finished generation (a progress bar)
        self.synced_version = 0  # the weight version last synced to the engines (the trainer's)

    # ---- what the recipes' group steps see (hooks.RolloutContext)

    @property
    def tokenizer(self) -> Any:
        return self.manager.tokenizer

    @property
    def temperature(self) -> float:
        """The sampling temperature of the training stream now (a stage's, else rollout.temperature)."""
        return self.manager.temperature

    def budget(self, prompt: Prompt) -> int:
        return self.manager.budget(prompt)

    def sampling_params(
        self, temperature: float, seed: int | None, max_new_tokens: int | None = None, domain: str | None = None
    ) -> dict[str, Any]:
        return self.manager.sampling_params(temperature, seed, max_new_tokens, domain)

    async def generate_many(self, requests: Sequence[GenRequest]) -> list[Generation]:
        """`requests` together (an embedded engine batches them), in order."""
        return list(await asyncio.gather(*(self.pool.agenerate(r) for r in requests)))

    async def score_rewards(self, samples: list[Sample]) -> None:
        await self.rewards.score(samples)

    # ---- RolloutBackend

    def set_step(self, step: int, stage: bool) -> None:
        """The training step the next batch is for: the distillation horizon, and with `stage` the
        mixture's stage (the streaming schedule draws ahead of the learner: see data/domains.py)."""
        if stage:
            self.prompts.set_step(step)
        self.manager.step = step

    def group_size(self, prompt: Prompt) -> int:
        """Its domain's group size."""
        return self.manager.group_size(prompt)

    def take_prompt(self) -> Prompt:
        return self.prompts.take(1)[0]

    def prompt_state(self) -> dict[str, Any]:
        return self.prompts.state_dict()

    def request(self, prompt: Prompt, j: int, prefix: list[int], part: int) -> GenRequest | None:
        r = self.cfg.rollout
        budget = self.manager.budget(prompt) - len(prefix)  # cut at the distillation horizon
        if budget <= 0:
            return None
        seed = sample_seed(self.cfg.train.seed, SALT_TRAIN + _PART_SALT_STRIDE * part, prompt.index, j)
        temperature = self.temperature
        sp = self.manager.sampling_params(temperature, seed, domain=prompt.domain)
        sp["max_new_tokens"] = budget
        return GenRequest(
            list(prompt.ids) + list(prefix),
            sp,
            return_routed_experts=self.cfg.algorithm.routing_replay == "r3",  # routing replay
            return_sampling_mask=temperature > 0 and r.sampling_mask_replay,
        )

    async def generate(self, request: GenRequest) -> Generation:
        gen = await self.pool.agenerate(request)
        if self.on_done is not None and gen.finish_reason != "abort":
            self.on_done()
        return gen

    def co_count(self, prompt: Prompt, group_size: int) -> int:
        return self.co_source.co_samples(self.manager.step, group_size) if self.co_source is not None else 0

    async def co_generate(self, prompt: Prompt, count: int) -> list[Sample]:
        """The second source's samples: its μ, the policy's weight version (the batch trains at
        it: staleness is the policy's), its engine marked."""
        if count == 0 or self.co_source is None:
            return []
        src = self.co_source.source or "policy"
        reqs = [self.request(prompt, j, [], 0) for j in range(count)]
        gens = await asyncio.wrap_future(self.co_source.co_submit([q for q in reqs if q is not None]))
        version = self.synced_version  # (known here: asking the engines would block their event loop)
        return [
            Sample(
                prompt,
                prompt.index,
                list(g.output_ids),
                list(g.output_logprobs if g.output_sampling_logprobs is None else g.output_sampling_logprobs),
                version,
                g.finish_reason,
                g.text,
                f"{src}@{g.engine}",
                source=src,
                sampling_mask_ids=flat_masks(g.output_sampling_masks)[0] if g.output_sampling_masks else None,
                sampling_mask_counts=flat_masks(g.output_sampling_masks)[1] if g.output_sampling_masks else None,
            )
            for g in gens
        ]

    def run_episodes(
        self, prompt: Prompt, generate: Callable[[GenRequest], Awaitable[Generation]]
    ) -> Awaitable[list[Sample]] | None:
        """An environment prompt's group: its domain's episodes (`mcore_rl.agent`); None otherwise."""
        episodes = self.manager.episodes
        if episodes is None or not episodes.handles(prompt):
            return None
        samplings = [
            self.manager.sampling_params(
                self.temperature, sample_seed(self.cfg.train.seed, SALT_TRAIN, prompt.index, j), domain=prompt.domain
            )
            for j in range(self.group_size(prompt))
        ]
        return episodes.run_group(prompt, samplings, generate, self.synced_version)

    async def score(self, samples: list[Sample]) -> None:
        plain = [s for s in samples if s.episode is None]  # an episode's reward is its environment's return
        if plain:
            await self.rewards.score(plain)
        await score_answers(samples, self.rewards.score)  # an agent episode's: its answer's, by the domain's reward
        self.prompts.observe([samples])  # per-prompt accuracy, for a stage's filter of solved prompts
        if self.teachers is not None:  # off the learner's critical path; a failure only marks samples
            await self.teachers.ascore_engines(samples)

    def _count(self, counts: dict[str, float]) -> None:
        for k, v in counts.items():
            self.repair_counts[k] = self.repair_counts.get(k, 0.0) + float(v)

    async def repair(self, groups: list[list[Sample]]) -> list[list[Sample]]:
        """Every recipe's `repair_round` on the round's scored groups, then `observe_round`."""
        if not groups:
            return groups
        for r in self.recipes:
            groups, counts = await r.repair_round(groups, self)
            self._count(counts)
        for r in self.recipes:
            self.repair_counts.update(r.observe_round(groups))
        return groups

    def finish(self, groups: list[list[Sample]]) -> tuple[list[list[Sample]], dict[str, float]]:
        """Every recipe's `finish_batch` and `rollout_metrics`; the repair counts since the last batch."""
        for r in self.recipes:
            groups, counts = r.finish_batch(groups, self)
            self._count(counts)
        metrics: dict[str, float] = {}
        for r in self.recipes:
            metrics.update(r.rollout_metrics(groups, self.manager.step))
        if self.recipes:  # (a run without recipes logs no repair keys)
            metrics.update({f"rollout/repair/{k}": v for k, v in self.repair_counts.items()})
        self.repair_counts = {}
        return groups, metrics

    def stale_ok(self, sample: Sample) -> bool:
        return any(r.stale_ok(sample) for r in self.recipes)

    def filter_reason(self, group: list[Sample]) -> str | None:
        ds = self.cfg.algorithm.dynamic_sampling
        if ds.enabled and is_constant([s.reward for s in group], ds.std_tolerance):
            return "constant_reward"  # DAPO dynamic sampling: no advantage signal
        return None

    def error_kind(self, err: BaseException) -> Literal["no_engine", "refused", "other"]:
        from mcore_rl.rollout.client import EngineHTTPError, EngineUnavailable

        if isinstance(err, EngineUnavailable):  # NoHealthyEngine included
            return "no_engine"
        if isinstance(err, EngineHTTPError) and err.status < 500:
            return "refused"
        return "other"

    def engines_need_weights(self) -> bool:
        if not isinstance(self.pool, HTTPEnginePool):
            return False  # embedded engines always hold the trainer's weights
        router = self.pool.router
        return not router.healthy and bool(router.stale)


def scheduler_config(cfg: RLConfig) -> SchedulerConfig:
    r, ds = cfg.rollout, cfg.algorithm.dynamic_sampling
    inflight = r.max_inflight_requests or r.num_embedded_engines * r.max_running_requests
    return SchedulerConfig(
        group_size=r.group_size,
        batch_groups=r.prompts_per_step,
        max_staleness=r.max_staleness,
        max_inflight_groups=max(1, inflight // r.group_size),
        buffer_groups=r.buffer_groups,
        stale_policy=r.stale_policy,
        max_regenerations=r.max_regenerations,
        partial_rollouts=r.partial_rollouts,
        no_engine_timeout_s=r.no_engine_timeout_s,
        total_steps=cfg.train.num_steps,
        rounds=r.runtime == "sync",
        max_rounds=ds.max_rounds if ds.enabled else 1,
        max_oversample=ds.max_oversample if ds.enabled else 1.0,
    )


class Rollouts:
    """The scheduler, driven from the trainer thread: on the HTTP pool's event-loop thread, or on
    a loop of the calling thread that turns while a call runs (embedded engines)."""

    def __init__(
        self,
        pool: EmbeddedEnginePool | HTTPEnginePool,
        backend: PoolBackend,
        cfg: SchedulerConfig,
        state: dict[str, Any] | None = None,
        steps_done: int = 0,
        engine_loop: PoolLoop | None = None,
    ) -> None:
        """`state`: the scheduler's state from a checkpoint; `steps_done`: the learner's finished
        steps (the checkpoint is written before the gate opens for the next one); `engine_loop`: where
        the scheduler runs (shared with the manager's evaluation of agent domains; else its own)."""
        self.pool, self.backend = pool, backend
        self.scheduler = RolloutScheduler(backend, cfg)
        if state is not None:
            self.scheduler.load_state_dict(state)
        self.scheduler.steps_done = steps_done
        self.started = False
        self.engine_loop = engine_loop if engine_loop is not None else PoolLoop(pool)

    def _run(self, coro: Any) -> Any:
        return self.engine_loop.run(coro)

    def start(self) -> None:
        async def start() -> None:
            self.scheduler.start()

        if not self.started:
            self._run(start())
            self.started = True

    def next_batch(self, trainer_version: int, step: int) -> tuple[list[list[Sample]], dict[str, float]] | None:
        """The batch of training step `step` (blocks until it is ready); None when the engines wait
        for the current weights."""
        self.backend.set_step(step, stage=self.scheduler.cfg.rounds)
        self.backend.synced_version = trainer_version
        self.start()
        if not self.scheduler.cfg.rounds:
            return self._run(self.scheduler.next_batch(trainer_version))
        # a transient bar under the run's: a real model's rollout takes minutes
        c = self.scheduler.cfg
        with progress(
            c.batch_groups * c.group_size,
            "rollout",
            "sample",
            enabled=self.backend.cfg.logging.progress_bar,
            leave=False,
        ) as bar:
            self.backend.on_done = bar.update
            try:
                return self._run(self.scheduler.next_batch(trainer_version))
            finally:
                self.backend.on_done = None

    def step_done(self, version: int) -> None:
        self.backend.synced_version = version
        self._run(self.scheduler.step_done(version))

    def state_dict(self) -> dict[str, Any]:
        async def snapshot() -> dict[str, Any]:
            return self.scheduler.state_dict()

        return self._run(snapshot())

    def write_report(self, path: str) -> dict[str, Any]:
        async def report() -> dict[str, Any]:
            s = self.scheduler
            return s.ledger.write(path, s.pending(), s.cfg.group_size)

        return self._run(report())

    def close(self) -> None:
        if self.engine_loop.usable:
            self._run(self.scheduler.close())
        self.engine_loop.close()
