"""S2L-PO's explorer: a frozen second engine pool holding a smaller model (`rollout.explorer`).

The same machinery as the engine teachers: running SGLang / `mcore-rl serve` servers (`urls`), or
`mcore-rl serve` processes the trainer starts on an HF checkpoint (`model_path`, `--load-format
auto`: the weights are read from it and never synced), reached through an `HTTPEnginePool` of their
own, checked before training to answer and to share the policy's tokenizer (a group mixes the two
models' token ids). The engines report log-probs in the mode the trainer expects (raw, or processed
with sampling-mask replay), as the policy's engines do. `submit` sends requests from the trainer's
thread and returns at once, so the explorer generates while the (embedded) policy engines do.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import Future
from typing import Any
from collections.abc import Sequence

from mcore_rl.config.rl_schema import EngineGroupConfig, RolloutConfig
from mcore_rl.rollout.pool import GenRequest, Generation, HTTPEnginePool, check_logprobs_mode, expected_logprobs_mode
from mcore_rl.rollout.engine_processes import start_engine_group
from mcore_rl.rollout.teacher import check_engines


class ExplorerError(RuntimeError):
    """The explorer engines cannot be used (unreachable, another tokenizer); names `rollout.explorer`."""


class Explorer:
    """The explorer's engine pool (rank 0)."""

    def __init__(self, pool: HTTPEnginePool) -> None:
        self.pool = pool

    @property
    def urls(self) -> list[str]:
        return list(self.pool.urls)

    def submit(self, requests: Sequence[GenRequest]) -> Future[list[Generation]]:
        """Generate `requests` on the explorer's event loop; the future holds the generations in order."""

        async def run() -> list[Generation]:
            sem = asyncio.Semaphore(self.pool.concurrency)

            async def one(req: GenRequest) -> Generation:
                async with sem:
                    return await self.pool.agenerate(req)

            return list(await asyncio.gather(*(one(r) for r in requests)))

        return asyncio.run_coroutine_threadsafe(run(), self.pool.loop)

    def generate(self, requests: Sequence[GenRequest]) -> list[Generation]:
        return self.submit(requests).result()

    def check(self, tokenizer: Any) -> None:
        """Every engine answers and tokenizes like the policy; else `ExplorerError`."""

        check_engines(
            self.pool, self.pool.urls, tokenizer, "rollout.explorer: the explorer engine", "the policy's", ExplorerError
        )

    def close(self) -> None:
        self.pool.close()  # also stops the processes it started


def build_explorer(
    x: EngineGroupConfig,
    rollout: RolloutConfig,
    tokenizer: Any,
    workdir: str,
    seed: int = 0,
    tokenizer_path: str | None = None,
) -> Explorer:
    """Connect to (or start) the engine group `x` (`rollout.explorer`) and check them; `rollout` gives
    the run's engine settings (context length, restarts, health checks, the log-probs mode)."""

    mode = expected_logprobs_mode(rollout)
    procs = start_engine_group(
        x,
        workdir=os.path.join(workdir, "explorer"),
        context_length=rollout.context_length,
        startup_timeout_s=rollout.engine_startup_timeout_s,
        tokenizer_path=tokenizer_path,
        seed=seed,
        extra_args=["--logprobs-mode", mode],
    )
    urls = procs.urls if procs is not None else list(x.urls)
    try:
        pool = HTTPEnginePool(
            urls,
            timeout=x.request_timeout_s,
            api_key=x.api_key,
            processes=procs,
            restart_dead=procs is not None and rollout.restart_engines,
            health_interval=rollout.health_check_interval_s,
        )
    except BaseException:
        if procs is not None:
            procs.close()
        raise
    explorer = Explorer(pool)
    try:
        explorer.check(tokenizer)
        if procs is None:
            check_logprobs_mode(pool, rollout)
    except BaseException:
        explorer.close()
        raise
    return explorer
