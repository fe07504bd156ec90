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
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
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


@dataclass
class EpisodeRecord:
    """What the proxy saw of one episode: its completions in order, joined into segments."""

    episode_id: str
    completions: list[Completion] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    drift: int = 0  # completions whose prompt did not extend the sample so far (each started a new one)
    refused: int = 0  # calls after the episode ended


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
    `engine_errors` count the calls it turned away or could not serve."""

    def __init__(
        self,
        pool: EnginePool,
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

    def open(self, episode_id: str) -> str:
        """Start recording an episode; its base URL for the agent's `openai.OpenAI(base_url=...)`."""
        if "/" in episode_id or not episode_id:
            raise ValueError(f"episode id {episode_id!r}: must be a non-empty string without '/'")
        with self._lock:
            if episode_id in self._episodes or episode_id in self._ended:
                raise ValueError(f"episode {episode_id!r} was already opened")
            self._episodes[episode_id] = EpisodeRecord(episode_id)
        return f"{self.url}/episodes/{episode_id}/v1"

    def end(self, episode_id: str) -> EpisodeRecord:
        """Stop the episode (later calls are refused) and join its completions into segments."""
        with self._lock:
            record = self._episodes.pop(episode_id)
            self._ended[episode_id] = record
        record.segments, record.drift = join_by_prefix(record.completions)
        return record

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
        try:
            gen = await self._generate(GenRequest(list(req.input_ids), sampling))
        except Exception as err:  # the engine refused or failed this call: it costs the call, not the proxy
            self.engine_errors += 1
            return _error(502, f"engine: {type(err).__name__}: {err}", "engine_error")
        versions = gen.output_versions or [gen.weight_version] * len(gen.output_ids)
        completion = Completion(
            list(req.input_ids), list(gen.output_ids), list(gen.output_logprobs), versions, gen.finish_reason, gen.text
        )
        with self._lock:
            if episode_id not in self._episodes:  # ended while the engine was generating
                self.refused_after_end += 1
                live.refused += 1
                return _error(409, f"episode {episode_id!r} ended while this call was generating", "episode_ended")
            live.completions.append(completion)
        return web.json_response(self._response(inp, gen))

    async def _generate(self, req: GenRequest) -> Generation:
        if isinstance(self.pool, HTTPEnginePool):  # concurrent calls on the pool's own event loop
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.pool.agenerate(req), self.pool.loop))

        def one() -> Generation:
            with self._serial:
                return self.pool.generate([req])[0]

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


def _error(status: int, message: str, code: str) -> web.Response:
    """An OpenAI-shaped error body (what the `openai` client raises from)."""
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "code": code}}, status=status
    )
