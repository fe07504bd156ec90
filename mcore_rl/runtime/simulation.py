"""Discrete-event simulation of the asynchronous runtime: the real scheduler on a virtual clock.

`VirtualTimeLoop` is an asyncio event loop whose clock jumps to the next scheduled callback
instead of sleeping, so `await asyncio.sleep(3600)` costs nothing and a simulated day runs in
seconds. `SimulatedEngines` is an engine pool in that world: it generates a token every
`token_time(batch)` seconds per request, holds requests beyond its slots, and pauses like SGLang
for a weight sync (`abort` ends in-flight requests with their partial output). `SimBackend` gives
the `RolloutScheduler` prompts with long-tailed budgets and these engines; `simulate_learner`
drives it like `mcore-rl train` does (next batch, train for a while, sync, step done). Tests use it
to check the scheduler's guarantees.

For cluster-scale what-ifs (`benchmarks/simulate_async.py`) there is a second engine model,
`ContinuousBatchingEngines`: N inference instances whose requests all advance one token per decode
step, the step time growing with the running requests and their summed context (`DecodeModel`), a
prefill that stalls the instance, slots and a KV-token budget per instance, and one FIFO queue in
front of them; `LengthsBackend` draws long-tailed response lengths (`ResponseLengths`: a per-prompt
difficulty times a per-sample factor, both lognormal, capped; optionally a fraction of prompts k
times longer). A simulated token may stand for `token_unit` real tokens, so that a cluster step of
tens of millions of tokens costs the scheduler's lists only a few thousand entries per sample batch.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import random
import selectors
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal
from collections.abc import Callable

from mcore_rl.data.samples import Prompt, Sample
from mcore_rl.rollout.pool import Generation, GenRequest
from mcore_rl.runtime.scheduler import RolloutScheduler


class _NoIOSelector(selectors.BaseSelector):
    """A selector that never waits: it advances the loop's virtual clock by the timeout instead."""

    def __init__(self) -> None:
        self._keys: dict[Any, selectors.SelectorKey] = {}
        self.loop: VirtualTimeLoop | None = None

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, _fd(fileobj), events, data)
        self._keys[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(fileobj)

    def select(self, timeout: float | None = None) -> list:
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


class _PausesForSyncs:
    """What both simulated engine pools share: the weight version and SGLang's pause for a sync
    (new requests wait while paused; `resume(version)` ends the sync)."""

    def __init__(self) -> None:
        self.version = 0
        self.paused = False
        self._resumed: asyncio.Event | None = None

    def _event(self) -> asyncio.Event:
        if self._resumed is None:
            self._resumed = asyncio.Event()
            self._resumed.set()
        return self._resumed

    def _pause(self) -> None:
        self.paused = True
        self._event().clear()

    def _resume(self, version: int) -> None:
        self.version = version
        self.paused = False
        self._event().set()


class SimulatedEngines(_PausesForSyncs):
    """`num_engines` engines with `slots` concurrent requests each. A request's tokens come at
    `token_time(batch)` s each, `batch` the engine's running requests when it started (a simple
    model of continuous batching: decode steps get slower with more requests)."""

    def __init__(self, num_engines: int, slots: int, token_time: Callable[[int], float]) -> None:
        super().__init__()
        self.num_engines, self.slots, self.token_time = num_engines, slots, token_time
        self.running: list[list[_Running]] = [[] for _ in range(num_engines)]
        self.busy_s = [0.0] * num_engines  # time with at least one request running
        self._busy_since: list[float | None] = [None] * num_engines
        self.requests = 0

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

        def finish_at_budget() -> None:
            if not run.done.done():
                run.done.set_result("length")

        timer = loop.call_later(duration, finish_at_budget)
        try:
            reason = await run.done
        finally:
            timer.cancel()
            self.running[i].remove(run)
            since = self._busy_since[i]
            if not self.running[i] and since is not None:
                self.busy_s[i] += loop.time() - since
                self._busy_since[i] = None
        per_token = duration / max(budget, 1)
        n = budget if reason == "length" else min(budget, int((loop.time() - run.started) / per_token))
        return Generation([1] * n, [-1.0] * n, run.version, reason, "x" * n, f"sim:{i}")

    def pause(self) -> None:
        """`pause_generation(mode=abort)`: in-flight requests end now with what they have."""
        self._pause()
        for engine in self.running:
            for run in engine:
                if not run.done.done():
                    run.done.set_result("abort")

    def resume(self, version: int) -> None:
        self._resume(version)

    def utilisation(self, elapsed: float) -> float:
        now = asyncio.get_running_loop().time()
        busy = sum(b + (now - s if s is not None else 0.0) for b, s in zip(self.busy_s, self._busy_since))
        return busy / max(elapsed * self.num_engines, 1e-9)


@dataclass(frozen=True)
class DecodeModel:
    """Cost model of one inference instance (one engine process, TP GPUs) under continuous batching.

    A decode step of `n` running requests whose contexts (prompt + tokens so far) sum to `ctx`
    tokens takes `step_fixed_s + n * step_per_seq_s + ctx * step_per_ctx_token_s` seconds: the
    fixed part is reading the weights plus per-step overhead, the per-sequence part the matmul work
    of one more token, the per-context-token part reading the KV cache (decode is memory bound).
    A prefill of `p` tokens stalls the instance for `p * prefill_per_token_s + p**2 *
    prefill_per_token2_s` seconds (linear layers + causal attention). `slots` bounds the running
    requests (SGLang's max_running_requests) and `kv_tokens` the summed context at admission.
    """

    step_fixed_s: float
    step_per_seq_s: float
    step_per_ctx_token_s: float
    prefill_per_token_s: float
    prefill_per_token2_s: float = 0.0
    slots: int = 256
    kv_tokens: float = math.inf

    def step_s(self, n: int, ctx: float) -> float:
        return self.step_fixed_s + n * self.step_per_seq_s + ctx * self.step_per_ctx_token_s

    def prefill_s(self, tokens: float) -> float:
        return tokens * self.prefill_per_token_s + tokens * tokens * self.prefill_per_token2_s


@dataclass(eq=False)
class _Req:
    tokens: float  # real tokens this request will decode if not aborted
    ctx: float  # real tokens of its input
    done: asyncio.Future
    version: int = 0
    v_start: float = 0.0  # the instance's decode-step counter when it joined
    v_end: float = 0.0
    instance: int = -1
    generated: float = 0.0


class _Instance:
    """One inference instance. Between two events (a request joins, finishes or is aborted) every
    running request advances at the same rate, one token per step; `v` counts the steps done, so a
    request that joined at v0 and decodes k tokens finishes when v reaches v0 + k. The summed
    context grows by n per step, so the step time is linear in the steps done since the last event
    and the time of u steps is step0 * u + c * n * u**2 / 2 (c the per-context-token cost)."""

    def __init__(self, index: int, model: DecodeModel) -> None:
        self.index, self.model = index, model
        self.running: dict[_Req, None] = {}  # insertion-ordered, so that runs are reproducible
        self.heap: list[tuple[float, int, _Req]] = []
        self.v = 0.0
        self.ctx = 0.0
        self.t = 0.0
        self.stall_until = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.busy_s = 0.0  # time with at least one request (decoding or prefilling)
        self.occupancy_s = 0.0  # integral of running requests over time
        self.decoded = 0.0  # real tokens decoded (aborted ones included)
        self.prefilled = 0.0

    def advance(self, now: float) -> None:
        n = len(self.running)
        if n and now > self.t:
            self.busy_s += now - self.t
            self.occupancy_s += n * (now - self.t)
            dt = now - max(self.t, self.stall_until)
            if dt > 0:
                step0 = self.model.step_s(n, self.ctx)
                b = self.model.step_per_ctx_token_s * n
                u = 2.0 * dt / (step0 + math.sqrt(step0 * step0 + 2.0 * b * dt))
                self.v += u
                self.ctx += n * u
                self.decoded += n * u
        self.t = max(self.t, now)

    def time_to(self, v_target: float) -> float:
        """Seconds of decoding (after any stall) until the step counter reaches `v_target`."""
        u = max(0.0, v_target - self.v)
        n = len(self.running)
        return self.model.step_s(n, self.ctx) * u + self.model.step_per_ctx_token_s * n * u * u / 2.0

    def remove(self, req: _Req) -> None:
        self.running.pop(req, None)
        self.ctx -= req.ctx + (self.v - req.v_start)
        if not self.running:
            self.ctx, self.heap = 0.0, []


class ContinuousBatchingEngines(_PausesForSyncs):
    """`num_engines` inference instances behind one FIFO queue (a request goes to the instance with
    the fewest running requests that has a free slot and KV room). Each instance runs
    `DecodeModel`'s continuous batching; `pause()` is SGLang's `pause_generation(mode="abort")`:
    running requests end now with the tokens they have (queued ones wait and start with the new
    weights); `resume(version)` is the end of a weight sync. A request's input and output lengths
    are counted in simulated tokens of `token_unit` real tokens each; `sampling_params` carries
    `max_new_tokens` and, optionally, `sim_stop_after`: the simulated tokens after which the answer
    ends by itself (finish "stop"). Continued requests (partial rollouts) prefill their whole input
    again: the weights changed, so the prefix cache was flushed; no prefix cache is modelled at all
    (the G samples of a prompt each prefill the prompt)."""

    def __init__(self, num_engines: int, model: DecodeModel, token_unit: int = 1) -> None:
        super().__init__()
        self.num_engines, self.model, self.token_unit = num_engines, model, token_unit
        self.instances = [_Instance(i, model) for i in range(num_engines)]
        self.queue: deque[_Req] = deque()
        self.requests = 0
        self._seq = itertools.count()
        self._dispatch_pending = False

    @property
    def slots(self) -> int:
        return self.model.slots

    def _loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    async def generate(self, req: GenRequest) -> Generation:
        unit = self.token_unit
        budget = int(req.sampling_params["max_new_tokens"])
        stop_after = int(req.sampling_params.get("sim_stop_after", budget))
        out = max(0, min(budget, stop_after))
        await self._event().wait()
        run = _Req(float(out * unit), float(len(req.input_ids) * unit), self._loop().create_future())
        self.queue.append(run)
        self.requests += 1
        if not self._dispatch_pending:  # requests arriving at one instant are placed together
            self._dispatch_pending = True
            self._loop().call_soon(self._dispatch)
        reason = await run.done
        if reason == "abort":
            n = min(out, int(run.generated / unit + 1e-6))
        else:
            n = out
            reason = "stop" if "sim_stop_after" in req.sampling_params and stop_after <= budget else "length"
        return Generation([1] * n, [-1.0] * n, run.version, reason, "", f"sim:{run.instance}")

    def _dispatch(self) -> None:
        self._dispatch_pending = False
        if self.paused:
            return
        now = self._loop().time()
        touched: dict[int, None] = {}
        while self.queue:
            req = self.queue[0]
            best, best_n = None, self.model.slots
            for inst in self.instances:  # the least loaded instance with a free slot and KV room
                n = len(inst.running)
                if n < best_n and (not n or inst.ctx + req.ctx <= self.model.kv_tokens):
                    best, best_n = inst, n
            if best is None:
                break
            self.queue.popleft()
            best.advance(now)
            best.stall_until = max(now, best.stall_until) + self.model.prefill_s(req.ctx)
            best.prefilled += req.ctx
            req.version, req.instance = self.version, best.index
            req.v_start, req.v_end = best.v, best.v + req.tokens
            best.running[req] = None
            best.ctx += req.ctx
            heapq.heappush(best.heap, (req.v_end, next(self._seq), req))
            touched[best.index] = None
        for i in touched:
            self._schedule(self.instances[i])

    def _schedule(self, inst: _Instance) -> None:
        if inst.timer is not None:
            inst.timer.cancel()
            inst.timer = None
        while inst.heap and inst.heap[0][2].done.done():
            heapq.heappop(inst.heap)
        if not inst.heap:
            return
        loop = self._loop()
        target = inst.heap[0][2]
        start = max(loop.time(), inst.stall_until)
        inst.timer = loop.call_at(start + inst.time_to(target.v_end), self._finish, inst, target)

    def _finish(self, inst: _Instance, target: _Req) -> None:
        inst.timer = None
        inst.advance(self._loop().time())
        if inst.v < target.v_end:  # float round-off of the inverse: the step counter is there
            inst.ctx += len(inst.running) * (target.v_end - inst.v)
            inst.v = target.v_end
        while inst.heap and inst.heap[0][0] <= inst.v + 1e-6:
            _, _, req = heapq.heappop(inst.heap)
            if req.done.done():
                continue
            inst.remove(req)
            req.generated = req.tokens
            req.done.set_result("done")
        self._dispatch()
        self._schedule(inst)

    def pause(self) -> None:
        """`pause_generation(mode=abort)`: running requests end now with what they have."""
        self._pause()
        now = self._loop().time()
        for inst in self.instances:
            inst.advance(now)
            for req in inst.running:
                req.generated = min(req.tokens, inst.v - req.v_start)
                req.done.set_result("abort")
            inst.running, inst.heap, inst.ctx = {}, [], 0.0
            inst.stall_until = now
            if inst.timer is not None:
                inst.timer.cancel()
                inst.timer = None

    def resume(self, version: int) -> None:
        self._resume(version)
        self._dispatch()

    def counters(self) -> dict[str, float]:
        """Cumulative instance-seconds busy, request-seconds running, real tokens decoded/prefilled."""
        now = self._loop().time()
        for inst in self.instances:
            inst.advance(now)
        return {
            "busy_s": sum(i.busy_s for i in self.instances),
            "occupancy_s": sum(i.occupancy_s for i in self.instances),
            "decoded": sum(i.decoded for i in self.instances),
            "prefilled": sum(i.prefilled for i in self.instances),
            "queued": float(len(self.queue)),
        }

    def utilisation(self, elapsed: float) -> float:
        """Fraction of instance-time with at least one request (the `SimulatedEngines` measure)."""
        return self.counters()["busy_s"] / max(elapsed * self.num_engines, 1e-9)


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
        p = Prompt(self.drawn, f"p{self.drawn}", [0], None, "sim", self.base_tokens * (self.long_factor if long else 1))
        self.drawn += 1
        return p

    def prompt_state(self) -> dict[str, Any]:
        return {"drawn": self.drawn}

    def request(self, prompt: Prompt, j: int, prefix: list[int], part: int) -> GenRequest | None:
        budget = (prompt.max_new_tokens or self.base_tokens) - len(prefix)
        return GenRequest(prompt.ids + prefix, {"max_new_tokens": budget}) if budget > 0 else None

    async def generate(self, request: GenRequest) -> Generation:
        return await self.engines.generate(request)

    async def score(self, samples: list[Sample]) -> None:
        for s in samples:
            s.reward = self.reward(s)

    def filter_reason(self, group: list[Sample]) -> str | None:
        if self.filter_constant and len({s.reward for s in group}) == 1:
            return "constant_reward"
        return None

    def error_kind(self, err: BaseException) -> Literal["no_engine", "refused", "other"]:
        return "other"

    def engines_need_weights(self) -> bool:
        return False

    # a simulated run has no second source of samples and no group or batch steps
    def co_count(self, prompt: Prompt, group_size: int) -> int:
        return 0

    async def co_generate(self, prompt: Prompt, count: int) -> list[Sample]:
        return []

    async def repair(self, groups: list[list[Sample]]) -> list[list[Sample]]:
        return groups

    def finish(self, groups: list[list[Sample]]) -> tuple[list[list[Sample]], dict[str, float]]:
        return groups, {}

    @property
    def temperature(self) -> float:
        return 1.0

    def stale_ok(self, sample: Sample) -> bool:
        return False


@dataclass(frozen=True)
class ResponseLengths:
    """Long-tailed response lengths, in real tokens: sample j of a prompt answers in
    `median * d * x_j` tokens, capped at `cap`, where the prompt's difficulty d ~ LogNormal(0,
    sigma_prompt) (times `long_factor` for a fraction `long_frac` of prompts) and x_j ~
    LogNormal(0, sigma_sample). The samples of one prompt are correlated (hard prompts get long
    answers), as in reasoning RL; a sample at the cap finishes by "length"."""

    median: float = 4096.0
    sigma_prompt: float = 0.6
    sigma_sample: float = 0.6
    cap: int = 28672
    long_frac: float = 0.0
    long_factor: float = 1.0

    def difficulty(self, u1: float, u2: float) -> float:
        """From two uniforms in (0, 1)."""
        d = math.exp(self.sigma_prompt * _STD_NORMAL.inv_cdf(u1))
        return d * (self.long_factor if u2 < self.long_frac else 1.0)

    def length(self, u: float, difficulty: float) -> int:
        x = math.exp(self.sigma_sample * _STD_NORMAL.inv_cdf(u))
        return max(1, min(self.cap, round(self.median * difficulty * x)))

    def mean(self, n: int = 200_000, seed: int = 1) -> float:
        rng = random.Random(seed)
        return (
            sum(self.length(rng.random() or 0.5, self.difficulty(rng.random() or 0.5, rng.random())) for _ in range(n))
            / n
        )


_STD_NORMAL = statistics.NormalDist()


def _uniform(*keys: int) -> float:
    """A uniform in (0, 1) that is a fixed function of the integer keys (splitmix64 over them)."""
    h = 0x9E3779B97F4A7C15
    for k in keys:
        h = (h ^ (k & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return ((h >> 11) + 0.5) / float(1 << 53)


@dataclass
class LengthsBackend(SimBackend):
    """`SimBackend` whose answers end by themselves at lengths drawn from `lengths`, with prompts of
    `prompt_tokens` real tokens; token counts are in simulated tokens of `token_unit` real tokens.
    The draws are functions of (seed, prompt index, sample, attempt), so runs with different
    schedules see the same prompts and answers (common random numbers: their differences are the
    schedule's, not the dice's). A sample started from scratch (first try, restart, regeneration)
    draws a new answer; a continued one keeps its length."""

    lengths: ResponseLengths = field(default_factory=ResponseLengths)
    prompt_tokens: int = 256
    token_unit: int = 1
    _difficulty: dict[int, float] = field(init=False, default_factory=dict)
    _target: dict[tuple[int, int], int] = field(init=False, default_factory=dict)
    _attempts: dict[tuple[int, int], int] = field(init=False, default_factory=dict)

    def _units(self, tokens: float) -> int:
        return max(1, math.ceil(tokens / self.token_unit))

    def take_prompt(self) -> Prompt:
        p = Prompt(
            self.drawn,
            f"p{self.drawn}",
            [0] * self._units(self.prompt_tokens),
            None,
            "sim",
            self._units(self.lengths.cap),
        )
        u1, u2 = _uniform(self.seed, p.index, 1), _uniform(self.seed, p.index, 2)
        self._difficulty[p.index] = self.lengths.difficulty(u1, u2)
        self.drawn += 1
        return p

    def request(self, prompt: Prompt, j: int, prefix: list[int], part: int) -> GenRequest | None:
        key = (prompt.index, j)
        if not prefix or key not in self._target:  # a fresh answer
            n = self._attempts[key] = self._attempts.get(key, -1) + 1
            u = _uniform(self.seed, prompt.index, 3, j, n)
            self._target[key] = self._units(self.lengths.length(u, self._difficulty[prompt.index]))
        budget = (prompt.max_new_tokens or 1) - len(prefix)
        if budget <= 0:
            return None
        params: dict[str, Any] = {"max_new_tokens": budget}
        if self._target[key] < (prompt.max_new_tokens or 1):  # ends by itself before the cap
            params["sim_stop_after"] = self._target[key] - len(prefix)
        return GenRequest(prompt.ids + prefix, params, rid=f"{prompt.index}:{j}:{part}")


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
    step_ends: list[float] = field(default_factory=list)  # time each step's sync ended, from the start
    train_times: list[float] = field(default_factory=list)  # each step's training seconds


async def simulate_learner(
    scheduler: RolloutScheduler,
    engines: Any,
    steps: int,
    train_time: Callable[[list[list[Sample]]], float],
    sync_time: float = 0.0,
    keep_batches: bool = False,
    on_step: Callable[[int, list[list[Sample]], dict[str, float]], None] | None = None,
) -> SimulatedRun:
    """`mcore-rl train`'s loop on virtual time: take a batch, train `train_time(batch)` s, pause
    the engines (abort) for `sync_time` s, resume with the new version, open the gate.
    `engines` is a `SimulatedEngines` or a `ContinuousBatchingEngines`; `on_step(k, groups,
    metrics)` is called after step k's sync (e.g. to read the engines' counters)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    version, train_total = 1, 0.0
    engines.resume(version)
    scheduler.start()
    batches, metrics, ends, trains = [], [], [], []
    for k in range(steps):
        got = await scheduler.next_batch(version)
        assert got is not None
        groups, m = got
        metrics.append(m)
        if keep_batches:
            batches.append(groups)
        t = train_time(groups)
        train_total += t
        trains.append(t)
        await asyncio.sleep(t)
        engines.pause()
        await asyncio.sleep(sync_time)
        version += 1
        engines.resume(version)
        await scheduler.step_done(version)
        ends.append(loop.time() - start)
        if on_step is not None:
            on_step(k, groups, m)
    wall = loop.time() - start
    util = engines.utilisation(wall)
    await scheduler.close()
    lags = [m["async/staleness_mean"] for m in metrics]
    return SimulatedRun(
        wall,
        steps,
        train_total,
        util,
        train_total / max(wall, 1e-9),
        sum(lags) / max(len(lags), 1),
        max((m["async/staleness_max"] for m in metrics), default=0.0),
        batches,
        metrics,
        ends,
        trains,
    )
