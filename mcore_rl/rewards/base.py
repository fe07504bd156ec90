"""Reward functions and the runner that calls them without ever stopping the run.

A reward function scores one sample (`per_group=False`) or all samples of one prompt at once
(`per_group=True`, e.g. for pairwise judges or group-level shaping). It may be a plain function
or an `async def`; it receives `RewardInput`s and returns a number, a bool, or a dict with a
"reward" key (other keys are kept as `info`).

The runner applies a timeout to every call and catches everything a reward function can do wrong
— raise, hang, return None/NaN/a string. Such a sample gets `error_reward` (0 by default) and a
`reward_error` message, and the run goes on: one broken verifier on one weird completion must not
kill a multi-day job. Callers should log or filter on `reward_error` (samples with an error are
not "wrong answers", and the loop may want to drop them instead of training on a 0).

Sync functions run in a thread pool so that slow verifiers overlap. A thread cannot be killed:
after a timeout the sample is marked and the runner moves on, but the call keeps its thread until
it returns. For verifiers that can hang for real (sympy on adversarial input), pass a
`concurrent.futures.ProcessPoolExecutor` as `executor` (the function must then be picklable).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Sequence

logger = logging.getLogger(__name__)


@dataclass
class RewardInput:
    """What a reward function sees: the prompt, the completion, the reference answer if any."""

    prompt: str
    completion: str
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardResult:
    """`error` is the `reward_error` message (None when the function returned normally)."""

    reward: float
    error: Optional[str] = None
    info: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0


@dataclass
class RewardFunction:
    """A reward callable plus how to call it."""

    fn: Callable[..., Any]
    per_group: bool = False
    timeout_s: Optional[float] = 30.0
    error_reward: float = 0.0
    name: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            self.name = getattr(self.fn, "__name__", type(self.fn).__name__)

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(
            getattr(self.fn, "__call__", None)
        )


class InvalidReward(ValueError):
    pass


def _to_result(value: Any) -> RewardResult:
    info: dict[str, Any] = {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise InvalidReward(f"reward dict without a 'reward' key: keys {sorted(value)}")
        info = {k: v for k, v in value.items() if k != "reward"}
        value = value["reward"]
    if isinstance(value, bool):
        value = float(value)
    if isinstance(value, (str, bytes)) or value is None:
        raise InvalidReward(f"reward must be a number, got {type(value).__name__}: {value!r:.80}")
    if not isinstance(value, (int, float)):
        try:  # numpy / torch scalars
            value = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise InvalidReward(f"reward must be a number, got {type(value).__name__}: {value!r:.80}") from None
    if not math.isfinite(value):
        raise InvalidReward(f"reward is not finite: {value}")
    return RewardResult(float(value), info=info)


def _describe(exc: BaseException, timeout: Optional[float]) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return f"timeout after {timeout:g}s"
    return f"{type(exc).__name__}: {exc}"[:500]


class RewardRunner:
    """Scores samples with one `RewardFunction`; see the module docstring for the guarantees."""

    def __init__(
        self,
        reward: RewardFunction | Callable[..., Any],
        max_concurrency: int = 16,
        executor: Optional[Executor] = None,
    ) -> None:
        self.reward = reward if isinstance(reward, RewardFunction) else RewardFunction(reward)
        self.max_concurrency = max_concurrency
        self._own_executor = executor is None
        self._executor = executor

    def _pool(self) -> Executor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="reward")
        return self._executor

    def close(self) -> None:
        """Shut down the runner's own thread pool (without waiting for timed-out calls)."""
        if self._own_executor and self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def _call(self, arg: Any) -> Any:
        fn = self.reward.fn
        if self.reward.is_async:
            work = fn(arg)
        else:
            work = asyncio.get_running_loop().run_in_executor(self._pool(), fn, arg)
        return await asyncio.wait_for(work, self.reward.timeout_s)

    def _failed(self, n: int, exc: BaseException, start: float) -> list[RewardResult]:
        msg = _describe(exc, self.reward.timeout_s)
        logger.warning("reward function %s failed: %s", self.reward.name, msg)
        return [RewardResult(self.reward.error_reward, error=msg, elapsed_s=time.monotonic() - start) for _ in range(n)]

    async def _one(self, sem: asyncio.Semaphore, sample: RewardInput) -> RewardResult:
        async with sem:
            start = time.monotonic()
            try:
                result = _to_result(await self._call(sample))
            except Exception as exc:  # noqa: BLE001 - any failure of user code is contained
                return self._failed(1, exc, start)[0]
            result.elapsed_s = time.monotonic() - start
            return result

    async def _group(self, sem: asyncio.Semaphore, samples: list[RewardInput]) -> list[RewardResult]:
        async with sem:
            start = time.monotonic()
            try:
                values = await self._call(samples)
                values = list(values)
                if len(values) != len(samples):
                    raise InvalidReward(f"group reward returned {len(values)} values for {len(samples)} samples")
                results = [_to_result(v) for v in values]
            except Exception as exc:  # noqa: BLE001
                return self._failed(len(samples), exc, start)
            for r in results:
                r.elapsed_s = time.monotonic() - start
            return results

    async def score(
        self, samples: Sequence[RewardInput], group_ids: Optional[Sequence[Hashable]] = None
    ) -> list[RewardResult]:
        """One result per sample, in order. Per-group functions need `group_ids` (samples with the
        same id form a group, in their order); without them all samples are one group."""
        sem = asyncio.Semaphore(self.max_concurrency)
        if not self.reward.per_group:
            return list(await asyncio.gather(*(self._one(sem, s) for s in samples)))
        ids = list(group_ids) if group_ids is not None else [0] * len(samples)
        if len(ids) != len(samples):
            raise ValueError(f"{len(samples)} samples but {len(ids)} group ids")
        members: dict[Hashable, list[int]] = {}
        for i, g in enumerate(ids):
            members.setdefault(g, []).append(i)
        groups = list(members.values())
        scored = await asyncio.gather(*(self._group(sem, [samples[i] for i in idx]) for idx in groups))
        out: list[Optional[RewardResult]] = [None] * len(samples)
        for idx, results in zip(groups, scored):
            for i, r in zip(idx, results):
                out[i] = r
        return out  # type: ignore[return-value]

    def score_sync(
        self, samples: Sequence[RewardInput], group_ids: Optional[Sequence[Hashable]] = None
    ) -> list[RewardResult]:
        """`score` from synchronous code (not from inside a running event loop)."""
        return asyncio.run(self.score(samples, group_ids))


def annotate(sample: Any, result: RewardResult, reward_key: str = "reward", error_key: str = "reward_error") -> None:
    """Write the reward (and the error message, or None) onto a dict or an object."""
    if isinstance(sample, dict):
        sample[reward_key] = result.reward
        sample[error_key] = result.error
    else:
        setattr(sample, reward_key, result.reward)
        setattr(sample, error_key, result.error)
