"""The engine pool's protocol spoken to a vLLM server (docs/serving.md#vllm-engines).

`HTTPEnginePool` and `EngineRouter` speak SGLang's native API through `EngineClient`;
`VLLMEngineClient` is that client for a vLLM OpenAI server started with
`VLLM_SERVER_DEV_MODE=1 --skip-tokenizer-init` (its RL routes, token ids only). It takes the same
calls with SGLang's field names and answers in SGLang's shape, so the router's failover, the
pool's engine states, staleness and accounting, and the disk weight transport work unchanged:

    SGLang call                          vLLM route
    /generate (token ids)                /v1/completions: prompt = token ids, `return_token_ids`,
                                         `logprobs: 0` (μ of each sampled token), `prompt_logprobs`
                                         for `logprob_start_len`; the rid is vLLM's `request_id`
    /pause_generation abort | in_place   /pause?mode=abort | keep  (retract is refused: vLLM
                                         has no pause that frees in-flight KV and recomputes it)
    /continue_generation                 /resume
    /abort_request                       /abort_requests (its ids are `cmpl-<rid>-0`)
    /update_weights_from_disk            /collective_rpc reload_weights(weights_path), then
                                         /update_weight_version, /reset_prefix_cache
    /get_weight_version                  /weight_info ("default", the weights it started with, is 0)
    /flush_cache                         /reset_prefix_cache

On GPU, vLLM's own NCCL transfer (`/init_weight_transfer_engine`, `/start_weight_update`,
`/update_weights`, `/finish_weight_update`) is driven by `vllm_weights.py`; these methods are its
requests, under vLLM's names.

Refused with a reason (an `EngineHTTPError`, which the pool raises as a refusal): SGLang's tensor
and broadcast weight requests, memory release (not on CPU), `/weights_checksum` (404: vLLM's
`/weight_checker` hashes are not trustworthy on CPU, so the pool logs that the weights go
unchecked, as for a real SGLang server), routed experts, sampling masks, top-k ids, text prompts.

The server has no tokenizer: the response text is the trainer's tokenizer's decoding of the ids
(`decode`), and the end-of-sequence id is sent as a stop token (`eos_token_id`), which vLLM keeps
in the output ids as SGLang does. A request's weight version is the one the client last saw the
engine take before the request was sent (the version of its oldest token): with `pause abort`
no request runs across a weight update; with `keep` a request that did is reported at the older
version, which only makes it look staler than it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from mcore_rl.rollout.vllm_processes import SERVED_MODEL_NAME
from mcore_rl.rollout.client import (
    EngineClient,
    EngineHTTPError,
    expand_samples,
    request_rids,
    with_rids,
)

INITIAL_VERSION = "default"  # vLLM's weight version before the first /update_weight_version
PAUSE_MODES = {"abort": "abort", "in_place": "keep"}  # SGLang's -> vLLM's, where they mean the same
# SGLang sampling parameter -> vLLM's name (None: the same name)
SAMPLING_FIELDS: dict[str, str | None] = {
    "temperature": None,
    "top_p": None,
    "top_k": None,
    "min_p": None,
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "stop_token_ids": None,
    "ignore_eos": None,
    "sampling_seed": "seed",
    "frequency_penalty": None,
    "presence_penalty": None,
    "repetition_penalty": None,
    "skip_special_tokens": None,
}
# /generate fields the client maps (the rest are refused by name)
GENERATE_FIELDS = frozenset({"input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "stream"})
VLLM_GENERATION_PATHS = frozenset({"/v1/completions"})
VLLM_WEIGHT_PATHS = frozenset(
    {"/collective_rpc", "/init_weight_transfer_engine", "/update_weights", "/finish_weight_update"}
)
NOT_ON_CPU = (
    "vLLM takes weights from disk (rollout.sync_transport: disk) or, on GPU, by its own NCCL transfer "
    "(rollout.sync_transport: distributed, `vllm_weights.py`), never SGLang's tensor or broadcast requests"
)


class VLLMEngineClient(EngineClient):
    """`EngineClient`'s calls against a vLLM server; see the module docstring for the mapping."""

    def __init__(
        self,
        base_url: str,
        *,
        decode: Callable[[list[int]], str] | None = None,
        eos_token_id: int | None = None,
        model_name: str = SERVED_MODEL_NAME,
        **kwargs: Any,
    ) -> None:
        """`decode`: the trainer's tokenizer (the server has none; None: empty texts);
        `eos_token_id`: sent as a stop token unless a request sets `ignore_eos`; `model_name`: the
        server's `--served-model-name`; `kwargs`: `EngineClient`'s."""
        super().__init__(base_url, **kwargs)
        self.decode, self.eos_token_id, self.model_name = decode, eos_token_id, model_name
        self.version = "0"  # the weight version the engine last reported or took from this client

    # ---- generation ------------------------------------------------------------------------

    async def generate(self, body: dict | None = None, **fields: Any) -> Any:
        """SGLang's `/generate` by token ids: one dict in SGLang's shape per prompt (a list for a
        batch), each from its own `/v1/completions` request."""
        body = with_rids(expand_samples({**(body or {}), **fields}))
        unknown = sorted(k for k, v in body.items() if k not in GENERATE_FIELDS and v not in (None, False))
        if unknown:
            raise self._refuse(f"/generate fields {unknown}: not supported by the vLLM backend")
        if body.get("stream"):
            raise ValueError("stream: the vLLM backend does not stream /generate")
        prompts = body.get("input_ids")
        if not isinstance(prompts, list) or not prompts:
            raise self._refuse("input_ids: the vLLM backend takes token ids (a list of ints, or a list of them)")
        batch = not isinstance(prompts[0], int)
        items: list[list[int]] = list(prompts) if batch else [prompts]
        rids = request_rids(body)
        sp = body.get("sampling_params") or {}
        params = sp if isinstance(sp, list) else [sp] * len(items)
        start = body.get("logprob_start_len")
        starts = start if isinstance(start, list) else [start] * len(items)
        outs = await asyncio.gather(
            *(self._complete(ids, p, rid, s) for ids, p, rid, s in zip(items, params, rids, starts))
        )
        return list(outs) if batch else outs[0]

    async def _complete(self, input_ids: list[int], sp: dict[str, Any], rid: str, start: int | None) -> dict:
        version = self.version
        try:
            sampling = vllm_sampling_params(sp, self.eos_token_id)
        except ValueError as err:
            raise self._refuse(str(err)) from err
        request: dict[str, Any] = {
            "model": self.model_name,
            "prompt": [int(t) for t in input_ids],
            "request_id": rid,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            **sampling,
        }
        if start is not None and start >= 0:
            request["prompt_logprobs"] = 0
        scoring = request.get("max_tokens") == 0  # SGLang's prompt scoring; vLLM generates at least one token
        if scoring:
            request["max_tokens"] = 1
        reply = await self._call("POST", "/v1/completions", request, retry=True, rids=[rid])
        choice = reply["choices"][0]
        ids = [] if scoring else [int(t) for t in choice.get("token_ids") or []]
        logprobs = [] if scoring else (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(logprobs) != len(ids):
            raise ValueError(f"{self.base_url}: vLLM answered {len(ids)} output ids but {len(logprobs)} log-probs")
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": {"type": "length" if scoring else choice.get("finish_reason") or "abort"},
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(ids),
            "output_token_logprobs": [[float(lp), t, None] for lp, t in zip(logprobs, ids)],
            "weight_version": version,
        }
        if start is not None and start >= 0:
            meta["input_token_logprobs"] = prompt_logprobs(input_ids, choice.get("prompt_logprobs"), start)
        return {"text": self.decode(ids) if self.decode is not None else "", "output_ids": ids, "meta_info": meta}

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        await self._call(
            "POST", "/abort_requests", {} if abort_all else {"request_ids": [vllm_request_id(rid)]}, retry=True
        )

    async def abort_quietly(self, rids: Sequence[str]) -> None:
        """Best effort, as `EngineClient.abort_quietly`, with vLLM's ids of the requests."""
        if not rids:
            return
        try:
            await self._call(
                "POST", "/abort_requests", {"request_ids": [vllm_request_id(r) for r in rids]}, retry=False
            )
        except Exception:  # best effort: an engine that cannot be reached runs nothing we could stop
            return

    # ---- control ---------------------------------------------------------------------------

    async def pause_generation(self, mode: str = "abort") -> dict:
        if mode not in PAUSE_MODES:
            raise self._refuse(
                f"pause mode {mode!r}: vLLM has no pause that frees in-flight requests' KV cache and "
                "recomputes it with the new weights (SGLang's retract); use rollout.pause_mode: abort or in_place"
            )
        return await self._call("POST", f"/pause?mode={PAUSE_MODES[mode]}", None, retry=True)

    async def continue_generation(self) -> dict:
        return await self._call("POST", "/resume", None, retry=True)

    async def flush_cache(self) -> str:
        await self._call("POST", "/reset_prefix_cache", None, retry=True)
        return "ok"

    async def health_generate(self) -> bool:
        return await self._ok("/health")

    async def get_server_info(self) -> dict:
        """What `check_logprobs_mode` asks: the engines the trainer starts report the log-probs of
        the temperature-scaled distribution, which is "raw" in SGLang's terms when nothing truncates
        it (the validation refuses top_p/top_k with vLLM)."""
        return {"engine_kind": "vllm", "logprobs_mode": "raw"}

    async def get_weight_version(self) -> str:
        reply = await self._call("GET", "/weight_info", None, retry=True)
        version = str(reply.get("weight_version") or INITIAL_VERSION)
        self.version = "0" if version == INITIAL_VERSION else version
        return self.version

    async def update_weight_version(self, new_version: str | int, abort_all_requests: bool = False) -> dict:
        if abort_all_requests:
            await self.abort_request(abort_all=True)
        reply = await self._call("POST", "/update_weight_version", {"new_version": str(new_version)}, retry=True)
        self.version = str(new_version)
        return reply

    # ---- weights ---------------------------------------------------------------------------

    async def update_weights_from_disk(self, model_path: str, **fields: Any) -> dict:
        """`reload_weights` from `model_path` (HF safetensors, HF names), then the new version;
        fields: weight_version, flush_cache (load_format must be auto or absent)."""
        if fields.get("load_format") not in (None, "auto", "safetensors"):
            raise self._refuse(f"load_format {fields['load_format']!r}: vLLM reloads safetensors only")
        if fields.get("abort_all_requests"):
            await self.abort_request(abort_all=True)
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": model_path}}
        await self._call("POST", "/collective_rpc", rpc, retry=True)
        version = fields.get("weight_version")
        if version is not None:
            await self.update_weight_version(version)
        if fields.get("flush_cache", True):
            await self.flush_cache()
        return {"success": True, "message": f"reloaded {model_path}", "weight_version": self.version}

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> dict:
        """vLLM's NCCL group (GPU only, `vllm_weights.py`): the worker joins it within this request."""
        return await self._call("POST", "/init_weight_transfer_engine", {"init_info": init_info}, retry=False)

    async def start_weight_update(self) -> dict:
        return await self._call("POST", "/start_weight_update", None, retry=False)

    async def update_weights(self, update_info: dict[str, Any]) -> dict:
        """The worker receives `update_info`'s tensors from the group's rank 0 within this request."""
        return await self._call("POST", "/update_weights", {"update_info": update_info}, retry=False)

    async def finish_weight_update(self, weight_version: str) -> dict:
        reply = await self._call("POST", "/finish_weight_update", {"weight_version": weight_version}, retry=False)
        self.version = weight_version
        return reply

    async def shutdown_weight_transfer_engine(self) -> dict:
        return await self._call("POST", "/shutdown_weight_transfer_engine", None, retry=False)

    async def update_weights_from_tensor(self, serialized_named_tensors: list, **fields: Any) -> dict:
        raise self._refuse(f"/update_weights_from_tensor: {NOT_ON_CPU}")

    async def init_weights_update_group(self, *args: Any, **kwargs: Any) -> dict:
        raise self._refuse(f"/init_weights_update_group: {NOT_ON_CPU}")

    async def update_weights_from_distributed(self, *args: Any, **kwargs: Any) -> dict:
        raise self._refuse(f"/update_weights_from_distributed: {NOT_ON_CPU}")

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        raise self._refuse(f"/destroy_weights_update_group: {NOT_ON_CPU}")

    async def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        raise self._refuse("/release_memory_occupation: vLLM's sleep mode frees no memory on CPU")

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        raise self._refuse("/resume_memory_occupation: vLLM's sleep mode frees no memory on CPU")

    async def weights_checksum(self) -> dict:
        raise EngineHTTPError(
            self.base_url + "/weights_checksum",
            404,
            "vLLM has no /weights_checksum (its /weight_checker hashes are not trustworthy on CPU)",
        )

    async def tokenize(self, **fields: Any) -> dict:
        raise self._refuse("/tokenize: the vLLM engines run without a tokenizer (token ids in and out)")

    async def detokenize(self, **fields: Any) -> dict:
        raise self._refuse("/detokenize: the vLLM engines run without a tokenizer (token ids in and out)")

    # ---- transport -------------------------------------------------------------------------

    def timeout_for(self, path: str) -> float:
        if path in VLLM_GENERATION_PATHS:
            return self.timeout
        if path in VLLM_WEIGHT_PATHS:
            return self.weight_update_timeout
        return super().timeout_for(path)

    def _refuse(self, message: str) -> EngineHTTPError:
        return EngineHTTPError(self.base_url, 400, message)


def vllm_sampling_params(sp: dict[str, Any], eos_token_id: int | None) -> dict[str, Any]:
    """SGLang's sampling parameters as vLLM's /v1/completions fields; an unknown one raises
    `ValueError` naming it. The eos id joins the stop ids unless `ignore_eos`."""
    out: dict[str, Any] = {}
    for key, value in sp.items():
        if value is None:
            continue
        if key not in SAMPLING_FIELDS:
            raise ValueError(f"sampling_params.{key}: not supported by the vLLM backend")
        out[SAMPLING_FIELDS[key] or key] = value
    if eos_token_id is not None and not sp.get("ignore_eos"):
        out["stop_token_ids"] = sorted({*(int(t) for t in out.get("stop_token_ids") or []), int(eos_token_id)})
    return out


def prompt_logprobs(input_ids: Sequence[int], reply: list | None, start: int) -> list[list[Any]]:
    """SGLang's `input_token_logprobs` from `logprob_start_len` = `start`: [log-prob, id, None] for
    input_ids[start:], the first one's log-prob None (as SGLang's), from vLLM's `prompt_logprobs`
    (one {id: {"logprob"}} per position, None at 0)."""
    if reply is None or len(reply) != len(input_ids):
        raise ValueError(f"prompt_logprobs: expected {len(input_ids)} entries from vLLM, got {reply!r:.200}")
    out: list[list[Any]] = []
    for pos in range(start, len(input_ids)):
        entry = reply[pos] if pos > start else None
        token = int(input_ids[pos])
        lp = None if entry is None else float(entry[str(token)]["logprob"])
        out.append([lp, token, None])
    return out


def vllm_request_id(rid: str) -> str:
    """vLLM's id of the (one-prompt) completion request sent with `request_id` = `rid`."""
    return f"cmpl-{rid}-0"
