"""The embedded engine's HTTP server: SGLang's native endpoints and the OpenAI ones (aiohttp).

Routes, methods and reply shapes are SGLang's (`entrypoints/http_server.py`):

    GET  /health, /health_generate            200 or 503, empty body
    GET  /get_model_info, /get_server_info, /get_weight_version
    POST /generate (also PUT)                  JSON, or server-sent events when "stream": true
    POST /abort_request                        {"rid", "abort_all"} -> 200, empty body
    POST /pause_generation {"mode"}, /continue_generation -> {"message", "status": "ok"}
    GET|POST /flush_cache                      200 text, or 400 while requests are in flight
    POST /update_weights_from_disk, /update_weights_from_tensor, /update_weights_from_distributed,
         /init_weights_update_group, /destroy_weights_update_group, /update_weight_version
                                               {"success", "message"}; 200, or 400 on failure
    GET  /v1/models; POST /v1/completions, /v1/chat/completions

A bad request gets HTTP 400 `{"error": {"message": "<field>: ...", "code": 400}}`; an internal
failure of one request gets 500 and the server keeps serving the others. Weight updates run
through `EngineDriver.update_weights` (see there for how they interact with generation) and the
handlers of `weight_receiver`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable

from aiohttp import web

import mcore_rl
from mcore_rl.rollout import openai_api, weight_receiver
from mcore_rl.rollout.engine.driver import PAUSE_MODES, EngineDriver, EngineDead, RequestStream
from mcore_rl.rollout.engine.core import EngineCore, Request, RequestOutput
from mcore_rl.rollout.engine.sampling import SamplingParams
from mcore_rl.rollout.launch_flags import ServerArgs
from mcore_rl.rollout.protocol import (
    SSE_DONE,
    RequestError,
    check_fields,
    dumps,
    error_body,
    generate_output,
    parse_generate,
    sse,
)

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 20.0  # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT default
MAX_BODY_BYTES = 1 << 33  # /update_weights_from_tensor carries whole buckets as base64
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class EngineServer:
    """The aiohttp application serving one `EngineDriver`."""

    def __init__(self, engine: EngineDriver, args: ServerArgs | None = None) -> None:
        self.engine = engine
        self.core: EngineCore = engine.core
        self.tokenizer = self.core.tokenizer
        self.args = args or ServerArgs(model_path=self.core.model_path)
        self.app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
        get, post = web.get, web.post
        self.app.add_routes([
            get("/health", self.health),
            get("/health_generate", self.health_generate),
            get("/get_model_info", self.get_model_info),
            get("/get_server_info", self.get_server_info),
            get("/get_weight_version", self.get_weight_version),
            post("/generate", self.generate),
            web.put("/generate", self.generate),
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
            get("/v1/models", self.v1_models),
            post("/v1/completions", self.v1_completions),
            post("/v1/chat/completions", self.v1_chat_completions),
        ])

    # ---- health and info -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """200 while the engine thread answers (a no-op round trip), else 503."""
        return web.Response(status=200 if await self.engine.ping(HEALTH_TIMEOUT_S) else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """Generate one token, as SGLang's health check does; while paused, the round trip only."""
        if self.engine.paused:
            return await self.health(request)
        req = Request(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0],
                      sampling=SamplingParams(max_new_tokens=1, temperature=0.0))
        try:
            stream = await self.engine.submit(req)
            try:
                await asyncio.wait_for(stream.result(), HEALTH_TIMEOUT_S)
            finally:
                stream.close()
        except (asyncio.TimeoutError, EngineDead, RuntimeError):
            return web.Response(status=503)
        return web.Response(status=200)

    async def get_model_info(self, request: web.Request) -> web.Response:
        cfg = self.core.config
        return _json({
            "model_path": self.core.model_path,
            "tokenizer_path": self.args.tokenizer_path or self.core.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(self.core.weight_version),
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
        })

    async def get_server_info(self, request: web.Request) -> web.Response:
        core = self.core
        return _json({
            **self.args.to_dict(),
            "weight_version": str(core.weight_version),
            "context_length": core.context_length,
            "max_running_requests": core.max_running_requests,
            "max_req_input_len": core.context_length - 1,
            "dtype": core.dtype_name,
            "quantization": core.quantization,
            "internal_states": [{
                "num_running_reqs": core.num_running_reqs,
                "num_waiting_reqs": core.num_waiting_reqs,
                "paused": self.engine.paused,
            }],
            "version": mcore_rl.__version__,
            "engine": "mcore-rl embedded",
        })

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return _json({"weight_version": str(self.core.weight_version)})

    # ---- generation ------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_generate(await _body(request), tokenizer=self.tokenizer,
                                vocab_size=self.core.vocab_size, context_length=self.core.context_length)
        streams = await self._submit(parsed.requests)

        def render(i: int, out: RequestOutput) -> dict:
            s = streams[i]
            return generate_output(out, s.req, tokenizer=self.tokenizer,
                                   return_text_in_logprobs=parsed.return_text_in_logprobs,
                                   e2e_latency=time.monotonic() - s.created)

        try:
            if not parsed.stream:
                outs = await asyncio.gather(*(s.result() for s in streams))
                results = [render(i, o) for i, o in enumerate(outs)]
                return _json(results[0] if parsed.is_single else results)

            def chunk(i: int, out: RequestOutput) -> dict:
                return render(i, out) if parsed.is_single else render(i, out) | {"index": i}

            return await _stream_sse(request, streams, chunk)
        finally:
            for s in streams:
                s.close()

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _body(request)
        check_fields(body, {"rid", "abort_all", "abort_message"}, {"finished_reason", "http_worker_ipc"}, set())
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
        check_fields(body, {"mode"}, {"rid", "http_worker_ipc"}, set())
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode: expected one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        await self.engine.pause(mode)
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        body = await _body(request)
        check_fields(body, set(), {"torch_empty_cache", "rid", "http_worker_ipc"}, set())
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
        return await self._update(request, weight_receiver.update_weights_from_disk, report_paused=True)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        return await self._update(request, weight_receiver.update_weights_from_tensor)

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        return await self._update(request, weight_receiver.update_weights_from_distributed)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        # A rendezvous with the trainer, not a weight change: generation goes on meanwhile.
        body = await _body(request)
        return _weight_reply(await asyncio.to_thread(_checked, weight_receiver.init_weights_update_group, self.core, body))

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _body(request)
        return _weight_reply(await asyncio.to_thread(_checked, weight_receiver.destroy_weights_update_group, self.core, body))

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _body(request)
        check_fields(body, {"new_version", "abort_all_requests"}, {"rid", "http_worker_ipc"}, set())
        version = _int_version(body.get("new_version"), "new_version")
        if body.get("abort_all_requests", False) is True:
            await self.engine.abort_all("Aborted for a weight version update")
        await self.engine.call(lambda core: setattr(core, "weight_version", version))
        return _json({"success": True, "message": f"Weight version updated to {version}", "new_version": str(version)})

    async def _update(self, request: web.Request, handler: Callable[[EngineCore, dict], dict],
                      report_paused: bool = False) -> web.Response:
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

    async def v1_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, openai_api.parse_completion, openai_api.completion_response)

    async def v1_chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, openai_api.parse_chat, openai_api.chat_response)

    async def _openai(self, request: web.Request, parse, respond) -> web.StreamResponse:
        inp = parse(await _body(request), tokenizer=self.tokenizer, vocab_size=self.core.vocab_size,
                    context_length=self.core.context_length)
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


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as err:
        return _json(error_body(str(err), 400), status=400)
    except EngineDead as err:
        return _json(error_body(str(err), 503), status=503)
    except web.HTTPException as err:
        if err.status < 400:
            raise
        return _json(error_body(f"{request.method} {request.path}: {err.reason}", err.status), status=err.status)
    except Exception as err:  # noqa: BLE001 - one failing request must not take the server down
        logger.exception("%s %s failed", request.method, request.path)
        return _json(error_body(f"internal error: {type(err).__name__}: {err}", 500), status=500)


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


def _int_version(value: Any, field: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise RequestError(f"{field}: the embedded engine numbers weight versions with integers, got {value!r}")


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
            await resp.write(sse(error_body(str(err), 500)))
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
        except Exception as err:  # noqa: BLE001 - re-raised by the consumer
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


def build_server(args: ServerArgs) -> EngineServer:
    """Load the model named by `args` (none: the built-in demo model) and wrap it in a server."""
    core = EngineCore.from_model_path(args.model_path, tokenizer_path=args.tokenizer_path, **args.engine_kwargs())
    core.weight_version = int(args.weight_version)
    return EngineServer(EngineDriver(core), args)


def run_server(server: EngineServer, host: str, port: int) -> None:
    """Serve until interrupted (the `mcore-rl serve` main loop)."""
    logger.info("serving %s on http://%s:%d", server.args.model_name, host, port)
    try:
        web.run_app(server.app, host=host, port=port, handler_cancellation=True, print=None, access_log=None)
    finally:
        server.engine.close()


class ServerThread:
    """An `EngineServer` on its own thread and event loop, for tests and in-process rollouts.

    `ServerThread(EngineServer(EngineDriver(core))).start()` returns the base URL (port 0 = a free one).
    """

    def __init__(self, server: EngineServer, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 5.0) -> None:
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
        self._runner = web.AppRunner(self.server.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=self.shutdown_timeout)
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

    def __enter__(self) -> "ServerThread":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
