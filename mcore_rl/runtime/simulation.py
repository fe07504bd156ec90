"""Discrete-event simulation of the asynchronous runtime: the real scheduler on a virtual clock.

`VirtualTimeLoop` is an asyncio event loop whose clock jumps to the next scheduled callback
instead of sleeping, so `await asyncio.sleep(3600)` costs nothing and a simulated day runs in
seconds. `SimulatedEngines` is an engine pool in that world: it generates a token every
`token_time(batch)` seconds per request, holds requests beyond its slots, and pauses like SGLang
for a weight sync (`abort` ends in-flight requests with their partial output). `SimBackend` gives
the `RolloutScheduler` prompts with long-tailed budgets and these engines; `simulate_learner`
drives it like `mcore-rl train` does (next batch, train for a while, sync, step done). Tests use it
to check the scheduler's guarantees; `tools/simulate_async.py` uses it for cluster-scale what-ifs.
"""

from __future__ import annotations

import asyncio
import random
import selectors
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional

from mcore_rl.data.samples import Prompt, Sample
from mcore_rl.rollout.pool import Generation, GenRequest
from mcore_rl.runtime.scheduler import RolloutScheduler


class _NoIOSelector(selectors.BaseSelector):
    """A selector that never waits: it advances the loop's virtual clock by the timeout instead."""

    def __init__(self) -> None:
        self._keys: dict[Any, selectors.SelectorKey] = {}
        self.loop: Optional["VirtualTimeLoop"] = None

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, _fd(fileobj), events, data)
        self._keys[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(fileobj)

    def select(self, timeout: Optional[float] = None) -> list:
        if timeout is None:
            raise RuntimeError("simulation deadlock: nothing is scheduled and nothing can happen")
        assert self.loop is not None
        self.loop.now += max(0.0, timeout)
        return []

    def get_map(self) -> Any:
        return self._keys

    def close(self) -> None:
        self._keys.clear()


def _fd(fileobj: Any) -> int:
    return fileobj if isinstance(fileobj, int) else fileobj.fileno()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on simulated time (no real I/O may be used on it)."""

    def __init__(self) -> None:
        selector = _NoIOSelector()
        super().__init__(selector)
        selector.loop = self
        self.now = 0.0

    def time(self) -> float:
        return self.now


def run_simulated(coro: Any) -> Any:
    """Run `coro` to completion on a fresh `VirtualTimeLoop`."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


# ---------------------------------------------------------------------------------- engines


@dataclass
class _Running:
    budget: int
    started: float
    version: int
    done: asyncio.Future
    tokens: int = 0


class SimulatedEngines:
    """`num_engines` engines with `slots` concurrent requests each. A request's tokens come at
    `token_time(batch)` s each, `batch` the engine's running requests when it started (a simple
    model of continuous batching: decode steps get slower with more requests)."""

    def __init__(self, num_engines: int, slots: int, token_time: Callable[[int], float]) -> None:
        self.num_engines, self.slots, self.token_time = num_engines, slots, token_time
        self.version = 0
        self.running: list[list[_Running]] = [[] for _ in range(num_engines)]
        self.paused = False
        self._resumed: Optional[asyncio.Event] = None
        self.busy_s = [0.0] * num_engines  # time with at least one request running
        self._busy_since: list[Optional[float]] = [None] * num_engines
        self.requests = 0

    def _event(self) -> asyncio.Event:
        if self._resumed is None:
            self._resumed = asyncio.Event()
            self._resumed.set()
        return self._resumed

    async def generate(self, req: GenRequest) -> Generation:
        loop = asyncio.get_running_loop()
        budget = int(req.sampling_params["max_new_tokens"])
        while True:
            await self._event().wait()
            i = min(range(self.num_engines), key=lambda k: len(self.running[k]))
            if len(self.running[i]) < self.slots:
                break
            await asyncio.sleep(self.token_time(self.slots))  # wait for a slot
        run = _Running(budget, loop.time(), self.version, loop.create_future())
        if not self.running[i]:
            self._busy_since[i] = loop.time()
        self.running[i].append(run)
        self.requests += 1
        duration = budget * self.token_time(len(self.running[i]))
        timer = loop.call_later(duration, lambda: run.done.done() or run.done.set_result("length"))
        try:
            reason = await run.done
        finally:
            timer.cancel()
            self.running[i].remove(run)
            if not self.running[i] and self._busy_since[i] is not None:
                self.busy_s[i] += loop.time() - self._busy_since[i]
                self._busy_since[i] = None
        per_token = duration / max(budget, 1)
        n = budget if reason == "length" else min(budget, int((loop.time() - run.started) / per_token))
        return Generation([1] * n, [-1.0] * n, run.version, reason, "x" * n, f"sim:{i}")

    def pause(self) -> None:
        """`pause_generation(mode=abort)`: in-flight requests end now with what they have."""
        self.paused = True
        self._event().clear()
        for engine in self.running:
            for run in engine:
                if not run.done.done():
                    run.done.set_result("abort")

    def resume(self, version: int) -> None:
        self.version = version
        self.paused = False
        self._event().set()

    def utilisation(self, elapsed: float) -> float:
        now = asyncio.get_running_loop().time()
        busy = sum(b + (now - s if s is not None else 0.0) for b, s in zip(self.busy_s, self._busy_since))
        return busy / max(elapsed * self.num_engines, 1e-9)


# ---------------------------------------------------------------------------------- backend


@dataclass
class SimBackend:
    """Prompts whose budgets are long-tailed: a fraction `long_frac` ask for `long_factor`x tokens."""

    engines: SimulatedEngines
    base_tokens: int = 64
    long_frac: float = 0.25
    long_factor: int = 8
    seed: int = 0
    reward: Callable[[Sample], float] = lambda s: float(len(s.response_ids) % 2)
    filter_constant: bool = False
    drawn: int = 0
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def take_prompt(self) -> Prompt:
        long = self._rng.random() < self.long_frac
        p = Prompt(self.drawn, f"p{self.drawn}", [0], None, "sim",
                   self.base_tokens * (self.long_factor if long else 1))
        self.drawn += 1
        return p

    def prompt_state(self) -> dict[str, Any]:
        return {"drawn": self.drawn}

    def request(self, prompt: Prompt, j: int, prefix: list[int], part: int) -> Optional[GenRequest]:
        budget = (prompt.max_new_tokens or self.base_tokens) - len(prefix)
        return GenRequest(prompt.ids + prefix, {"max_new_tokens": budget}) if budget > 0 else None

    async def generate(self, request: GenRequest) -> Generation:
        return await self.engines.generate(request)

    async def score(self, samples: list[Sample]) -> None:
        for s in samples:
            s.reward = self.reward(s)

    def filter_reason(self, group: list[Sample]) -> Optional[str]:
        if self.filter_constant and len({s.reward for s in group}) == 1:
            return "constant_reward"
        return None

    def error_kind(self, err: BaseException) -> Literal["no_engine", "refused", "other"]:
        return "other"

    def engines_need_weights(self) -> bool:
        return False


@dataclass
class SimulatedRun:
    wall_s: float
    steps: int
    train_s: float  # learner busy time
    engine_utilisation: float
    trainer_utilisation: float
    staleness_mean: float
    staleness_max: float
    batches: list[list[list[Sample]]]
    metrics: list[dict[str, float]]


async def simulate_learner(scheduler: RolloutScheduler, engines: SimulatedEngines, steps: int,
                           train_time: Callable[[list[list[Sample]]], float], sync_time: float = 0.0,
                           keep_batches: bool = False) -> SimulatedRun:
    """`mcore-rl train`'s loop on virtual time: take a batch, train `train_time(batch)` s, pause
    the engines (abort) for `sync_time` s, resume with the new version, open the gate."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    version, train_total = 1, 0.0
    engines.resume(version)
    scheduler.start()
    batches, metrics = [], []
    for _ in range(steps):
        got = await scheduler.next_batch(version)
        assert got is not None
        groups, m = got
        metrics.append(m)
        if keep_batches:
            batches.append(groups)
        t = train_time(groups)
        train_total += t
        await asyncio.sleep(t)
        engines.pause()
        await asyncio.sleep(sync_time)
        version += 1
        engines.resume(version)
        await scheduler.step_done(version)
    wall = loop.time() - start
    util = engines.utilisation(wall)
    await scheduler.close()
    lags = [m["async/staleness_mean"] for m in metrics]
    return SimulatedRun(wall, steps, train_total, util, train_total / max(wall, 1e-9),
                        sum(lags) / max(len(lags), 1), max((m["async/staleness_max"] for m in metrics), default=0.0),
                        batches, metrics)
