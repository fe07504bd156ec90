"""Async client for SGLang's native HTTP API (a `sglang.launch_server` or `mcore-rl serve`).

One method per endpoint, taking SGLang's field names as keyword arguments and returning the JSON
reply as it comes. Errors: a reply with status >= 400 raises `EngineHTTPError` (the message is the
server's, which names the field); an engine that cannot be reached, or answers 502/503/504, is
retried `retries` times with backoff and then raises `EngineUnavailable`.

Only requests that are safe to repeat are retried. `/generate` is made safe by its `rid` (one is
generated when the caller gives none): before a retry the client aborts that rid, so the engine
never runs a request twice and the caller gets exactly one result. A request for `n > 1` samples
is sent as n prompts with a rid each (SGLang gives the samples of `n` ids of its own, which no
client can abort). `/init_weights_update_group` and `/update_weights_from_distributed` are never
retried: each pairs with a collective on the trainer side. A stream that breaks off (the server
died or the connection dropped) raises `EngineUnavailable`, never a raw aiohttp error.

Timeouts: generation (`/generate`, the OpenAI routes) may run for minutes and gets `timeout`;
weight updates get `weight_update_timeout` (one bucket, or one checkpoint from disk) and every
other call (pause, continue, health, versions, checksums) `control_timeout`, both seconds by
default, so a frozen engine costs a sync seconds, not the generation timeout. A control call or
weight update that timed out is not repeated: an engine that did not answer in time is taken as
gone (the pool leaves it out until its `/health` answers again); refused connections and
502/503/504 are retried, and so is a generation request that timed out (a busy engine).

With `api_key`, every request carries `Authorization: Bearer <api_key>` (SGLang's `--api-key`);
weight and control endpoints carry `admin_api_key` instead when one is given (`--admin-api-key`).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any
from collections.abc import AsyncIterator, Sequence

import aiohttp

RETRY_STATUSES = (502, 503, 504)
CONTROL_TIMEOUT_S = 30.0  # default of `control_timeout`: pause, continue, health, versions, checksums
WEIGHT_UPDATE_TIMEOUT_S = 120.0  # default of `weight_update_timeout`: one weight-update request
GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
WEIGHT_UPDATE_PATHS = frozenset(
    {
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/release_memory_occupation",
        "/resume_memory_occupation",
    }
)
# SGLang's weight and control endpoints (and our /weights_checksum): with `--admin-api-key` only that
# key opens them (the server enforces this set; the client sends the admin key to them).
ADMIN_PATHS = frozenset(
    {
        "/flush_cache",
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/update_weight_version",
        "/get_weights_by_name",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/weights_checksum",
    }
)
# Per-prompt fields of a batch that `expand_samples` repeats with their prompt.
PER_PROMPT_FIELDS = (
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_text_in_logprobs",
    "return_sampling_mask",
    "image_data",
    "lora_path",
    "custom_logit_processor",
)


class EngineError(RuntimeError):
    """Base class of the client's errors."""


class EngineHTTPError(EngineError):
    """The engine answered with an error status; `message` is its explanation."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.url, self.status, self.message = url, status, message


class EngineUnavailable(EngineError):
    """The engine could not be reached (or kept answering 502/503/504) within the retries."""


class EngineClient:
    """`async with EngineClient("http://127.0.0.1:30000") as c: out = await c.generate(text="hi")`."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 600.0,
        retries: int = 3,
        backoff: float = 0.5,
        connect_timeout: float = 10.0,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        control_timeout: float | None = None,
        weight_update_timeout: float | None = None,
    ) -> None:
        """`control_timeout` / `weight_update_timeout`: None = the smaller of `timeout` and
        `CONTROL_TIMEOUT_S` / `WEIGHT_UPDATE_TIMEOUT_S`."""
        self.base_url = base_url.rstrip("/")
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.control_timeout = control_timeout if control_timeout is not None else min(timeout, CONTROL_TIMEOUT_S)
        self.weight_update_timeout = (
            weight_update_timeout if weight_update_timeout is not None else min(timeout, WEIGHT_UPDATE_TIMEOUT_S)
        )
        self.connect_timeout = connect_timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        admin = admin_api_key or api_key
        self._admin_headers = {"Authorization": f"Bearer {admin}"} if admin else {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ---- generation ------------------------------------------------------------------------

    async def generate(self, body: dict | None = None, **fields: Any) -> Any:
        """POST /generate; a dict for one prompt, a list for a batch. `stream` must not be set
        (use `generate_stream`)."""
        body = with_rids(expand_samples({**(body or {}), **fields}))
        if body.get("stream"):
            raise ValueError("stream: use generate_stream() for streaming")
        return await self._call("POST", "/generate", body, retry=True, rids=request_rids(body))

    async def generate_stream(self, body: dict | None = None, **fields: Any) -> AsyncIterator[dict]:
        """POST /generate with `stream: true`; yields each event's JSON (cumulative text, ids and
        log-probs so far; the last has `meta_info.finish_reason`). Retried only before the first event."""
        body = with_rids(expand_samples({**(body or {}), **fields, "stream": True}))
        async for event in self._stream("/generate", body, rids=request_rids(body)):
            yield event

    async def completions(self, **fields: Any) -> dict:
        """POST /v1/completions (OpenAI shape), non-streaming."""
        return await self._call("POST", "/v1/completions", {**fields, "stream": False}, retry=False)

    async def chat_completions(self, **fields: Any) -> dict:
        """POST /v1/chat/completions (OpenAI shape), non-streaming."""
        return await self._call("POST", "/v1/chat/completions", {**fields, "stream": False}, retry=False)

    async def openai_stream(self, path: str, **fields: Any) -> AsyncIterator[dict]:
        """Stream chunks of `/v1/completions` or `/v1/chat/completions`."""
        async for event in self._stream(path, {**fields, "stream": True}, rids=[]):
            yield event

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        await self._call("POST", "/abort_request", {"rid": rid, "abort_all": abort_all}, retry=True)

    # ---- control ---------------------------------------------------------------------------

    async def pause_generation(self, mode: str = "abort") -> dict:
        """SGLang's modes: "abort" (default: in-flight requests finish with finish_reason abort),
        "in_place" / "retract" (they wait). New requests wait until `continue_generation`."""
        return await self._call("POST", "/pause_generation", {"mode": mode}, retry=True)

    async def continue_generation(self) -> dict:
        return await self._call("POST", "/continue_generation", {}, retry=True)

    async def flush_cache(self) -> str:
        return await self._call("POST", "/flush_cache", None, retry=True)

    async def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """Free the engine's weights and/or KV cache ("weights", "kv_cache"; None = both), e.g.
        while a colocated trainer uses the device; the engine must be idle (pause it with abort)."""
        return await self._call(
            "POST", "/release_memory_occupation", {} if tags is None else {"tags": tags}, retry=True
        )

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """Allocate it again; released weights must then be filled by a weight update before serving."""
        return await self._call("POST", "/resume_memory_occupation", {} if tags is None else {"tags": tags}, retry=True)

    async def health(self) -> bool:
        """True on 200 from /health; False on any other answer or none."""
        return await self._ok("/health")

    async def health_generate(self) -> bool:
        return await self._ok("/health_generate")

    async def get_model_info(self) -> dict:
        return await self._call("GET", "/get_model_info", None, retry=True)

    async def get_server_info(self) -> dict:
        return await self._call("GET", "/get_server_info", None, retry=True)

    async def tokenize(self, **fields: Any) -> dict:
        """POST /tokenize (SGLang's `TokenizeRequest`: `prompt` or `messages`, `add_special_tokens`)."""
        return await self._call("POST", "/tokenize", fields, retry=True)

    async def detokenize(self, **fields: Any) -> dict:
        """POST /detokenize (SGLang's `DetokenizeRequest`: `tokens`, `skip_special_tokens`)."""
        return await self._call("POST", "/detokenize", fields, retry=True)

    async def classify(self, **fields: Any) -> Any:
        """POST /classify (SGLang's reward-model route, `EmbeddingReqInput`: `input_ids` or `text`)."""
        return await self._call("POST", "/classify", fields, retry=True)

    async def get_weight_version(self) -> str:
        return (await self._call("GET", "/get_weight_version", None, retry=True))["weight_version"]

    # ---- weights ---------------------------------------------------------------------------

    async def update_weights_from_disk(self, model_path: str, **fields: Any) -> dict:
        """Fields: load_format, weight_version, flush_cache, abort_all_requests."""
        return await self._call("POST", "/update_weights_from_disk", {"model_path": model_path, **fields}, retry=True)

    async def update_weights_from_tensor(self, serialized_named_tensors: list, **fields: Any) -> dict:
        """Fields: load_format, flush_cache, weight_version, abort_all_requests."""
        body = {"serialized_named_tensors": serialized_named_tensors, **fields}
        return await self._call("POST", "/update_weights_from_tensor", body, retry=True)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout_s: float | None = None,
    ) -> dict:
        """`timeout_s`: how long the engine waits for the rendezvous (the embedded engine's field;
        SGLang ignores it)."""
        body = dict(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        return await self._call("POST", "/init_weights_update_group", body, retry=False)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return await self._call("POST", "/destroy_weights_update_group", {"group_name": group_name}, retry=False)

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], **fields: Any
    ) -> dict:
        """Fields: group_name, flush_cache, weight_version, load_format, abort_all_requests."""
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, **fields}
        return await self._call("POST", "/update_weights_from_distributed", body, retry=False)

    async def weights_checksum(self) -> dict:
        """GET /weights_checksum (the embedded engine's; SGLang answers 404): {"weight_version",
        "checksum" (16 hex digits), "num_tensors"} of the tensors the engine received
        (`weight_protocol.WeightChecksum`)."""
        return await self._call("GET", "/weights_checksum", None, retry=True)

    async def update_weight_version(self, new_version: str | int, abort_all_requests: bool = False) -> dict:
        body = {"new_version": str(new_version), "abort_all_requests": abort_all_requests}
        return await self._call("POST", "/update_weight_version", body, retry=True)

    # ---- transport -------------------------------------------------------------------------

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    def _headers_for(self, path: str) -> dict[str, str]:
        return self._admin_headers if path in ADMIN_PATHS else self._headers

    def timeout_for(self, path: str) -> float:
        """Generation's `timeout`, weight updates' `weight_update_timeout`, else `control_timeout`."""
        if path in GENERATION_PATHS:
            return self.timeout
        return self.weight_update_timeout if path in WEIGHT_UPDATE_PATHS else self.control_timeout

    async def _call(self, method: str, path: str, body: Any, *, retry: bool, rids: Sequence[str] = ()) -> Any:
        url = self.base_url + path
        headers = self._headers_for(path)
        attempts = self.retries + 1 if retry else 1
        total = self.timeout_for(path)
        timeout = aiohttp.ClientTimeout(total=total, connect=min(self.connect_timeout, total))
        last: Exception | None = None
        for attempt in range(attempts):
            if attempt:
                if isinstance(last, asyncio.TimeoutError) and path not in GENERATION_PATHS:
                    attempts = attempt
                    break  # a control call unanswered in time: asking again would only wait as long again
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
                await self.abort_quietly(rids)
            try:
                async with self._http().request(method, url, json=body, timeout=timeout, headers=headers) as resp:
                    raw = await resp.read()
                    if resp.status in RETRY_STATUSES:
                        last = EngineHTTPError(url, resp.status, _message(raw))
                        continue
                    if resp.status >= 400:
                        raise EngineHTTPError(url, resp.status, _message(raw))
                    return _decode(raw, resp.content_type)
            except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as err:
                last = err
        what = f"{type(last).__name__}: " + (
            f"no answer within {total:g} s" if isinstance(last, asyncio.TimeoutError) else str(last)
        )
        raise EngineUnavailable(f"{url}: {what} (after {attempts} attempt(s))") from last

    async def _stream(self, path: str, body: dict, *, rids: list[str]) -> AsyncIterator[dict]:
        url = self.base_url + path
        timeout = aiohttp.ClientTimeout(total=None, connect=self.connect_timeout, sock_read=self.timeout)
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
                await self.abort_quietly(rids)
            started = False
            try:
                async with self._http().post(url, json=body, timeout=timeout, headers=self._headers_for(path)) as resp:
                    if resp.status in RETRY_STATUSES:
                        last = EngineHTTPError(url, resp.status, _message(await resp.read()))
                        continue
                    if resp.status >= 400:
                        raise EngineHTTPError(url, resp.status, _message(await resp.read()))
                    async for line in resp.content:
                        line = line.strip()
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            return
                        event = json.loads(data)
                        if isinstance(event, dict) and "error" in event and "meta_info" not in event:
                            raise EngineHTTPError(url, 500, _message(data))
                        started = True
                        yield event
                    return
            except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as err:
                if started:
                    raise EngineUnavailable(f"{url}: stream broke off: {type(err).__name__}: {err}") from err
                last = err
        raise EngineUnavailable(f"{url}: {type(last).__name__}: {last} (after {self.retries + 1} attempt(s))") from last

    async def abort_quietly(self, rids: Sequence[str]) -> None:
        """Best effort: make sure an earlier attempt of these requests is not still running."""
        for rid in rids:
            try:
                timeout = aiohttp.ClientTimeout(total=min(self.connect_timeout, self.control_timeout))
                async with self._http().post(
                    self.base_url + "/abort_request", json={"rid": rid}, timeout=timeout, headers=self._admin_headers
                ):
                    pass
            except (TimeoutError, aiohttp.ClientError):
                return  # unreachable: nothing is running there that we could stop

    async def _ok(self, path: str) -> bool:
        try:
            timeout = aiohttp.ClientTimeout(
                total=self.control_timeout, connect=min(self.connect_timeout, self.control_timeout)
            )
            async with self._http().get(self.base_url + path, timeout=timeout, headers=self._headers) as resp:
                await resp.read()
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False


def expand_samples(body: dict) -> dict:
    """`n > 1` samples of each prompt as n prompts of their own (prompt-major: p0, p0, p1, p1), with
    `n` removed, so that every sample has a rid the client chose. A given string rid `r` names the
    samples `r_0, r_1, ...` in that order; a list of rids (one per prompt) `r_k` for sample k."""
    sp = body.get("sampling_params")
    n = max((s.get("n") or 1) if isinstance(s, dict) else 1 for s in (sp if isinstance(sp, list) else [sp]))
    if n <= 1:
        return body
    key = "text" if body.get("text") is not None else "input_ids"
    prompts: Any = body.get(key)  # JSON: a prompt or a list of them
    batch = isinstance(prompts, list) and bool(prompts) and not isinstance(prompts[0], int)
    items = list(prompts) if batch else [prompts]
    params = sp if isinstance(sp, list) else [sp] * len(items)
    out = dict(body)
    out[key] = [p for p in items for _ in range(n)]
    out["sampling_params"] = [{k: v for k, v in (s or {}).items() if k != "n"} for s in params for _ in range(n)]
    rid = body.get("rid")
    if isinstance(rid, list):
        out["rid"] = [f"{r}_{k}" for r in rid for k in range(n)]
    elif isinstance(rid, str):
        out["rid"] = [f"{rid}_{i}" for i in range(len(items) * n)]
    for field in PER_PROMPT_FIELDS:  # per-prompt lists follow their prompt
        value = body.get(field)
        if field == "token_ids_logprob" and isinstance(value, list) and all(isinstance(v, int) for v in value):
            continue  # one list of ids for every prompt (SGLang's form for a batch), not one entry per prompt
        if isinstance(value, list) and batch:
            out[field] = [v for v in value for _ in range(n)]
    return out


def with_rids(body: dict) -> dict:
    """Give a generate request rids (one per prompt) so that it can be retried safely."""
    if body.get("rid") is None:
        prompts: Any = body.get("text") if body.get("text") is not None else body.get("input_ids")
        batch = isinstance(prompts, list) and prompts and not isinstance(prompts[0], int)
        body["rid"] = [uuid.uuid4().hex for _ in prompts] if batch else uuid.uuid4().hex
    return body


def request_rids(body: dict) -> list[str]:
    """Every engine-side rid of a generate body after `expand_samples` (SGLang expands a string rid
    of a batch to `{rid}_{i}`)."""
    rid = body["rid"]
    prompts = body.get("text") if body.get("text") is not None else body.get("input_ids")
    batch = len(prompts) if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int) else 1
    if isinstance(rid, list):
        return list(rid)
    return [rid] if batch == 1 else [f"{rid}_{i}" for i in range(batch)]


def _decode(raw: bytes, content_type: str) -> Any:
    if not raw:
        return None
    if content_type == "application/json":
        return json.loads(raw)
    return raw.decode(errors="replace")


def _message(raw: bytes) -> str:
    """The server's error message: SGLang's {"error": {"message"}} or {"message"}, else the text."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace").strip()[:2000]
    if isinstance(body, dict):
        if isinstance(body.get("error"), dict) and "message" in body["error"]:
            return str(body["error"]["message"])
        if "message" in body:
            return str(body["message"])
    return json.dumps(body)[:2000]
