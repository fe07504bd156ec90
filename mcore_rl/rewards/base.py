"""Reward functions and the runner that calls them without ever stopping the run.

A reward function scores one sample (`per_group=False`) or all samples of one prompt at once
(`per_group=True`, e.g. for pairwise judges or group-level shaping). It may be a plain function
or an `async def`; it receives `RewardInput`s and returns a number, a bool, or a dict with a
"reward" key (other keys are kept as `info`). `RewardFunction.options` are keyword arguments of
every call, `fn(sample, **options)`, in worker processes too (a domain's reward head with options).

The runner applies a timeout to every call and catches everything a reward function can do wrong
— raise (`SystemExit` and `KeyboardInterrupt` too), hang, return None/NaN/a string, and in worker
processes also `os._exit` or a crash. Such a sample gets `error_reward` (0 by default) and a
`reward_error` message, and the run goes on: one broken verifier on one weird completion must not
kill a multi-day job. Callers should log or filter on `reward_error` (samples with an error are
not "wrong answers": the learner leaves them out of the loss and of the group statistics).

Where a call runs (`RewardRunner.isolation`):

- "process": a sync function that can be imported by name (`RewardFunction.path`, derived from a
  module-level function, or any registered / "package.module:function" reward) runs in a pool of
  `max_concurrency` worker processes (`workers.py`). A call past its timeout has its worker killed
  and replaced, so a hanging verifier costs one sample, never a worker; `close()` kills them all,
  and they die with the trainer even when it is SIGKILLed.
- "thread": a sync function without an import path (a lambda, a closure: tests, notebooks) runs
  in a thread pool, or in the `executor` given. A thread cannot be killed: a timed-out call keeps
  its thread until it returns, and `os._exit` ends the process. Not for verifiers that can hang.
- "async": an `async def` runs on the event loop, cancelled at its timeout.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from collections.abc import Awaitable, Callable, Hashable, Sequence

from mcore_rl.rewards.registry import import_path_of

if TYPE_CHECKING:
    from mcore_rl.rewards.workers import WorkerPool

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
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0


@dataclass
class RewardFunction:
    """A reward callable plus how to call it."""

    fn: Callable[..., Any]
    per_group: bool = False
    timeout_s: float | None = 30.0
    error_reward: float = 0.0
    name: str = ""
    path: str | None = None  # "package.module:function" that worker processes import; derived from fn if it has one
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of every call: fn(sample, **options)

    def __post_init__(self) -> None:
        if not self.name:
            self.name = getattr(self.fn, "__name__", type(self.fn).__name__)
        if self.path is None:
            self.path = import_path_of(self.fn)

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(type(self.fn).__call__)


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
            value = float(value)
        except (TypeError, ValueError):
            raise InvalidReward(f"reward must be a number, got {type(value).__name__}: {value!r:.80}") from None
    if not math.isfinite(value):
        raise InvalidReward(f"reward is not finite: {value}")
    return RewardResult(float(value), info=info)


def results_of(value: Any, group_size: int | None) -> list[RewardResult]:
    """What one call returned, checked: one result, or one per sample of a group of `group_size`."""
    if group_size is None:
        return [_to_result(value)]
    values = list(value)
    if len(values) != group_size:
        raise InvalidReward(f"group reward returned {len(values)} values for {group_size} samples")
    return [_to_result(v) for v in values]


def describe(exc: BaseException, prefix: str = "") -> str:
    """The `reward_error` message of an exception."""
    text = str(exc)
    return f"{prefix}{type(exc).__name__}{': ' + text if text else ''}"[:500]


class _Escaped(Exception):
    """A SystemExit, KeyboardInterrupt or other BaseException of a reward function, carried out of
    its asyncio task as an ordinary exception (a task that raises those stops the event loop)."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(describe(original))
        self.original = original


async def _contained(work: Awaitable[Any]) -> Any:
    try:
        return await work
    except (Exception, asyncio.CancelledError):
        raise
    except BaseException as exc:
        raise _Escaped(exc) from None


class RewardRunner:
    """Scores samples with one `RewardFunction`; see the module docstring for the guarantees."""

    def __init__(
        self,
        reward: RewardFunction | Callable[..., Any],
        max_concurrency: int = 16,
        executor: Executor | None = None,
    ) -> None:
        self.reward = reward if isinstance(reward, RewardFunction) else RewardFunction(reward)
        self.max_concurrency = max_concurrency
        self._own_executor = executor is None
        self._executor = executor
        self._workers: WorkerPool | None = None

    @property
    def isolation(self) -> str:
        """ "process", "thread" or "async": where the calls run (module docstring)."""
        if self.reward.is_async:
            return "async"
        return "process" if self._own_executor and self.reward.path else "thread"

    def _pool(self) -> Executor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="reward")
        return self._executor

    def _worker_pool(self) -> WorkerPool:
        if self._workers is None:
            from mcore_rl.rewards.workers import WorkerPool  # lazy: import cycle

            assert self.reward.path is not None
            self._workers = WorkerPool(
                self.reward.path,
                self.max_concurrency,
                self.reward.per_group,
                self.reward.timeout_s,
                options=self.reward.options,
            )
        return self._workers

    def start(self, wait_ready: bool = False) -> None:
        """Start the worker processes now, so they load the function while the caller goes on
        (otherwise they start at the first `score`), or before this returns. A no-op without workers."""
        if self.isolation == "process":
            self._worker_pool().start(wait_ready)

    def worker_pids(self) -> list[int]:
        return self._workers.pids() if self._workers is not None else []

    def close(self) -> None:
        """Kill the worker processes; shut down the runner's own thread pool (without waiting for
        timed-out calls). A later `score` starts new ones."""
        if self._workers is not None:
            self._workers.close()
            self._workers = None
        if self._own_executor and self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------- in-process calls

    async def _call(self, arg: Any) -> Any:
        fn = functools.partial(self.reward.fn, **self.reward.options) if self.reward.options else self.reward.fn
        if self.reward.is_async:
            work = fn(arg)
        else:
            work = asyncio.get_running_loop().run_in_executor(self._pool(), fn, arg)
        return await asyncio.wait_for(_contained(work), self.reward.timeout_s)

    def _failed(self, n: int, msg: str, elapsed_s: float) -> list[RewardResult]:
        logger.warning("reward function %s failed: %s", self.reward.name, msg)
        return [RewardResult(self.reward.error_reward, error=msg, elapsed_s=elapsed_s) for _ in range(n)]

    async def _scored(self, sem: asyncio.Semaphore, arg: Any, group_size: int | None) -> list[RewardResult]:
        n = 1 if group_size is None else group_size
        async with sem:
            start = time.monotonic()
            try:
                results = results_of(await self._call(arg), group_size)
            except asyncio.CancelledError:
                raise
            except TimeoutError:
                return self._failed(n, f"timeout after {self.reward.timeout_s:g}s", time.monotonic() - start)
            except _Escaped as exc:
                return self._failed(n, describe(exc.original), time.monotonic() - start)
            except BaseException as exc:
                return self._failed(n, describe(exc), time.monotonic() - start)
            for r in results:
                r.elapsed_s = time.monotonic() - start
            return results

    # ---------------------------------------------------------------- scoring

    def _calls(self, samples: Sequence[RewardInput], group_ids: Sequence[Hashable] | None) -> list[list[int]]:
        """The sample indices of each call: one sample each, or the members of each group."""
        if not self.reward.per_group:
            return [[i] for i in range(len(samples))]
        ids = list(group_ids) if group_ids is not None else [0] * len(samples)
        if len(ids) != len(samples):
            raise ValueError(f"{len(samples)} samples but {len(ids)} group ids")
        members: dict[Hashable, list[int]] = {}
        for i, g in enumerate(ids):
            members.setdefault(g, []).append(i)
        return list(members.values())

    def _arg(self, samples: Sequence[RewardInput], idx: list[int]) -> Any:
        return [samples[i] for i in idx] if self.reward.per_group else samples[idx[0]]

    def _in_workers(self, samples: Sequence[RewardInput], calls: list[list[int]]) -> list[list[RewardResult]]:
        replies = self._worker_pool().run([self._arg(samples, idx) for idx in calls])
        scored = []
        for idx, rep in zip(calls, replies):
            if rep.error is not None:
                scored.append(self._failed(len(idx), rep.error, rep.elapsed_s))
            else:
                assert rep.values is not None  # a reply without an error carries its values
                scored.append([RewardResult(r, info=info, elapsed_s=rep.elapsed_s) for r, info in rep.values])
        return scored

    @staticmethod
    def _in_order(n: int, calls: list[list[int]], scored: Sequence[list[RewardResult]]) -> list[RewardResult]:
        out: list[RewardResult | None] = [None] * n
        for idx, results in zip(calls, scored):
            for i, r in zip(idx, results):
                out[i] = r
        return out  # type: ignore[return-value]  # every index 0..n-1 is in exactly one call, so no None is left

    async def score(
        self, samples: Sequence[RewardInput], group_ids: Sequence[Hashable] | None = None
    ) -> list[RewardResult]:
        """One result per sample, in order. Per-group functions need `group_ids` (samples with the
        same id form a group, in their order); without them all samples are one group."""
        calls = self._calls(samples, group_ids)
        if self.isolation == "process":
            scored = await asyncio.to_thread(self._in_workers, samples, calls)
        else:
            sem = asyncio.Semaphore(self.max_concurrency)
            size = (lambda idx: len(idx)) if self.reward.per_group else (lambda idx: None)
            scored = await asyncio.gather(*(self._scored(sem, self._arg(samples, idx), size(idx)) for idx in calls))
        return self._in_order(len(samples), calls, scored)

    def score_sync(
        self, samples: Sequence[RewardInput], group_ids: Sequence[Hashable] | None = None
    ) -> list[RewardResult]:
        """`score` from synchronous code (not from inside a running event loop)."""
        if self.isolation == "process":
            calls = self._calls(samples, group_ids)
            return self._in_order(len(samples), calls, self._in_workers(samples, calls))
        return asyncio.run(self.score(samples, group_ids))


def annotate(sample: Any, result: RewardResult, reward_key: str = "reward", error_key: str = "reward_error") -> None:
    """Write the reward (and the error message, or None) onto a dict or an object."""
    if isinstance(sample, dict):
        sample[reward_key] = result.reward
        sample[error_key] = result.error
    else:
        setattr(sample, reward_key, result.reward)
        setattr(sample, error_key, result.error)
