"""The embedded engine's HTTP server: SGLang's native endpoints and the OpenAI ones (aiohttp).

Routes, methods and reply shapes are SGLang's (`entrypoints/http_server.py`):

    GET  /health, /health_generate            200 or 503, empty body
    GET  /model_info, /server_info (SGLang's current names; /get_model_info, /get_server_info too),
         /get_weight_version, /get_load
    POST /generate (also PUT)                  JSON, or server-sent events when "stream": true
    POST /tokenize, /v1/tokenize               {"tokens", "count", "max_model_len"}
    POST /detokenize, /v1/detokenize           {"text"}
    POST /abort_request                        {"rid", "abort_all"} -> 200, empty body
    POST /pause_generation {"mode"}, /continue_generation -> {"message", "status": "ok"}
    GET|POST /flush_cache                      200 text, or 400 while requests are in flight
    POST /update_weights_from_disk, /update_weights_from_tensor, /update_weights_from_distributed,
         /init_weights_update_group, /destroy_weights_update_group, /update_weight_version
                                               {"success", "message"}; 200, or 400 on failure
    GET|POST /get_weights_by_name {"name", "truncate_size"} -> the weight's first rows (float lists)
    GET  /weights_checksum                     ours: {"weight_version", "checksum", "num_tensors"}
    GET|POST /release_memory_occupation, /resume_memory_occupation {"tags"} -> 200, null
    GET  /v1/models, /v1/models/{model}; POST /v1/completions, /v1/chat/completions

With `--is-embedding` the server serves a reward model instead, on SGLang's `/classify`
(`classifier.py`; `build_server` picks it).

A bad request gets HTTP 400 `{"error": {"message": "<field>: ...", "code": 400}}` (also a prompt
that can never fit the KV pool, `--max-total-tokens` / `--mem-fraction-static`); a request the
engine cannot serve now (memory released, weights zero after a resume, held `MAX_HOLD_S` while
paused) gets 503 at once, never an open-ended wait; an internal failure of one request gets 500
and the server keeps serving the others. Weight updates run
through `EngineDriver.update_weights` (see there for how they interact with generation) and the
handlers of `weight_receiver`, which read files only from `--weight-dirs`.

Authentication is SGLang's (`srt/utils/auth.py`): with `--api-key`, every endpoint needs
`Authorization: Bearer <key>` (or `x-api-key: <key>`), else 401 `{"error": "Unauthorized"}`;
with `--admin-api-key`, the weight and control endpoints (`ADMIN_PATHS`, SGLang's
`ADMIN_OPTIONAL` ones) need that key instead and no longer accept the api key, while the others
stay under `--api-key` (open if it is unset). `/health*` and OPTIONS are always open.

Shutdown (`run_server`): SIGTERM or SIGINT stops accepting, fails what is in flight, and exits
within `SHUTDOWN_GRACE_S` even if something still hangs (a rendezvous with a trainer that never
comes, a stuck broadcast or step): blocking group work runs on daemon threads, and a watchdog
ends the process when the grace period is over.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any
from collections.abc import AsyncIterator, Callable

import torch
from aiohttp import web

import mcore_rl
from mcore_rl.data.tool_calls import tool_call_format_for
from mcore_rl.rollout.client import ADMIN_PATHS
from mcore_rl.rollout import openai_api, weight_receiver
from mcore_rl.rollout.engine.driver import PAUSE_MODES, EngineDead, EngineDriver, EngineNotReady, RequestStream
from mcore_rl.rollout.engine.core import MEMORY_TAGS, EngineCore, Request, RequestOutput
from mcore_rl.rollout.engine.sampling import SamplingParams
from mcore_rl.rollout.launch_flags import ServerArgs
from mcore_rl.rollout.protocol import (
    SSE_DONE,
    RequestError,
    check_fields,
    dumps,
    error_body,
    generate_output,
    show,
    parse_generate,
    sse,
)

if TYPE_CHECKING:
    from mcore_rl.rollout.classifier import ClassifierServer

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 20.0  # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT default
MAX_BODY_BYTES = 1 << 33  # /update_weights_from_tensor carries whole buckets as base64
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
SHUTDOWN_GRACE_S = 3.0  # SIGTERM -> exited, whatever still hangs
# SGLang's ADMIN_OPTIONAL endpoints: --admin-api-key (if set) guards these instead of --api-key.
_BASE_REQ = {"rid": (str,), "http_worker_ipc": (str,)}  # SGLang's BaseReq fields: routing only


class EngineServer:
    """The aiohttp application serving one `EngineDriver`."""

    def __init__(self, engine: EngineDriver, args: ServerArgs | None = None) -> None:
        self.engine = engine
        self.core: EngineCore = engine.core
        self.tokenizer = self.core.tokenizer
        self.args = args or ServerArgs(model_path=self.core.model_path)
        self.weight_dirs = self.args.allowed_weight_dirs
        # how chat replies are read for tool calls: --tool-call-parser, else the model family's format
        self.tool_format = self.args.tool_call_parser or tool_call_format_for(self.core.hf_model_type or "")
        auth = auth_middleware(self.args.api_key, self.args.admin_api_key)
        self.app = web.Application(middlewares=[auth, _errors], client_max_size=MAX_BODY_BYTES)
        get, post = web.get, web.post
        self.app.add_routes(
            [
                get("/health", self.health),
                get("/health_generate", self.health_generate),
                get("/get_model_info", self.get_model_info),
                get("/model_info", self.get_model_info),
                get("/get_server_info", self.get_server_info),
                get("/server_info", self.get_server_info),
                get("/get_weight_version", self.get_weight_version),
                get("/get_load", self.get_load),
                post("/generate", self.generate),
                web.put("/generate", self.generate),
                post("/tokenize", self.tokenize),
                post("/v1/tokenize", self.tokenize),
                post("/detokenize", self.detokenize),
                post("/v1/detokenize", self.detokenize),
                post("/abort_request", self.abort_request),
                post("/pause_generation", self.pause_generation),
                post("/continue_generation", self.continue_generation),
                get("/flush_cache", self.flush_cache),
                post("/flush_cache", self.flush_cache),
                post("/update_weights_from_disk", self.update_weights_from_disk),
                post("/update_weights_from_tensor", self.update_weights_from_tensor),
                post("/update_weights_from_distributed", self.update_weights_from_distributed),
                post("/init_weights_update_group", self.init_weights_update_group),
                post("/destroy_weights_update_group", self.destroy_weights_update_group),
                post("/update_weight_version", self.update_weight_version),
                get("/get_weights_by_name", self.get_weights_by_name),
                post("/get_weights_by_name", self.get_weights_by_name),
                get("/weights_checksum", self.weights_checksum),
                get("/release_memory_occupation", self.release_memory_occupation),
                post("/release_memory_occupation", self.release_memory_occupation),
                get("/resume_memory_occupation", self.resume_memory_occupation),
                post("/resume_memory_occupation", self.resume_memory_occupation),
                get("/v1/models", self.v1_models),
                get("/v1/models/{model:.+}", self.v1_model),
                post("/v1/completions", self.v1_completions),
                post("/v1/chat/completions", self.v1_chat_completions),
            ]
        )

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine: requests in flight fail (503)."""
        self.engine.close(timeout)

    # ---- health and info -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """200 while the engine thread answers (a no-op round trip), else 503."""
        return web.Response(status=200 if await self.engine.ping(HEALTH_TIMEOUT_S) else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """Generate one token, as SGLang's health check does; while paused (or memory is released)
        the round trip only, since a request would be held."""
        if self.engine.holding:
            return await self.health(request)
        req = Request(
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
            input_ids=[0],
            sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
        )
        try:
            stream = await self.engine.submit(req)
            try:
                await asyncio.wait_for(stream.result(), HEALTH_TIMEOUT_S)
            finally:
                stream.close()
        except (TimeoutError, EngineDead, RuntimeError):
            return web.Response(status=503)
        return web.Response(status=200)

    async def get_model_info(self, request: web.Request) -> web.Response:
        """SGLang's model info: the path of the weights served (the last `/update_weights_from_disk`
        that succeeded moves it, as in SGLang), and the checkpoint's own HF `model_type` and
        `architectures` (e.g. llama / LlamaForCausalLM), not the engine's internal config class."""
        return _json(
            {
                "model_path": self.core.model_path,
                "tokenizer_path": self.args.tokenizer_path or self.core.tokenizer_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": str(self.core.weight_version),
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": self.core.hf_model_type,
                "architectures": self.core.hf_architectures,
            }
        )

    async def get_server_info(self, request: web.Request) -> web.Response:
        core = self.core
        return _json(
            {
                **self.args.to_dict(),
                "weight_version": str(core.weight_version),
                "context_length": core.context_length,
                "max_running_requests": core.max_running_requests,
                "max_total_num_tokens": core.max_total_num_tokens,  # the KV pool's size in tokens (SGLang's name)
                "max_req_input_len": core.max_req_len - 1,
                "dtype": core.dtype_name,
                "quantization": core.quantization,
                "logprobs_mode": core.logprobs_mode,  # sampling-mask replay: "raw" | "processed" output_token_logprobs
                "sampling_mask_max_tokens": core.sampling_mask_max_tokens,
                "internal_states": [
                    {
                        "num_running_reqs": core.num_running_reqs,
                        "num_waiting_reqs": core.num_waiting_reqs,
                        "paused": self.engine.paused,
                        "memory_released": core.released_memory(),
                        "weights_need_reload": core.weights_need_reload,
                    }
                ],
                "version": mcore_rl.__version__,
                "engine": "mcore-rl embedded",
            }
        )

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return _json({"weight_version": str(self.core.weight_version)})

    async def get_load(self, request: web.Request) -> web.Response:
        """SGLang's `/get_load` shape, one entry per DP rank: requests (running + waiting, held
        ones included), and tokens (in the KV cache + of waiting prompts; `num_pending_tokens` the
        latter)."""
        load = self.engine.load()
        return _json(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": load["running"] + load["waiting"],
                    "num_waiting_reqs": load["waiting"],
                    "num_tokens": load["cached_tokens"] + load["waiting_tokens"],
                    "num_pending_tokens": load["waiting_tokens"],
                    "ts_tic": time.perf_counter(),
                }
            ]
        )

    # ---- tokenizer -------------------------------------------------------------------------

    async def tokenize(self, request: web.Request) -> web.Response:
        return _json(
            openai_api.tokenize(await _body(request), tokenizer=self.tokenizer, context_length=self.core.context_length)
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        return _json(
            openai_api.detokenize(await _body(request), tokenizer=self.tokenizer, vocab_size=self.core.vocab_size)
        )

    # ---- generation ------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_generate(
            await _body(request),
            tokenizer=self.tokenizer,
            vocab_size=self.core.vocab_size,
            context_length=self.core.context_length,
            enable_return_routed_experts=self.args.enable_return_routed_experts,
            sampling_mask_max_tokens=self.core.sampling_mask_max_tokens,
        )
        streams = await self._submit(parsed.requests)

        def render(i: int, out: RequestOutput) -> dict:
            s = streams[i]
            return generate_output(
                out,
                s.req,
                tokenizer=self.tokenizer,
                return_text_in_logprobs=parsed.return_text_in_logprobs,
                e2e_latency=time.monotonic() - s.created,
            )

        try:
            if not parsed.stream:
                outs = await asyncio.gather(*(s.result() for s in streams))
                results = [render(i, o) for i, o in enumerate(outs)]
                return _json(results[0] if parsed.is_single else results)

            sent = [(0, 0)] * len(streams)  # (output ids, text characters) already streamed, per request

            def chunk(i: int, out: RequestOutput) -> dict:
                data = render(i, out)
                if self.args.incremental_streaming_output:  # SGLang's flag: each chunk carries only what is new
                    data = data | _new_part(data, out, streams[i].req, sent, i)
                return data if parsed.is_single else data | {"index": i}

            return await _stream_sse(request, streams, chunk)
        finally:
            for s in streams:
                s.close()

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _body(request)
        check_fields(
            body,
            {"rid", "abort_all", "abort_message"},
            {"finished_reason": (dict,), "http_worker_ipc": (str,)},
            {"weight_versions": None},
        )
        rid, abort_all = body.get("rid") or "", body.get("abort_all", False)
        message = body.get("abort_message") or "Aborted by request"
        if not isinstance(rid, str):
            raise RequestError(f"rid: expected a string, got {rid!r}")
        if not isinstance(abort_all, bool):
            raise RequestError(f"abort_all: expected true or false, got {abort_all!r}")
        if not isinstance(message, str):
            raise RequestError(f"abort_message: expected a string, got {message!r}")
        if abort_all:
            await self.engine.abort_all(message)
        elif rid:
            await self.engine.abort(rid, message)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await _body(request)
        check_fields(body, {"mode"}, _BASE_REQ, set())
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode: expected one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        await self.engine.pause(mode)
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        body = await _body(request)
        check_fields(body, set(), _BASE_REQ | {"torch_empty_cache": (bool,)}, set())
        await self.engine.resume()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = await self.engine.flush_cache()
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n",
            status=200 if ok else 400,
        )

    # ---- weights ---------------------------------------------------------------------------

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """SGLang's: on success the served `model_path` becomes the request's (`/model_info`,
        `/server_info`); the served model name and the weight directories stay those of the launch."""
        handler = functools.partial(weight_receiver.update_weights_from_disk, allowed_dirs=self.weight_dirs)

        def load(core: EngineCore, body: dict) -> dict:
            reply = handler(core, body)  # raises (a 400 reply) or answers success false on a failed load
            if reply.get("success"):
                core.model_path = body["model_path"]
                self.args = dataclasses.replace(
                    self.args,
                    model_path=core.model_path,
                    served_model_name=self.args.model_name,
                    weight_dirs=self.weight_dirs,
                )
            return reply

        return await self._update(request, load, report_paused=True)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        handler = functools.partial(weight_receiver.update_weights_from_tensor, allowed_dirs=self.weight_dirs)
        return await self._update(request, handler)

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        return await self._update(request, weight_receiver.update_weights_from_distributed)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        # A rendezvous with the trainer, not a weight change: generation goes on meanwhile. On a
        # daemon thread, so a trainer that never comes cannot keep the process from exiting.
        body = await _body(request)
        return _weight_reply(
            await _on_daemon_thread(_checked, weight_receiver.init_weights_update_group, self.core, body)
        )

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _body(request)
        return _weight_reply(
            await _on_daemon_thread(_checked, weight_receiver.destroy_weights_update_group, self.core, body)
        )

    async def update_weight_version(self, request: web.Request) -> web.Response:
        """SGLang's: any string version; running requests are aborted unless `abort_all_requests` is false."""
        body = await _body(request)
        check_fields(body, {"new_version", "abort_all_requests"}, _BASE_REQ, set())
        if "new_version" not in body:
            raise RequestError("new_version: required")
        version = body["new_version"]
        if isinstance(version, int) and not isinstance(version, bool):
            version = str(version)
        if not isinstance(version, str):
            raise RequestError(f"new_version: expected a string, got {show(version)}")
        abort = body.get("abort_all_requests", True)
        if not isinstance(abort, bool):
            raise RequestError(f"abort_all_requests: expected true or false, got {show(abort)}")
        if abort:
            await self.engine.abort_all("Aborted for a weight version update")
        await self.engine.call(lambda core: setattr(core, "weight_version", weight_receiver.core_version(version)))
        return _json({"success": True, "message": f"Weight version updated to {version}", "new_version": version})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await _body(request)
        check_fields(body, {"name", "truncate_size"}, _BASE_REQ, set())
        name, size = body.get("name"), body.get("truncate_size", 100)
        if not isinstance(name, str) or not name:
            raise RequestError(f"name: expected a weight name, got {show(name)}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise RequestError(f"truncate_size: expected an integer >= 0, got {show(size)}")
        try:
            weights = await self.engine.call(lambda core: weight_receiver.get_weights_by_name(core, name, size))
        except ValueError as err:
            raise RequestError(str(err)) from None
        if weights is None:  # SGLang's reply for a name the model does not have
            return _json({"error": {"message": "Get parameter by name failed"}}, status=400)
        return _json(weights)

    async def weights_checksum(self, request: web.Request) -> web.Response:
        """Ours (SGLang has none): the checksum of the tensors this engine received and the version
        it serves, which the trainer compares with its own after every sync
        (`weight_receiver.weights_checksum`); read on the engine thread, between weight updates."""
        return _json(await self.engine.call(weight_receiver.weights_checksum))

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        """Free the KV cache and/or the weights (`EngineCore.release_memory`); until they are back, a
        request is refused at once with 503 (held only while generation is paused: `EngineDriver`)."""
        tags = _memory_tags(await _body(request))
        try:
            await self.engine.release_memory(tags)
        except ValueError as err:
            raise RequestError(str(err)) from None
        return _json(None)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        await self.engine.resume_memory(_memory_tags(await _body(request)))
        return _json(None)

    async def _update(
        self, request: web.Request, handler: Callable[[EngineCore, dict], dict], report_paused: bool = False
    ) -> web.Response:
        body = await _body(request)
        if body.get("abort_all_requests") is True:  # SGLang aborts before waiting for in-flight requests
            await self.engine.abort_all("Aborted for a weight update")
        reply, paused = await self.engine.update_weights(lambda core: _checked(handler, core, body))
        if report_paused:
            reply = reply | {"num_paused_requests": paused}
        return _weight_reply(reply)

    # ---- OpenAI ----------------------------------------------------------------------------

    async def v1_models(self, request: web.Request) -> web.Response:
        return _json(openai_api.models_list(self.args.model_name, self.core.context_length))

    async def v1_model(self, request: web.Request) -> web.Response:
        """`models.retrieve`: the served model's card, or SGLang's 404 for any other name."""
        model = request.match_info["model"]
        if model != self.args.model_name:
            return _json(openai_api.model_not_found(model), status=404)
        return _json(openai_api.model_card(model, self.core.context_length))

    async def v1_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, openai_api.parse_completion, openai_api.completion_response)

    async def v1_chat_completions(self, request: web.Request) -> web.StreamResponse:
        parse = functools.partial(openai_api.parse_chat, tool_format=self.tool_format)
        return await self._openai(request, parse, openai_api.chat_response)

    async def _openai(self, request: web.Request, parse, respond) -> web.StreamResponse:
        inp = parse(
            await _body(request),
            tokenizer=self.tokenizer,
            vocab_size=self.core.vocab_size,
            context_length=self.core.context_length,
        )
        model = inp.model or self.args.model_name
        streams = await self._submit(inp.requests)
        try:
            if not inp.stream:
                outs = await asyncio.gather(*(s.result() for s in streams))
                return _json(respond(inp, outs, model=model, tokenizer=self.tokenizer))
            states = [openai_api.StreamState(inp, i, s.req) for i, s in enumerate(streams)]
            finals: dict[int, RequestOutput] = {}

            def chunk(i: int, out: RequestOutput) -> dict | None:
                if out.finished:
                    finals[i] = out
                return states[i].chunk(out, model=model, tokenizer=self.tokenizer)

            def tail() -> list[dict]:
                if not inp.include_usage:
                    return []
                return [openai_api.usage_chunk(inp, [finals[i] for i in sorted(finals)], model)]

            return await _stream_sse(request, streams, chunk, tail)
        finally:
            for s in streams:
                s.close()

    async def _submit(self, reqs: list[Request]) -> list[RequestStream]:
        try:
            return await self.engine.submit_many(reqs)
        except ValueError as err:
            raise RequestError(str(err)) from None


# ---- helpers -----------------------------------------------------------------------------------


def auth_middleware(api_key: str | None, admin_api_key: str | None):
    """SGLang's API-key checks as an aiohttp middleware (see the module docstring)."""

    @web.middleware
    async def _auth(request: web.Request, handler) -> web.StreamResponse:
        if request_allowed(
            request.method,
            request.path,
            request.headers.get("Authorization"),
            request.headers.get("x-api-key"),
            api_key,
            admin_api_key,
        ):
            return await handler(request)
        return _json({"error": "Unauthorized"}, status=401)

    return _auth


def request_allowed(
    method: str,
    path: str,
    authorization: str | None,
    x_api_key: str | None,
    api_key: str | None,
    admin_api_key: str | None,
) -> bool:
    """SGLang's `decide_request_auth` for its NORMAL and ADMIN_OPTIONAL levels (no endpoint here
    is ADMIN_FORCE): health probes and OPTIONS are open; an admin path takes the admin key if one
    is set, else the api key; any other path takes the api key."""
    if method == "OPTIONS" or path.startswith(("/health", "/ready", "/metrics")):
        return True
    expected = (admin_api_key or api_key) if path in ADMIN_PATHS else api_key
    if not expected:
        return True
    want = expected.encode()
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and secrets.compare_digest(token.encode("utf-8", "replace"), want):
        return True
    return x_api_key is not None and secrets.compare_digest(x_api_key.encode("utf-8", "replace"), want)


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as err:
        return _json(error_body(str(err), 400), status=400)
    except RecursionError:  # a body nested too deeply for a check or a message about it
        return _json(error_body("body: nested too deeply", 400), status=400)
    except (EngineDead, EngineNotReady) as err:
        return _json(error_body(str(err), 503), status=503)
    except web.HTTPException as err:
        if err.status < 400:
            raise
        return _json(error_body(f"{request.method} {request.path}: {err.reason}", err.status), status=err.status)
    except Exception as err:
        logger.exception("%s %s failed", request.method, request.path)
        return _json(error_body(f"internal error: {type(err).__name__}: {err}", 500), status=500)


def _new_part(data: dict, out: RequestOutput, req: Request, sent: list[tuple[int, int]], i: int) -> dict:
    """The `output_ids` and text of a streamed result not sent before (`sent[i]`: how many of each
    were). Until the request finishes, text a later token could still change is held back: an
    incomplete UTF-8 character, and the tail that might begin a stop string (trimmed at the end)."""
    ids, chars = sent[i]
    text = data["text"]
    if not out.finished:
        text = text.rstrip("\ufffd")
        holdback = max((len(s) for s in req.sampling.stop or []), default=1) - 1
        text = text[: max(chars, len(text) - holdback)]
    sent[i] = (len(data["output_ids"]), max(chars, len(text)))
    return {"output_ids": data["output_ids"][ids:], "text": text[chars:]}


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json")


async def _body(request: web.Request) -> dict:
    """The JSON object of a request; an empty body is `{}` (for endpoints whose fields all default)."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as err:
        raise RequestError(f"body: not valid JSON ({err})") from None
    except RecursionError:
        raise RequestError("body: not valid JSON (nested too deeply)") from None
    if not isinstance(body, dict):
        raise RequestError(f"body: expected a JSON object, got {type(body).__name__}")
    return body


def _checked(handler: Callable[[EngineCore, dict], dict], core: EngineCore, body: dict) -> dict:
    """A weight handler's reply, with a malformed request turned into SGLang's failure reply."""
    try:
        return handler(core, body)
    except ValueError as err:
        return {"success": False, "message": str(err)}


def _weight_reply(reply: dict) -> web.Response:
    return _json(reply, status=200 if reply.get("success") else 400)


def _memory_tags(body: dict) -> list[str]:
    """`tags` of a release/resume request; null or empty means all of them, as in SGLang."""
    check_fields(body, {"tags"}, _BASE_REQ, set())
    tags = body.get("tags")
    if tags is None or tags == []:
        return list(MEMORY_TAGS)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise RequestError(f"tags: expected a list of strings or null, got {show(tags)}")
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise RequestError(f"tags: unknown memory tag(s) {unknown} (known: {', '.join(MEMORY_TAGS)})"[:300])
    return list(tags)


async def _on_daemon_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on a daemon thread: unlike `asyncio.to_thread`'s executor, a call that never
    returns cannot hold the process at exit."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def run() -> None:
        try:
            result, err = fn(*args), None
        except BaseException as e:
            result, err = None, e

        def settle() -> None:
            if not fut.done():
                fut.set_exception(err) if err is not None else fut.set_result(result)

        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    threading.Thread(target=run, name="mcore-rl-group", daemon=True).start()
    return await fut


async def _stream_sse(request: web.Request, streams: list[RequestStream], chunk, tail=lambda: []) -> web.StreamResponse:
    """Server-sent events: `chunk(i, out)` per output (None = nothing to send), then `tail()`,
    then `[DONE]`. An engine failure mid-stream becomes an `{"error": ...}` event, as in SGLang."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    try:
        try:
            async for i, out in _merge(streams):
                data = chunk(i, out)
                if data is not None:
                    await resp.write(sse(data))
            for data in tail():
                await resp.write(sse(data))
        except (RuntimeError, EngineDead) as err:
            await resp.write(sse(error_body(str(err), 503 if isinstance(err, EngineNotReady) else 500)))
        await resp.write(SSE_DONE)
    except ConnectionResetError:  # the client went away; the caller aborts its requests
        pass
    return resp


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from several streams as they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out))
        except Exception as err:
            queue.put_nowait((i, err))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


# ---- running it --------------------------------------------------------------------------------


def build_server(args: ServerArgs) -> EngineServer | ClassifierServer:
    """Load the model named by `args` (none: the built-in demo model) and wrap it in a server; with
    `--is-embedding`, a reward model on SGLang's `/classify` (`classifier.py`)."""
    if args.is_embedding:
        from mcore_rl.rollout.classifier import build_classifier_server  # lazy: classifier.py imports this module

        return build_classifier_server(args)
    kw = args.engine_kwargs()
    kw.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")  # SGLang picks the GPU by default
    kw.setdefault("max_total_tokens", args.max_total_tokens)  # the KV pool's bound (`engine/kv_cache.py`)
    kw.setdefault("mem_fraction_static", args.mem_fraction_static)
    core = EngineCore.from_model_path(args.model_path, tokenizer_path=args.tokenizer_path, **kw)
    core.weight_version = weight_receiver.core_version(args.weight_version)
    if args.ignored_flags:
        logger.warning(
            "SGLang flags accepted and ignored by the embedded engine (they tune a GPU server or its "
            "deployment; no output changes): %s",
            " ".join(sorted(args.ignored_flags)),
        )
    return EngineServer(EngineDriver(core), args)


def run_server(
    server: EngineServer | ClassifierServer, host: str, port: int, grace_s: float = SHUTDOWN_GRACE_S
) -> None:
    """Serve until SIGTERM or SIGINT (the `mcore-rl serve` main loop), then shut down within
    `grace_s` seconds whatever hangs (see the module docstring); a second signal exits at once."""
    logger.info("serving %s on http://%s:%d", server.args.model_name, host, port)
    asyncio.run(_serve(server, host, port, grace_s))


async def _serve(server: EngineServer | ClassifierServer, host: str, port: int, grace_s: float) -> None:
    runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None, shutdown_timeout=grace_s / 3)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, functools.partial(_exit_now, 1, "second signal"))
    logger.info("shutting down (at most %.1f s)", grace_s)
    watchdog = threading.Timer(grace_s, _exit_now, args=(1, f"still running {grace_s:.1f} s after the signal"))
    watchdog.daemon = True
    watchdog.start()
    # Requests in flight fail (503) once the engine stops; what waits elsewhere is cancelled.
    await _on_daemon_thread(server.close, grace_s / 3)
    await runner.cleanup()


def _exit_now(code: int, why: str) -> None:
    logger.warning("exiting now: %s", why)
    sys.stderr.flush()
    os._exit(code)


class ServerThread:
    """An `EngineServer` on its own thread and event loop, for tests and in-process rollouts.

    `ServerThread(EngineServer(EngineDriver(core))).start()` returns the base URL (port 0 = a free one).
    """

    def __init__(
        self, server: EngineServer, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 5.0
    ) -> None:
        self.server, self.host, self.port = server, host, port
        self.shutdown_timeout = shutdown_timeout
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcore-rl-http", daemon=True)

    def start(self) -> str:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()
        return self.url

    async def _start(self) -> None:
        self._runner = web.AppRunner(
            self.server.app, handler_cancellation=True, access_log=None, shutdown_timeout=self.shutdown_timeout
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.url = f"http://{self.host}:{self.port}"

    def stop(self, close_engine: bool = True) -> None:
        """Stop serving (idempotent); with `close_engine`, requests in flight fail first (503), as
        if the engine died."""
        if close_engine:
            self.server.engine.close()
        if self._loop.is_closed():
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result()
            self._runner = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> ServerThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
