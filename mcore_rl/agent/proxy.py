"""Unmodified agents: an OpenAI endpoint per episode in front of the engines, recording every token.

An agent written against the `openai` client (chat completions with `tools`) is trained as it is:
the trainer opens an episode on the proxy and hands the agent that episode's base URL
(`http://host:port/episodes/<id>/v1`). Each chat completion is templated and parsed exactly as
`mcore-rl serve` does (`rollout/openai_api.py`: the chat template with the tools, the model family's
tool-call format), but sent to the engines as token ids through an engine pool (the trainer's, or
`HTTPEnginePool` over a served engine), so the proxy records what an OpenAI reply hides: the
prompt ids, the engine's output ids, μ and the weight version of every output token.

When the episode ends, its completions are joined by prefix into samples (`join_by_prefix`): a
completion whose prompt extends the sample so far (the earlier prompt, the model's output ids,
then what the agent appended: tool results, the template's headers) continues that sample, the
appended ids untrainable; one that does not (the agent rewrote or dropped history, a template that
is not append-only, a re-tokenisation that split the model's text differently) starts a new sample,
counted as drift. A call for an episode that has ended is refused with an error naming the episode
(HTTP 409, the `openai` client's `ConflictError`) and counted; a call for an episode never opened
is refused too (404). Only non-streamed completions with `n` = 1 are served: one completion, one
record.

A trainer opens each episode with an `EpisodeRoute`: its completions go through the rollout
scheduler's `generate` on the scheduler's event loop (so the embedded engine pool, stepped from that
loop, serves them as the HTTP pool does), with the run's sampling parameters, within the episode's
limits (completions, output tokens): the call that would exceed one is refused (HTTP 429) and the
episode marked failed with the reason. A completion a weight sync aborted is continued as prompt +
its tokens so far, each token keeping the version it was sampled under.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from aiohttp import web

from mcore_rl.agent.trajectory import Segment
from mcore_rl.data.samples import Prompt, Sample
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.rollout import openai_api
from mcore_rl.rollout.engine.sampling import SamplingParams
from mcore_rl.rollout.pool import EnginePool, Generation, GenRequest, HTTPEnginePool
from mcore_rl.rollout.protocol import RequestError


@dataclass
class Completion:
    """One chat completion as the engine produced it."""

    prompt_ids: list[int]
    output_ids: list[int]
    logps: list[float]  # μ of each output token
    versions: list[int]  # the weight version of each output token
    finish_reason: str
    text: str
    parts: int = 1  # engine requests it took (1 + continuations after weight syncs aborted it)


EngineCall = Callable[[GenRequest], Awaitable[Generation]]


@dataclass(frozen=True)
class EpisodeRoute:
    """How a trainer's episode reaches the engines: `generate` runs on `loop` (the rollout scheduler's:
    engine outages waited out, in-flight requests counted); `sampling` replaces the request's sampling
    fields (the run's temperature, top-p/top-k; `sampling_seed` is varied per completion and part);
    `max_completions` and `max_tokens` (output tokens of the whole episode) bound it."""

    generate: EngineCall
    loop: asyncio.AbstractEventLoop
    sampling: dict[str, Any] = field(default_factory=dict)
    max_completions: int | None = None
    max_tokens: int | None = None
    max_parts: int = 64  # continuations of one completion across weight syncs before it is given up


@dataclass
class EpisodeRecord:
    """What the proxy saw of one episode: its completions in order, joined into segments."""

    episode_id: str
    completions: list[Completion] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    drift: int = 0  # completions whose prompt did not extend the sample so far (each started a new one)
    refused: int = 0  # calls after the episode ended (those still generating at the end included)
    failure: str | None = None  # the limit it exceeded: "max_completions" or "max_tokens"
    route: EpisodeRoute | None = None
    on_failure: Callable[[], None] | None = None  # called (from the proxy's thread) when it fails
    started: int = 0  # completions admitted (finished or generating)
    tokens: int = 0  # output tokens of its finished completions
    inflight: set[concurrent.futures.Future] = field(default_factory=set)


def join_by_prefix(completions: list[Completion]) -> tuple[list[Segment], int]:
    """The completions of one episode as segments (one sample each) and the drift count.

    A completion continues the current segment when its prompt starts with the segment's ids: the
    rest of the prompt is appended untrainable (μ 0.0, the latest version so far), then its output
    trainable with its μ and versions. Otherwise it starts a new segment whose prompt is its own."""
    segments: list[Segment] = []
    drift = 0
    for c in completions:
        seg = segments[-1] if segments else None
        if seg is not None and c.prompt_ids[: len(seg.all_ids)] == seg.all_ids:
            extra = c.prompt_ids[len(seg.all_ids) :]
            latest = max(seg.versions, default=c.versions[0] if c.versions else 0)
            seg.ids += extra
            seg.trainable += [0] * len(extra)
            seg.logps += [0.0] * len(extra)
            seg.versions += [latest] * len(extra)
        else:
            drift += seg is not None
            seg = Segment(list(c.prompt_ids))
            segments.append(seg)
        seg.ids += c.output_ids
        seg.trainable += [1] * len(c.output_ids)
        seg.logps += c.logps
        seg.versions += c.versions
    return segments, drift


def record_samples(record: EpisodeRecord, prompt: Prompt, finish_reason: str, tokenizer: Tokenizer) -> list[Sample]:
    """The episode's segments as samples (as `Trajectory.samples`): the response is what follows the
    segment's prompt up to its last model token; earlier segments end with "split"."""
    live = [s for s in record.segments if any(s.trainable)]
    out = []
    for k, seg in enumerate(live):
        end = max(i for i, t in enumerate(seg.trainable) if t) + 1
        versions = seg.versions[:end]
        out.append(
            Sample(
                replace(prompt, ids=list(seg.prompt_ids)),
                prompt.index,
                seg.ids[:end],
                seg.logps[:end],
                min(v for v, t in zip(versions, seg.trainable) if t),
                finish_reason if k == len(live) - 1 else "split",
                tokenizer.decode(seg.ids[:end]),
                token_versions=versions if len(set(versions)) > 1 else None,
                trainable=seg.trainable[:end],
                step_index=k,
            )
        )
    return out


_DEFAULTS = {f.name: f.default for f in fields(SamplingParams)}


def engine_sampling(params: SamplingParams) -> dict[str, Any]:
    """The request's sampling parameters as SGLang's `sampling_params` (only those away from default)."""
    return {name: getattr(params, name) for name, default in _DEFAULTS.items() if getattr(params, name) != default}


class EpisodeProxy:
    """The proxy server (aiohttp, own thread and event loop): `start()` -> its URL, `open(id)` -> an
    episode's base URL, `end(id)` -> its `EpisodeRecord`. `refused_after_end`, `unknown_episode` and
    `engine_errors` count the calls it turned away or could not serve. `pool`: where episodes opened
    without a route generate (None: every episode brings its `EpisodeRoute`)."""

    def __init__(
        self,
        pool: EnginePool | None,
        tokenizer: Tokenizer,
        *,
        tool_format: str | None,
        context_length: int,
        vocab_size: int,
        model_name: str = "policy",
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.pool, self.tokenizer, self.tool_format = pool, tokenizer, tool_format
        self.context_length, self.vocab_size, self.model_name = context_length, vocab_size, model_name
        self.host, self.port, self.url = host, port, ""
        self.refused_after_end = 0
        self.unknown_episode = 0
        self.engine_errors = 0  # calls the engines failed (answered 502, not recorded)
        self._episodes: dict[str, EpisodeRecord] = {}
        self._ended: dict[str, EpisodeRecord] = {}
        self._lock = threading.Lock()
        self._serial = threading.Lock()  # a pool without an event loop of its own generates one call at a time
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="episode-proxy", daemon=True)
        self._runner: web.AppRunner | None = None
        self.app = web.Application()
        self.app.add_routes(
            [
                web.post("/episodes/{episode}/v1/chat/completions", self._chat),
                web.get("/episodes/{episode}/v1/models", self._models),
            ]
        )

    # ---- the trainer's side ------------------------------------------------------------------

    def start(self) -> str:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()
        return self.url

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]
        self.url = f"http://{self.host}:{self.port}"

    def open(
        self, episode_id: str, route: EpisodeRoute | None = None, on_failure: Callable[[], None] | None = None
    ) -> str:
        """Start recording an episode; its base URL for the agent's `openai.OpenAI(base_url=...)`.
        `route`: the trainer's way to the engines and the episode's limits (None: the proxy's pool,
        no limits); `on_failure()` is called from the proxy's thread when a limit fails the episode."""
        if "/" in episode_id or not episode_id:
            raise ValueError(f"episode id {episode_id!r}: must be a non-empty string without '/'")
        with self._lock:
            if episode_id in self._episodes or episode_id in self._ended:
                raise ValueError(f"episode {episode_id!r} was already opened")
            self._episodes[episode_id] = EpisodeRecord(episode_id, route=route, on_failure=on_failure)
        return f"{self.url}/episodes/{episode_id}/v1"

    def end(self, episode_id: str) -> EpisodeRecord:
        """Stop the episode (later calls are refused; calls still generating are cancelled and
        counted as refused) and join its completions into segments."""
        with self._lock:
            record = self._episodes.pop(episode_id)
            self._ended[episode_id] = record
            for fut in record.inflight:
                fut.cancel()  # the engine's work for a finished episode is released
            record.refused += len(record.inflight)  # each will be answered 409
            self.refused_after_end += len(record.inflight)
            record.inflight.clear()  # (so the call's handler knows it was counted here)
        record.segments, record.drift = join_by_prefix(record.completions)
        return record

    def forget(self, episode_id: str) -> None:
        """Drop an ended episode's record (a long run opens many); later calls answer 404."""
        with self._lock:
            self._ended.pop(episode_id, None)

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        if self._runner is not None and self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread.is_alive():
            self._thread.join()
        self._loop.close()

    def __enter__(self) -> EpisodeProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the agent's side --------------------------------------------------------------------

    def _live(self, episode_id: str) -> EpisodeRecord | web.Response:
        """The episode's record, or the error response refusing the call (counted)."""
        with self._lock:
            if episode_id in self._episodes:
                return self._episodes[episode_id]
            if episode_id in self._ended:
                self.refused_after_end += 1
                self._ended[episode_id].refused += 1
                return _error(
                    409,
                    f"episode {episode_id!r} has ended: its samples were taken, a call after the end is refused",
                    "episode_ended",
                )
            self.unknown_episode += 1
        return _error(404, f"episode {episode_id!r} was never opened on this proxy", "episode_not_found")

    async def _models(self, request: web.Request) -> web.Response:
        live = self._live(request.match_info["episode"])
        if isinstance(live, web.Response):
            return live
        return web.json_response(openai_api.models_list(self.model_name, self.context_length))

    async def _chat(self, request: web.Request) -> web.Response:
        episode_id = request.match_info["episode"]
        live = self._live(episode_id)
        if isinstance(live, web.Response):
            return live
        try:
            body = await request.json()
        except json.JSONDecodeError as err:
            return _error(400, f"body: not JSON ({err.msg})", "invalid_request_error")
        try:
            if isinstance(body, dict) and body.get("stream"):
                raise RequestError("stream: the episode proxy serves whole completions only (stream: false)")
            if isinstance(body, dict) and body.get("n", 1) not in (1, None):
                raise RequestError("n: the episode proxy records one completion per call (n: 1)")
            inp = openai_api.parse_chat(
                body,
                tokenizer=self.tokenizer,
                vocab_size=self.vocab_size,
                context_length=self.context_length,
                tool_format=self.tool_format,
            )
        except RequestError as err:
            return _error(400, str(err), "invalid_request_error")
        req = inp.requests[0]
        sampling = engine_sampling(req.sampling)
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            # "as long as the context allows"; an explicit limit must leave a position free (SGLang's check)
            sampling["max_new_tokens"] = self.context_length - len(req.input_ids) - 1
        with self._lock:
            refusal = self._admit(live, sampling)
        if refusal is not None:
            return refusal
        ended = _error(409, f"episode {episode_id!r} ended while this call was generating", "episode_ended")
        fut: concurrent.futures.Future | None = None
        try:
            if live.route is not None:  # on the scheduler's loop; end() cancels it and counts it refused
                fut = asyncio.run_coroutine_threadsafe(
                    complete(live.route.generate, GenRequest(list(req.input_ids), sampling), live.route.max_parts),
                    live.route.loop,
                )
                with self._lock:
                    if episode_id not in self._episodes:
                        fut.cancel()
                        live.refused += 1
                        self.refused_after_end += 1
                        return ended
                    live.inflight.add(fut)
                gen, parts = await asyncio.wrap_future(fut)
            else:
                gen, parts = await self._generate(GenRequest(list(req.input_ids), sampling)), 1
        except asyncio.CancelledError:
            if fut is None or not fut.cancelled():
                raise  # the agent went away: aiohttp cancels the handler
            return ended  # the episode ended while this call was generating (counted by end())
        except Exception as err:  # the engine refused or failed this call: it costs the call, not the proxy
            self.engine_errors += 1
            with self._lock:
                if fut is not None:
                    live.inflight.discard(fut)
            return _error(502, f"engine: {type(err).__name__}: {err}", "engine_error")
        versions = gen.output_versions or [gen.weight_version] * len(gen.output_ids)
        completion = Completion(
            list(req.input_ids),
            list(gen.output_ids),
            list(gen.output_logprobs),
            versions,
            gen.finish_reason,
            gen.text,
            parts=parts,
        )
        with self._lock:
            counted = fut is not None and fut not in live.inflight  # end() took it from the set and counted it
            if fut is not None:
                live.inflight.discard(fut)
            if episode_id not in self._episodes:  # ended while the engine was generating
                if not counted:
                    self.refused_after_end += 1
                    live.refused += 1
                return ended
            live.completions.append(completion)
            live.tokens += len(completion.output_ids)
        return web.json_response(self._response(inp, gen))

    def _admit(self, live: EpisodeRecord, sampling: dict[str, Any]) -> web.Response | None:
        """Within the episode's limits (under the lock): the call's sampling set from the route, its
        budget cut to what the episode has left; else the refusal, the episode failed."""
        route = live.route
        if route is None:
            return None
        if live.failure is None and route.max_completions is not None and live.started >= route.max_completions:
            self._fail(live, "max_completions")
        left = None if route.max_tokens is None else route.max_tokens - live.tokens
        if live.failure is None and left is not None and left <= 0:
            self._fail(live, "max_tokens")
        if live.failure is not None:
            return _error(
                429,
                f"episode {live.episode_id!r} exceeded its {live.failure} "
                f"({route.max_completions} completions, {route.max_tokens} output tokens): it is lost",
                live.failure,
            )
        for name in ("temperature", "top_p", "top_k", "min_p"):  # the run's sampling, not the agent's
            sampling.pop(name, None)
        sampling.update({k: v for k, v in route.sampling.items() if k != "max_new_tokens"})
        if "sampling_seed" in sampling:  # each completion its own draw, reproducible
            sampling["sampling_seed"] = (int(sampling["sampling_seed"]) + 7919 * live.started) % (2**31 - 1)
        if left is not None:
            sampling["max_new_tokens"] = min(int(sampling.get("max_new_tokens", left)), left)
        live.started += 1
        return None

    def _fail(self, live: EpisodeRecord, reason: str) -> None:
        live.failure = reason
        if live.on_failure is not None:
            live.on_failure()

    async def _generate(self, req: GenRequest) -> Generation:
        """An episode without a route: through the proxy's own pool."""
        pool = self.pool
        if pool is None:
            raise RuntimeError("the proxy has no engine pool and the episode no route")
        if isinstance(pool, HTTPEnginePool):  # concurrent calls on the pool's own event loop
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(pool.agenerate(req), pool.loop))

        def one() -> Generation:
            with self._serial:
                return pool.generate([req])[0]

        return await asyncio.get_running_loop().run_in_executor(None, one)

    def _response(self, inp: openai_api.OpenAIInput, gen: Generation) -> dict[str, Any]:
        message, reason = openai_api.chat_message(inp, gen.text, gen.finish_reason)
        logprobs = None
        if inp.logprobs is not None:
            pairs = list(zip(gen.output_logprobs, gen.output_ids))
            logprobs = {"content": openai_api.chat_logprobs(pairs, [[] for _ in pairs], self.tokenizer, 0)}
        prompt, completion = len(inp.prompts[0]), len(gen.output_ids)
        return {
            "id": f"chatcmpl-{inp.id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": inp.model or self.model_name,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        }


async def complete(generate: EngineCall, req: GenRequest, max_parts: int = 64) -> tuple[Generation, int]:
    """One completion to its end: a request a weight sync aborted is sent again as prompt + tokens so
    far (its own sampling seed per part), each token keeping its μ and the version it was sampled under.
    Returns the whole completion and the requests it took."""
    ids: list[int] = []
    logps: list[float] = []
    versions: list[int] = []
    text, last = "", None
    budget = int(req.sampling_params.get("max_new_tokens", 1 << 30))
    for part in range(max_parts):
        sampling = dict(req.sampling_params, max_new_tokens=budget - len(ids))
        if sampling["max_new_tokens"] <= 0:  # aborted on its last token of budget
            break
        if "sampling_seed" in sampling:
            sampling["sampling_seed"] = (int(sampling["sampling_seed"]) + 104729 * part) % (2**31 - 1)
        last = await generate(replace(req, input_ids=list(req.input_ids) + ids, sampling_params=sampling))
        ids += list(last.output_ids)
        logps += list(last.output_logprobs)
        versions += list(last.output_versions or [last.weight_version] * len(last.output_ids))
        text += last.text  # pieces decode separately; exact for byte-level tokenizers
        if last.finish_reason != "abort":
            break
    else:
        raise RuntimeError(f"a completion was cut off {max_parts} times by weight syncs without finishing")
    if last is None:
        raise RuntimeError("a completion with no token budget")
    finish = last.finish_reason if last.finish_reason != "abort" else "length"
    out = Generation(ids, logps, min(versions, default=last.weight_version), finish, text, last.engine, versions)
    return out, part + 1


def _error(status: int, message: str, code: str) -> web.Response:
    """An OpenAI-shaped error body (what the `openai` client raises from)."""
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "code": code}}, status=status
    )
