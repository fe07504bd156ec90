"""The rollout scheduler, the one rollout path: engines kept busy, staleness gated at submission.

Two schedules. Streaming (`rollout.runtime: async`), below. Synchronous (`SchedulerConfig.rounds`,
max_staleness 0): each batch is drawn when the learner asks for it (`next_batch`), in rounds of
groups submitted together, the filtered and failed ones refilled by further rounds. Both produce a
group the same way (`produce_group`), score it, run the round's group steps (`backend.repair`),
filter it, and run the batch steps (`backend.finish`) as the batch is handed out.

One coroutine (`run`) submits groups (a prompt x G samples) while the staleness gate, the in-flight
bound and the buffer bound allow; each group runs as its own task: G requests to the engines,
continued across weight syncs (partial rollouts: a request the sync's `pause_generation(abort)`
ended is sent again as prompt + tokens so far, and its tokens keep the version and μ that produced
them), then scored by the reward workers, then filtered or put in the buffer. The learner takes
the `batch_groups` oldest groups (by prompt index) when that many are ready; a group that came out
too stale anyway is dropped or regenerated, by config. Engine failures: the pool fails a request
over to another engine; with no engine left the request waits (an engine may come back) and after
`no_engine_timeout_s` the run stops with a clear error.

The scheduler knows nothing of HTTP or of the trainer: it runs on any asyncio loop through a
`RolloutBackend`. The trainer runs it through `runtime/rollouts.py`; the cluster
simulator (`benchmarks/simulate_async.py`) runs the same code on a virtual-time loop with simulated
engines. Time is the loop's clock (`loop.time()`), so both measure the same quantities.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter, deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, Protocol
from collections.abc import Awaitable, Callable

from mcore_rl.agent.episodes import episode_metrics
from mcore_rl.data.samples import Prompt, Sample, SampleMarks, TeacherScores, compact_routing
from mcore_rl.rollout.pool import Generation, GenRequest
from mcore_rl.runtime.accounting import SampleLedger
from mcore_rl.runtime.staleness import StalenessGate

logger = logging.getLogger(__name__)


class RolloutBackend(Protocol):
    """What the scheduler needs from the world: prompts, engines, rewards. A backend may also have
    `group_size(prompt) -> int` (a multi-domain run: each domain's group size; else `cfg.group_size`)."""

    def take_prompt(self) -> Prompt: ...

    def prompt_state(self) -> dict[str, Any]: ...

    def request(self, prompt: Prompt, j: int, prefix: list[int], part: int) -> GenRequest | None:
        """The request for sample j of `prompt`, continuing `prefix` (its tokens so far, part > 0);
        None when `prefix` used up the sample's token budget."""
        ...

    def generate(self, request: GenRequest) -> Awaitable[Generation]: ...

    def score(self, samples: list[Sample]) -> Awaitable[None]: ...

    def filter_reason(self, group: list[Sample]) -> str | None:
        """Why the group is not trained on (e.g. "constant_reward"), or None to keep it."""
        ...

    def error_kind(self, err: BaseException) -> Literal["no_engine", "refused", "other"]: ...

    def engines_need_weights(self) -> bool:
        """No engine serves, but some wait for the current weights (the trainer should re-sync)."""
        ...

    def co_count(self, prompt: Prompt, group_size: int) -> int:
        """How many of the group's first samples a second source generates (0: none)."""
        ...

    def co_generate(self, prompt: Prompt, count: int) -> Awaitable[list[Sample]]:
        """The second source's `count` samples of `prompt` (unscored)."""
        ...

    def repair(self, groups: list[list[Sample]]) -> Awaitable[list[list[Sample]]]:
        """The group steps of one round of scored groups (repairs, what a round ended as)."""
        ...

    def finish(self, groups: list[list[Sample]]) -> tuple[list[list[Sample]], dict[str, float]]:
        """The batch steps of the groups handed to the learner: (groups, their metrics)."""
        ...

    @property
    def temperature(self) -> float:
        """The sampling temperature of the training stream now."""
        ...

    def stale_ok(self, sample: Sample) -> bool:
        """True for a sample that is old by design (its version does not make its group stale)."""
        ...


class EpisodeBackend(RolloutBackend, Protocol):
    """A backend with multi-turn domains: `run_episodes(prompt, generate)` is the group of an
    environment prompt (its episodes, each turn through `generate`), None for any other prompt."""

    def run_episodes(
        self, prompt: Prompt, generate: Callable[[GenRequest], Awaitable[Generation]]
    ) -> Awaitable[list[Sample]] | None: ...


@dataclass
class SchedulerConfig:
    group_size: int
    batch_groups: int
    max_staleness: int = 0
    max_inflight_groups: int = 1 << 30
    buffer_groups: int = 0  # 0 = (max_staleness + 1) * batch_groups
    # a group whose oldest token is more than max_staleness versions old at batch time: dropped,
    # regenerated (at most max_regenerations times, then dropped), or kept (the gate alone bounds
    # the version a group starts with, as AReaL does; long answers that ran across many syncs train)
    stale_policy: Literal["drop", "regenerate", "keep"] = "drop"
    max_regenerations: int = 2
    partial_rollouts: bool = True  # continue aborted requests (else start them again)
    no_engine_timeout_s: float = 120.0
    retry_interval_s: float = 0.5
    max_parts: int = 64  # continuations of one request before its partial output is kept as is
    total_steps: int | None = None  # the run's training steps (no prompts drawn beyond them)
    # the synchronous schedule (max_staleness 0): each batch is drawn when the learner asks for it,
    # in rounds of groups submitted together (an embedded engine batches a round's requests as one);
    # filtered or failed groups are refilled by further rounds, at most `max_rounds`, each drawing
    # what is missing over the keep rate seen so far, at most `max_oversample` times as many
    rounds: bool = False
    max_rounds: int = 1
    max_oversample: float = 1.0

    def __post_init__(self) -> None:
        if self.buffer_groups <= 0:
            self.buffer_groups = (self.max_staleness + 1) * self.batch_groups
        if self.rounds and self.max_staleness != 0:
            raise ValueError(f"rounds (the synchronous schedule) needs max_staleness 0, got {self.max_staleness}")


class GroupFailed(Exception):
    """A group cannot be completed (an engine refused a request, ...); `reason` is recorded."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EnginesLost(RuntimeError):
    """No engine has served for longer than `rollout.no_engine_timeout_s`."""


@dataclass
class _Job:
    prompt: Prompt
    regenerations: int = 0


@dataclass
class _Partial:
    """A sample being generated, possibly across several requests (weight syncs in between)."""

    ids: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str = "abort"
    text: str = ""
    engine: str = ""
    routed: Any = None  # routing replay: the latest response's routed experts, for the whole sequence
    # sampling-mask replay: the supports of `ids` (flat ids, per-token counts); None without
    mask_ids: list[int] | None = None
    mask_counts: list[int] | None = None


@dataclass
class _Window:
    """Measurements since the last batch was handed out."""

    start: float
    idle_s: float = 0.0  # time with no request in flight
    inflight_area: float = 0.0  # integral of in-flight requests over time
    continued: int = 0
    restarted: int = 0
    dropped: int = 0
    regenerated: int = 0
    failed: Counter = field(default_factory=Counter)
    filtered: Counter = field(default_factory=Counter)


@dataclass
class RoundStats:
    """One batch of the synchronous schedule: its rounds of groups."""

    prompts_drawn: int = 0
    groups_kept: int = 0
    rounds: int = 0
    seconds_generate: float = 0.0
    seconds_reward: float = 0.0
    fallback: bool = False  # no group passed the filter in any round: the last round was used unfiltered
    temperature: float = float("nan")  # the sampling temperature of the batch (a stage's)

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/prompts_drawn": float(self.prompts_drawn),
            "rollout/groups_kept": float(self.groups_kept),
            "rollout/rounds": float(self.rounds),
            "time/generate_s": self.seconds_generate,
            "time/reward_s": self.seconds_reward,
            "rollout/dynamic_sampling_fallback": float(self.fallback),
            "rollout/temperature": self.temperature,
        }


class RolloutScheduler:
    def __init__(self, backend: RolloutBackend, cfg: SchedulerConfig) -> None:
        self.backend, self.cfg = backend, cfg
        self.gate = StalenessGate(cfg.batch_groups, cfg.max_staleness, cfg.total_steps)
        self.ledger = SampleLedger()
        self.buffer: list[list[Sample]] = []  # finished groups, by prompt index
        self.retry: deque[_Job] = deque()  # to submit before new prompts (regenerations, resumed in-flight)
        self.running: dict[int, _Job] = {}  # prompt index -> job in flight
        self.steps_done = 0
        self.inflight_requests = 0
        self.fatal: BaseException | None = None
        self._tasks: set[asyncio.Task] = set()
        self._changed: asyncio.Condition | None = None
        self._no_engine_since: float | None = None
        self._window: _Window | None = None
        self._last_t: float | None = None
        self._main: asyncio.Task | None = None
        self._closed = False
        self._round_times = (0.0, 0.0)  # the last round's start and the end of its generation

    # ------------------------------------------------------------------ clock and bookkeeping

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _tick(self) -> None:
        """Integrate the in-flight count up to now (call before it changes)."""
        now = self._now()
        if self._window is None:
            self._window = _Window(now)
        dt = now - self._last_t if self._last_t is not None else 0.0
        if self.inflight_requests == 0:
            self._window.idle_s += dt
        self._window.inflight_area += dt * self.inflight_requests
        self._last_t = now

    def pending(self) -> int:
        return len(self.running) + len(self.retry) + len(self.buffer)

    def accepted(self) -> int:
        return self.ledger.trained + len(self.buffer)

    async def _notify(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    # ------------------------------------------------------------------ producer

    def start(self) -> None:
        """Start submitting (on the running loop)."""
        self._changed = asyncio.Condition()
        self._last_t = self._now()
        self._window = _Window(self._last_t)
        if not self.cfg.rounds:  # the synchronous schedule draws each batch in `next_batch`
            self._main = asyncio.get_running_loop().create_task(self.run())

    def _may_submit(self) -> bool:
        c = self.cfg
        return (
            self.fatal is None
            and not self._closed
            and self.gate.capacity(self.steps_done, self.accepted(), len(self.running)) > 0
            and len(self.running) < c.max_inflight_groups
            and len(self.buffer) + len(self.running) < c.buffer_groups
        )

    async def run(self) -> None:
        assert self._changed is not None
        while not self._closed:
            while self._may_submit():
                if self.retry:
                    job = self.retry.popleft()
                else:
                    job = _Job(self.backend.take_prompt())
                    self.ledger.drawn += 1
                self.running[job.prompt.index] = job
                task = asyncio.get_running_loop().create_task(self._run_group(job))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            async with self._changed:
                await self._changed.wait()

    async def _run_group(self, job: _Job) -> None:
        """A group from submission to the buffer (a round of one); a cancelled group (the run
        stops) stays pending."""
        for group, reason in await self._run_round([job]):
            if reason is None:
                self.buffer.append(group)
                self.buffer.sort(key=lambda g: g[0].prompt.index)
        await self._notify()

    async def _run_round(self, jobs: list[_Job]) -> list[tuple[list[Sample], str | None]]:
        """Groups submitted together: each produced and scored, then the round's group steps
        (`backend.repair`) on all of them, then the filter. Returns (group, why it is filtered
        or None) for each group that did not fail, in submission order."""
        for job in jobs:
            self.running[job.prompt.index] = job
        start = self._now()
        produced = await asyncio.gather(*(self._produce_scored(job) for job in jobs))
        self._round_times = (start, max((t for _, t in produced if t is not None), default=start))
        done = [(job, g) for job, (g, _) in zip(jobs, produced) if g is not None]
        try:
            groups = await self.backend.repair([g for _, g in done])
        except asyncio.CancelledError:
            raise
        except Exception as err:  # a failing group step costs the round's groups, not the run
            logger.exception("the group steps of a round of %d groups failed", len(done))
            for job, _ in done:
                self._fail(job, f"group step: {type(err).__name__}: {err}"[:200])
            return []
        out: list[tuple[list[Sample], str | None]] = []
        for (job, _), group in zip(done, groups):
            self.running.pop(job.prompt.index, None)
            reason = self.backend.filter_reason(group)
            if reason is not None:
                self.ledger.filtered[reason] += 1
                self._win().filtered[reason] += 1
            out.append((group, reason))
        return out

    async def _produce_scored(self, job: _Job) -> tuple[list[Sample] | None, float | None]:
        """The job's group, scored, and when its generation ended; (None, None) if it failed
        (recorded)."""
        try:
            group = await self.produce_group(job.prompt)
            generated = self._now()
            await self.backend.score(group)
            for x in group:
                x.marks = replace(x.marks, regenerations=job.regenerations)
            return group, generated
        except asyncio.CancelledError:
            raise
        except GroupFailed as err:
            self._fail(job, err.reason)
        except EnginesLost as err:
            self.fatal = self.fatal or err
            self._fail(job, "no engine")
        except Exception as err:
            logger.exception("rollout group of prompt %d failed", job.prompt.index)
            self._fail(job, f"{type(err).__name__}: {err}"[:200])
        return None, None

    async def produce_group(self, prompt: Prompt) -> list[Sample]:
        """The one place a group of samples for one prompt is produced from the backend (unscored):
        the second source's first samples, if any, and the engines' others, each continued across
        weight syncs."""
        episodes = getattr(self.backend, "run_episodes", None)  # the seam of multi-turn domains
        run = episodes(prompt, self._generate) if episodes is not None else None
        if run is not None:  # an environment prompt: its group is its episodes (`mcore_rl.agent`)
            return await run
        size = self._group_size(prompt)
        co = self.backend.co_count(prompt, size)
        theirs, mine = await asyncio.gather(
            self.backend.co_generate(prompt, co),
            asyncio.gather(*(self._run_sample(prompt, j) for j in range(co, size))),
        )
        return list(theirs) + [self._sample(prompt, p) for p in mine]

    def _group_size(self, prompt: Prompt) -> int:
        """The prompt's domain's group size when the backend has one per domain, else the config's."""
        per_domain = getattr(self.backend, "group_size", None)
        return per_domain(prompt) if per_domain is not None else self.cfg.group_size

    def _fail(self, job: _Job, reason: str) -> None:
        self.running.pop(job.prompt.index, None)
        self.ledger.failed[reason] += 1
        self._win().failed[reason] += 1

    def _win(self) -> _Window:
        if self._window is None:
            self._window = _Window(self._now())
        return self._window

    async def _run_sample(self, prompt: Prompt, j: int) -> _Partial:
        out = _Partial()
        for part in range(self.cfg.max_parts + 1):
            if part == self.cfg.max_parts:
                raise GroupFailed(f"a request was cut off {part} time(s) by weight syncs without finishing")
            req = self.backend.request(prompt, j, out.ids, part)
            if req is None:  # no token budget left: a request aborted on its last token
                out.finish = "length"
                break
            gen = await self._generate(req)
            if gen.finish_reason == "abort" and not self.cfg.partial_rollouts:
                out = _Partial()  # start again, from scratch, with the weights the engine has now
                self.ledger.restarted += 1
                self._win().restarted += 1
                continue
            out.ids += list(gen.output_ids)
            if gen.output_sampling_masks is not None:  # sampling-mask replay: μ is the processed log-prob
                out.logps += list(gen.output_sampling_logprobs or ())
                out.mask_ids = (out.mask_ids or []) + [int(i) for m in gen.output_sampling_masks for i in m]
                out.mask_counts = (out.mask_counts or []) + [len(m) for m in gen.output_sampling_masks]
            else:
                out.logps += list(gen.output_logprobs)
            out.versions += list(gen.output_versions or [gen.weight_version] * len(gen.output_ids))
            out.text += gen.text  # pieces decode separately; exact for byte-level tokenizers
            out.finish, out.engine = gen.finish_reason, gen.engine
            if gen.routed_experts is not None:  # prompt + tokens so far were prefilled again: covers them all
                out.routed = gen.routed_experts
            if gen.finish_reason != "abort":
                break
            self.ledger.continued += 1
            self._win().continued += 1
        return out

    async def _generate(self, req: GenRequest) -> Generation:
        """One request; waits out a time with no engine (up to `no_engine_timeout_s`)."""
        while True:
            self._tick()
            self.inflight_requests += 1
            try:
                gen = await self.backend.generate(req)
                self._no_engine_since = None
                return gen
            except asyncio.CancelledError:
                raise
            except Exception as err:
                kind = self.backend.error_kind(err)
                if kind == "refused":
                    raise GroupFailed(f"engine refused the request: {err}"[:200]) from err
                if kind != "no_engine":
                    raise GroupFailed(f"{type(err).__name__}: {err}"[:200]) from err
                now = self._now()
                self._no_engine_since = self._no_engine_since or now
                if now - self._no_engine_since > self.cfg.no_engine_timeout_s:
                    raise EnginesLost(
                        f"no inference engine has answered for {now - self._no_engine_since:.0f} s "
                        f"(rollout.no_engine_timeout_s={self.cfg.no_engine_timeout_s:g}); last error: "
                        f"{err}"
                    ) from err
            finally:
                self._tick()
                self.inflight_requests -= 1
            await asyncio.sleep(self.cfg.retry_interval_s)

    def _sample(self, prompt: Prompt, p: _Partial) -> Sample:
        versions = p.versions
        return Sample(
            prompt,
            prompt.index,
            p.ids,
            p.logps,
            min(versions) if versions else 0,
            p.finish,
            p.text,
            p.engine,
            token_versions=list(versions) if len(set(versions)) > 1 else None,
            routed_experts=compact_routing(p.routed),
            sampling_mask_ids=p.mask_ids,
            sampling_mask_counts=p.mask_counts,
        )

    # ------------------------------------------------------------------ consumer (the learner)

    async def next_batch(
        self, trainer_version: int, poll_s: float = 1.0
    ) -> tuple[list[list[Sample]], dict[str, float]] | None:
        """The next `batch_groups` groups for weights `trainer_version`, and the metrics of the
        window since the last batch; None when engines wait for weights (re-sync, then call again)."""
        assert self._changed is not None
        if self.cfg.rounds:
            return await self._next_batch_in_rounds()
        start = self._now()
        while True:
            if self.fatal is not None:
                raise self.fatal
            if len(self.buffer) >= self.cfg.batch_groups:
                groups = self.buffer[: self.cfg.batch_groups]
                stale = [
                    g for g in groups if self.gate.is_too_stale(trainer_version, self._version(g, trainer_version))
                ]
                kept_stale = len(stale) if self.cfg.stale_policy == "keep" else 0
                if kept_stale:
                    stale = []
                if not stale:
                    self.buffer = self.buffer[self.cfg.batch_groups :]
                    self.ledger.count_trained(groups)
                    metrics = self._metrics(groups, trainer_version, self._now() - start)
                    metrics["async/kept_stale"] = float(kept_stale)
                    groups, finished = self.backend.finish(groups)
                    await self._notify()
                    return groups, {**metrics, **finished}
                self.buffer = [g for g in self.buffer if not any(g is x for x in stale)]
                for g in stale:
                    done = g[0].marks.regenerations
                    if self.cfg.stale_policy == "regenerate" and done < self.cfg.max_regenerations:
                        self.ledger.regenerated_stale += 1
                        self._win().regenerated += 1
                        self.retry.append(_Job(g[0].prompt, done + 1))
                    else:
                        self.ledger.dropped_stale += 1
                        self._win().dropped += 1
                await self._notify()  # their places are free: replacements get submitted
                continue
            if self.backend.engines_need_weights():
                return None
            if not self.running and not self.retry and not self._may_submit():
                raise RuntimeError(
                    f"rollout scheduler stalled: the batch needs {self.cfg.batch_groups} groups, {len(self.buffer)} are "
                    f"ready, none in flight, and the staleness gate admits none (steps done {self.steps_done}, "
                    f"trained {self.ledger.trained}); step_done() was not called for a finished step"
                )
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), poll_s)
                except TimeoutError:
                    pass

    async def _next_batch_in_rounds(self) -> tuple[list[list[Sample]], dict[str, float]] | None:
        """The synchronous schedule: a batch drawn now, in rounds (see `SchedulerConfig.rounds`);
        None when engines wait for weights."""
        if self.fatal is not None:
            raise self.fatal
        if self.backend.engines_need_weights():
            return None
        c = self.cfg
        stats = RoundStats(temperature=self.backend.temperature)
        kept: list[list[Sample]] = []
        last: list[tuple[list[Sample], str | None]] = []
        seen = 0
        while len(kept) < c.batch_groups and stats.rounds < c.max_rounds:
            needed = c.batch_groups - len(kept)
            keep_rate = len(kept) / seen if seen else 1.0
            n = max(1, math.ceil(needed * min(1.0 / max(keep_rate, 1e-9), c.max_oversample)))
            jobs = []
            for _ in range(n):
                if self.retry:
                    jobs.append(self.retry.popleft())
                else:
                    jobs.append(_Job(self.backend.take_prompt()))
                    self.ledger.drawn += 1
                    stats.prompts_drawn += 1
            last = await self._run_round(jobs)
            start, generated = self._round_times
            stats.rounds += 1
            stats.seconds_generate += generated - start
            stats.seconds_reward += self._now() - generated
            seen += len(last)
            kept += [g for g, reason in last if reason is None]
            if self.fatal is not None:
                raise self.fatal
        batch, surplus = kept[: c.batch_groups], kept[c.batch_groups :]
        stats.groups_kept = len(batch)
        if surplus:  # kept by an oversampled round beyond the batch
            self.ledger.filtered["surplus"] += len(surplus)
        if not batch and last:  # nothing passed the filter in any round: train on the last round
            stats.fallback = True  # (zero advantages: the update only moves by the KL/entropy terms)
            batch = [g for g, _ in last]
            self.ledger.filtered.subtract(reason for _, reason in last if reason is not None)
            self.ledger.filtered = +self.ledger.filtered  # (no reason left at zero)
        self.ledger.count_trained(batch)
        self._window = _Window(self._now())
        batch, finished = self.backend.finish(batch)
        return batch, {**stats.metrics(), **finished, **episode_metrics(batch)}

    def _version(self, group: list[Sample], trainer_version: int) -> int:
        """The oldest weight version of the group's samples (those old by design aside)."""
        return min((x.policy_version for x in group if not self.backend.stale_ok(x)), default=trainer_version)

    async def step_done(self, version: int) -> None:
        """The learner finished a step and synced `version`: the gate opens one batch further."""
        self.steps_done += 1
        await self._notify()

    def _metrics(self, groups: list[list[Sample]], trainer_version: int, waited_s: float) -> dict[str, float]:
        self._tick()
        w = self._win()
        span = max(self._now() - w.start, 1e-9)
        lag_tokens: Counter = Counter()
        for g in groups:
            for x in g:
                if x.token_versions is None:  # one version: count without a list per token
                    lag_tokens[trainer_version - x.policy_version] += len(x.response_ids)
                else:
                    lag_tokens.update(trainer_version - v for v in x.token_versions)
        total = sum(lag_tokens.values())
        out: dict[str, float] = {
            "async/trainer_wait_s": waited_s,
            "async/buffer_groups": float(len(self.buffer)),
            "async/buffer_fill": len(self.buffer) / self.cfg.buffer_groups,
            "async/inflight_requests": float(self.inflight_requests),
            "async/inflight_requests_mean": w.inflight_area / span,
            "async/engine_idle_frac": w.idle_s / span,
            "async/partial_continued": float(w.continued),
            "async/restarted": float(w.restarted),
            "async/dropped_stale": float(w.dropped),
            "async/regenerated_stale": float(w.regenerated),
            "async/failed": float(sum(w.failed.values())),
            "async/filtered": float(sum(w.filtered.values())),
            "async/staleness_mean": sum(k * n for k, n in lag_tokens.items()) / total if total else 0.0,
            "async/staleness_max": float(max(lag_tokens)) if lag_tokens else 0.0,
            "async/partial_samples": float(sum(s.token_versions is not None for g in groups for s in g)),
        }
        for lag, n in sorted(lag_tokens.items()):
            out[f"async/staleness_tokens_lag{lag}"] = n / total
        for reason, n in w.failed.items():
            out[f"async/failed/{_key(reason)}"] = float(n)
        for reason, n in w.filtered.items():
            out[f"async/filtered/{_key(reason)}"] = float(n)
        out.update(episode_metrics(groups))  # multi-turn domains
        self._window = _Window(self._now())
        return out

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Buffer, pending prompts (in flight now: sent again after a resume) and counts; call on the
        scheduler's loop, so it is one consistent snapshot."""
        pending = sorted(self.running.values(), key=lambda j: j.prompt.index) + list(self.retry)
        return {
            "buffer": [[asdict(s) for s in g] for g in self.buffer],
            "pending": [{**asdict(j.prompt), "_regenerations": j.regenerations} for j in pending],
            "ledger": self.ledger.state_dict(),
            "steps_done": self.steps_done,
            "prompts": self.backend.prompt_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Before `start`: the buffered groups come back, the pending prompts are sent again first."""
        self.buffer = [[sample_from_state(s) for s in g] for g in state["buffer"]]
        self.retry = deque(
            _Job(Prompt(**{k: v for k, v in p.items() if k != "_regenerations"}), int(p.get("_regenerations", 0)))
            for p in state["pending"]
        )
        self.ledger.load_state_dict(state["ledger"])
        self.ledger.resent_after_resume += len(self.retry)
        self.ledger.restored_buffered += len(self.buffer)
        self.steps_done = int(state["steps_done"])

    async def close(self) -> None:
        self._closed = True
        tasks = list(self._tasks) + ([self._main] if self._main is not None else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _key(reason: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in reason.lower())[:40].strip("_")


def sample_from_state(d: dict[str, Any]) -> Sample:
    d = dict(d)
    d["prompt"] = Prompt(**d["prompt"])
    if d.get("teacher") is not None:
        d["teacher"] = TeacherScores(**d["teacher"])
    d["info"] = dict(d.get("info") or {})
    d["marks"] = SampleMarks.restore(d.get("marks"), d["info"])
    return Sample(**d)
