"""The asynchronous rollouts of `mcore-rl train` (`rollout.runtime: async`), trainer side (rank 0).

`PoolBackend` is the scheduler's world in a real run: the training prompt stream, the HTTP engine
pool (embedded `mcore-rl serve` processes the trainer started, or SGLang servers), and the reward
runner (worker processes, off the learner's critical path). `AsyncRollouts` runs the
`RolloutScheduler` on the pool's event-loop thread, so generation and scoring go on while the
trainer thread trains; the trainer calls it synchronously (`next_batch`, `step_done`, ...).
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from mcore_rl.config.rl_schema import RLConfig
from mcore_rl.algos.dynamic_sampling import is_constant
from mcore_rl.data.prompts import PromptSource
from mcore_rl.data.samples import Prompt, Sample
from mcore_rl.rollout.pool import Generation, GenRequest, HTTPEnginePool
from mcore_rl.runtime.rollout_manager import SALT_TRAIN, DomainRewards, RolloutManager, sample_seed
from mcore_rl.runtime.scheduler import RolloutScheduler, SchedulerConfig

# continuation part p of a sample draws with seed salt SALT_TRAIN + 16 * p (part 0: the sync loop's)
_PART_SALT_STRIDE = 16


class PoolBackend:
    def __init__(
        self,
        pool: HTTPEnginePool,
        prompts: PromptSource,
        rewards: DomainRewards,
        manager: RolloutManager,
        cfg: RLConfig,
        teachers: Any = None,
    ) -> None:
        self.pool, self.prompts, self.rewards, self.manager, self.cfg = pool, prompts, rewards, manager, cfg
        self.teachers = teachers  # `train.teachers.Teachers` with engine teachers: they score after the rewards

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
        sp = self.manager.sampling_params(r.temperature, seed, domain=prompt.domain)
        sp["max_new_tokens"] = budget
        return GenRequest(
            list(prompt.ids) + list(prefix),
            sp,
            return_routed_experts=self.cfg.algorithm.routing_replay == "r3",  # routing replay
            return_sampling_mask=r.sampling_mask_replay,
        )

    async def generate(self, request: GenRequest) -> Generation:
        return await self.pool.agenerate(request)

    async def score(self, samples: list[Sample]) -> None:
        await self.rewards.score(samples)
        self.prompts.observe([samples])  # per-prompt accuracy, for a stage's filter of solved prompts
        if self.teachers is not None:  # off the learner's critical path; a failure only marks samples
            await self.teachers.ascore_engines(samples)

    def filter_reason(self, group: list[Sample]) -> str | None:
        ds = self.cfg.algorithm.dynamic_sampling
        if ds.enabled and is_constant([s.reward for s in group], ds.std_tolerance):
            return "constant_reward"  # DAPO dynamic sampling: no advantage signal
        return None

    def error_kind(self, err: BaseException) -> Literal["no_engine", "refused", "other"]:
        from mcore_rl.rollout.client import EngineHTTPError, EngineUnavailable  # lazy: aiohttp

        if isinstance(err, EngineUnavailable):  # NoHealthyEngine included
            return "no_engine"
        if isinstance(err, EngineHTTPError) and err.status < 500:
            return "refused"
        return "other"

    def engines_need_weights(self) -> bool:
        router = self.pool.router
        return not router.healthy and bool(router.stale)


def scheduler_config(cfg: RLConfig) -> SchedulerConfig:
    r = cfg.rollout
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
    )


class AsyncRollouts:
    """The scheduler on the engine pool's loop, driven from the trainer thread."""

    def __init__(
        self,
        pool: HTTPEnginePool,
        backend: PoolBackend,
        cfg: SchedulerConfig,
        state: dict[str, Any] | None = None,
        steps_done: int = 0,
    ) -> None:
        """`state`: the scheduler's state from a checkpoint; `steps_done`: the learner's finished
        steps (the checkpoint is written before the gate opens for the next one)."""
        self.pool = pool
        self.scheduler = RolloutScheduler(backend, cfg)
        if state is not None:
            self.scheduler.load_state_dict(state)
        self.scheduler.steps_done = steps_done
        self.started = False

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.pool.loop).result()

    def start(self) -> None:
        async def start() -> None:
            self.scheduler.start()

        if not self.started:
            self._run(start())
            self.started = True

    def next_batch(self, trainer_version: int) -> tuple[list[list[Sample]], dict[str, float]] | None:
        """Blocks until a batch is ready; None when the engines wait for the current weights."""
        self.start()
        return self._run(self.scheduler.next_batch(trainer_version))

    def step_done(self, version: int) -> None:
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
        if not self.pool.loop.is_closed():
            self._run(self.scheduler.close())
