"""SGLang's native `/generate` API: parsing and validating requests, building responses.

Field names and JSON shapes follow SGLang (`GenerateReqInput` in `managers/io_struct.py`, the
`meta_info` its TokenizerManager builds, `SamplingParams` in `sampling/sampling_params.py`), so a
client written for `sglang.launch_server` works unchanged against the embedded engine:

    request:  {"text" | "input_ids", "sampling_params", "return_logprob", "top_logprobs_num",
               "token_ids_logprob", "logprob_start_len", "return_text_in_logprobs", "stream", "rid",
               "return_routed_experts"}
              (lists = a batch)
    response: {"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
               "completion_tokens", "cached_tokens", "weight_version", "e2e_latency",
               ["input_token_logprobs", "output_token_logprobs",        # [logprob, token_id, text|null]
                "input_top_logprobs", "output_top_logprobs",            # per position: list of those
                "input_token_ids_logprobs", "output_token_ids_logprobs"],   # likewise, token_ids_logprob's ids
               ["routed_experts"],  # base64 int32 [prompt + output - 1, layers, k] (return_routed_experts)
               ["output_token_sampling_mask", "output_token_sampling_logprobs",
                "output_token_sampling_mask_length"]}}                 # with return_sampling_mask

`token_ids_logprob` (a list of ids; for a batch one list for every prompt, or a list per prompt)
asks for the log-probs of exactly those ids, in that order, at every scored position: SGLang's
`input_token_ids_logprobs` is aligned with `input_token_logprobs` (its first entry None, as the
scheduler pads `input_top_logprobs`), `output_token_ids_logprobs` has one list per generated token;
both only with `return_logprob`, and a position with no ids is None, as SGLang's detokenizer gives.

`return_sampling_mask: true` (SGLang's field; a bool, or one per prompt for a batch; independent of
`return_logprob`) adds per output token the ids of the support the token was drawn from
(`output_token_sampling_mask`, a list of id lists), the log-prob of the token under those renormalised
post-filter weights (`output_token_sampling_logprobs`) and the number of tokens
(`output_token_sampling_mask_length`). As SGLang does, a request whose support could be the whole
vocabulary (temperature > 0 with top_k -1 and top_p 1) is refused with 400, and so is a top_k above
the server's `--sampling-mask-max-tokens`; see `rollout/engine/core.py` for a support that outgrows it.

`sampling_params` takes SGLang's fields, its penalties, `logit_bias` and `stop_regex` included
(semantics in `rollout/engine/sampling.py`).

Everything a request can fail is checked here, before it reaches the engine, so one bad item never
leaves half a batch running; each error names the field (`RequestError` -> HTTP 400). Every field
SGLang's `GenerateReqInput` defines is accepted: those that change no token (metrics, routing and
cache hints) with any value of their type, those for features the embedded engine lacks (images,
LoRA, grammars, custom logit processors, hidden states) only at SGLang's default value; names SGLang does not
define are refused. SGLang's up-front length checks apply, with its messages: a prompt of
`context_length` tokens or more, or an explicit `max_new_tokens` that does not fit next to the
prompt, is refused (an absent `max_new_tokens` is clamped to the context instead).

Parallel samples (`n` > 1) come out prompt-major (`[p0, p0, p1, p1]`), each with its own fresh id,
as SGLang's TokenizerManager fans them out (the request's `rid` names none of them). Streamed
chunks carry `e2e_latency` only in a request's final chunk, as SGLang's do.
"""

from __future__ import annotations

import base64
import json
import reprlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mcore_rl.rollout.engine.core import Request, RequestOutput
from mcore_rl.rollout.engine.sampling import SamplingParams, mask_replay_conflict


class RequestError(ValueError):
    """A mistake in the client's request; answered with HTTP 400 and this message, which names the field."""


# --- /generate fields ---------------------------------------------------------------------------

_GENERATE_FIELDS = {
    "rid",
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_text_in_logprobs",
    "stream",
    "return_routed_experts",  # routing replay (needs --enable-return-routed-experts)
    "return_sampling_mask",  # sampling-mask replay
}
_STR, _INT, _NUM, _BOOL, _DICT, _LIST = (str,), (int,), (int, float), (bool,), (dict,), (list,)
# Metadata a real SGLang server uses for metrics, logging, routing or prefix-cache keys; it changes
# no token. Any value of the type SGLang declares (or null) is accepted.
_IGNORED_FIELDS: dict[str, tuple[type, ...]] = {
    "log_metrics": _BOOL,
    "priority": _INT,
    "custom_labels": _DICT,
    "no_logs": _BOOL,
    "routing_key": _STR,
    "conversation_id": _STR,
    "session_id": _STR,
    "routed_dp_rank": _INT,
    "data_parallel_rank": _INT,
    "disagg_prefill_dp_rank": _INT,
    "kv_router_hint": _DICT,
    "received_time": _NUM,
    "external_trace_header": _DICT,
    "extra_key": _STR + _LIST,
    "cache_salt": _STR + _LIST,
    "background": _BOOL,
    "http_worker_ipc": _STR,
}
# SGLang features the embedded engine does not have: accepted at SGLang's default (null, or the
# value given here; a list of defaults for per-item fields), an error naming the field otherwise.
_UNSUPPORTED_FIELDS: dict[str, Any] = {
    "input_embeds": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "mm_hashes": None,
    "mm_content_hashes": None,
    "use_audio_in_video": False,
    "video_config": None,
    "return_flat_raw_top_logprobs": False,
    "return_flat_raw_top_logprobs_b64": False,
    "return_hidden_states": False,
    "routed_experts_start_len": 0,
    "return_indexer_topk": False,
    "modalities": None,
    "session_params": None,
    "lora_path": None,
    "lora_id": None,
    "custom_logit_processor": None,
    "positional_embed_overrides": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "bootstrap_pair_key": None,
    "decode_tp_size": None,
    "require_reasoning": False,
    "max_thinking_tokens": None,
    "return_bytes": False,
    "return_entropy": False,
    "return_prompt_token_ids": False,
    "need_wait_for_mm_inputs": None,
    "num_items_assigned": None,
    "encoder_urls": None,
    "max_dynamic_patch": None,
    "min_dynamic_patch": None,
    "image_max_dynamic_patch": None,
    "video_max_dynamic_patch": None,
    "images_config": None,
    "multi_item_delimiter_indices": None,
}
# sampling_params keys SGLang knows that the engine ignores (presentation/stream granularity only) ...
_IGNORED_SAMPLING = {"spaces_between_special_tokens", "stream_interval"}
# ... and those it cannot honour, accepted only at their neutral value.
_NEUTRAL_SAMPLING = {
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "custom_params": None,
}


@dataclass
class GenerateInput:
    """A parsed `/generate` body: one engine `Request` per item (parallel samples `n` expanded)."""

    requests: list[Request]
    is_single: bool
    stream: bool
    return_text_in_logprobs: bool


def parse_generate(
    body: Any,
    *,
    tokenizer,
    vocab_size: int,
    context_length: int,
    enable_return_routed_experts: bool = False,
    sampling_mask_max_tokens: int | None = None,
) -> GenerateInput:
    """Validate a `/generate` body and turn it into engine requests; raises `RequestError`.
    `return_routed_experts` needs the server's `--enable-return-routed-experts`, as in SGLang."""
    if not isinstance(body, dict):
        raise RequestError(f"body: expected a JSON object, got {type(body).__name__}")
    check_fields(body, _GENERATE_FIELDS, _IGNORED_FIELDS, _UNSUPPORTED_FIELDS)

    prompts, is_single = _prompts(body, tokenizer)
    batch = len(prompts)
    sampling = body.get("sampling_params")
    if sampling is None:
        sampling = [{}] * batch
    elif isinstance(sampling, dict):
        sampling = [sampling] * batch
    elif isinstance(sampling, list) and not is_single:
        if len(sampling) != batch:
            raise RequestError(f"sampling_params: {len(sampling)} entries for a batch of {batch}")
    else:
        raise RequestError(f"sampling_params: expected an object (or a list of them for a batch), got {sampling!r}")
    for i, sp in enumerate(sampling):
        if not isinstance(sp, dict):
            raise RequestError(f"sampling_params[{i}]: expected an object, got {sp!r}")
    n = _parallel_samples(sampling)

    return_logprob = _per_item(body, "return_logprob", batch, is_single, n, False, _bool)
    start_len = _per_item(body, "logprob_start_len", batch, is_single, n, -1, _int)
    top_num = _per_item(body, "top_logprobs_num", batch, is_single, n, 0, _int)
    want_mask = _per_item(body, "return_sampling_mask", batch, is_single, n, False, _bool)
    token_ids = _token_ids_logprob(body.get("token_ids_logprob"), batch, is_single, n, vocab_size)
    stream = _bool("stream", body.get("stream", False))
    routed = _bool("return_routed_experts", body.get("return_routed_experts", False))
    if routed and not enable_return_routed_experts:
        raise RequestError("return_routed_experts: this server was not started with --enable-return-routed-experts")
    with_text = _bool("return_text_in_logprobs", body.get("return_text_in_logprobs", False))
    rids = _rids(body.get("rid"), batch, n, is_single)
    prompt_field = "text" if body.get("text") is not None else "input_ids"

    requests = []
    for i, ids in enumerate(prompts):  # SGLang's order for parallel samples: prompt-major
        for k in range(n):
            where = "" if is_single and n == 1 else f" (batch item {i * n + k})"
            _check_ids(ids, vocab_size, where)
            check_lengths(
                len(ids),
                sampling[i].get("max_new_tokens"),
                context_length,
                prompt_field,
                "sampling_params.max_new_tokens",
                where,
            )
            try:
                params = sampling_params_from_json(sampling[i])
                params.validate(context_length, len(ids), vocab_size)
            except ValueError as err:
                raise RequestError(f"{err}{where}") from None
            if start_len[i] < -1 or start_len[i] >= len(ids):
                raise RequestError(
                    f"logprob_start_len: must be -1 (output tokens only) or in [0, {len(ids)}) for a "
                    f"{len(ids)}-token prompt, got {start_len[i]}{where}"
                )
            if want_mask[i]:
                _check_sampling_mask(params, sampling_mask_max_tokens, where)
            if not 0 <= top_num[i] <= vocab_size:
                raise RequestError(f"top_logprobs_num: must be in [0, {vocab_size}], got {top_num[i]}{where}")
            requests.append(
                Request(
                    rid=rids[i * n + k],
                    input_ids=ids,
                    sampling=params,
                    return_logprob=return_logprob[i],
                    top_logprobs_num=top_num[i],
                    logprob_start_len=start_len[i],
                    stream=stream,
                    token_ids_logprob=token_ids[i],
                    return_routed_experts=routed,
                    return_sampling_mask=want_mask[i],
                )
            )
    return GenerateInput(requests, is_single and n == 1, stream, with_text)


def _check_sampling_mask(sp: SamplingParams, max_tokens: int | None, where: str) -> None:
    """SGLang's 400 for `return_sampling_mask` with a support that is not bounded (or over the cap);
    ours for logit processors, whose offsets a trainer's replay over the support would not reproduce."""
    if sp.processes_logits:
        raise RequestError(mask_replay_conflict(sp) + where)
    if sp.is_greedy:
        return
    if sp.top_k == -1 and sp.top_p >= 1.0:
        raise RequestError(
            "return_sampling_mask: the support would be the whole vocabulary (temperature > 0, top_k -1, top_p 1); "
            f"set sampling_params.top_k or sampling_params.top_p < 1{where}"
        )
    if max_tokens is not None and sp.top_k > max_tokens:
        raise RequestError(
            f"return_sampling_mask: sampling_params.top_k={sp.top_k} exceeds --sampling-mask-max-tokens="
            f"{max_tokens}{where}"
        )


def check_lengths(
    prompt_len: int, max_new_tokens: Any, context_length: int, prompt_field: str, max_field: str, where: str = ""
) -> None:
    """SGLang's up-front checks (TokenizerManager._validate_one_request), with its messages: the
    prompt must be shorter than the context, and an explicit `max_new_tokens` must fit beside it."""
    if prompt_len >= context_length:
        raise RequestError(
            f"{prompt_field}: The input ({prompt_len} tokens) is longer than the model's context length "
            f"({context_length} tokens).{where}"
        )
    if _is_int(max_new_tokens) and max_new_tokens >= 0 and max_new_tokens + prompt_len >= context_length:
        raise RequestError(
            f"{max_field}: Requested token count exceeds the model's maximum context length of "
            f"{context_length} tokens. You requested a total of {max_new_tokens + prompt_len} tokens: "
            f"{prompt_len} tokens from the input messages and {max_new_tokens} tokens for the completion. "
            f"Please reduce the number of tokens in the input messages or the completion to fit within "
            f"the limit.{where}"
        )


def check_fields(
    body: dict,
    known: set[str],
    ignored: set[str] | Mapping[str, tuple[type, ...]],
    unsupported: set[str] | dict[str, Any],
    prefix: str = "",
) -> None:
    """Unknown keys, ignored ones of the wrong type and unsupported features away from their
    default are errors naming the key. `ignored` may map names to accepted types; `unsupported`
    names to their default (a set: null / false / empty)."""
    for key, value in body.items():
        if key in known:
            continue
        if key in ignored:
            kinds = ignored.get(key) if isinstance(ignored, dict) else None
            if (
                kinds
                and value is not None
                and not (isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool)))
            ):
                want = " or ".join(k.__name__ for k in kinds)
                raise RequestError(f"{prefix}{key}: expected {want} or null, got {show(value)}")
            continue
        if key in unsupported:
            default = unsupported.get(key) if isinstance(unsupported, dict) else None
            if at_default(value, default):
                continue
            raise RequestError(
                f"{prefix}{key}: not supported by the embedded engine (only {json.dumps(default)}), got {show(value)}"
            )
        raise RequestError(f"{prefix}{key}: unknown field (accepted: {', '.join(sorted(known))})")


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 8, 8, 80, 80


def show(value: Any) -> str:
    """A short repr of client data for an error message (bounded however large or deep it is)."""
    return _REPR.repr(value)


def at_default(value: Any, default: Any) -> bool:
    """`value` is SGLang's default for a field: null, the default itself (same type), a list of
    defaults (a per-item field), or, where the default is null, an empty / false value."""
    if value is None:
        return True
    if isinstance(value, list):
        return all(v is None or _same(v, default) or (default is None and v in (False, "", [], {})) for v in value)
    if default is None:
        return value is False or value == "" or value == {}
    return _same(value, default)


def _same(value: Any, default: Any) -> bool:
    return type(value) is type(default) and value == default


def sampling_params_from_json(d: dict) -> SamplingParams:
    """SGLang's `sampling_params` object -> `SamplingParams` (without `n`, handled by the caller)."""
    kept = {}
    for key, value in d.items():
        if key == "n" or key in _IGNORED_SAMPLING:
            continue
        if key in _NEUTRAL_SAMPLING:
            if value is not None and value != _NEUTRAL_SAMPLING[key]:
                raise RequestError(f"sampling_params.{key}: not supported by the embedded engine (got {value!r})")
            continue
        kept[key] = value
    return SamplingParams.from_dict(kept)


def _prompts(body: dict, tokenizer) -> tuple[list[list[int]], bool]:
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise RequestError("text, input_ids: give exactly one of them")
    if text is not None:
        if isinstance(text, str):
            texts, single = [text], True
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            texts, single = text, False
        else:
            raise RequestError("text: expected a string or a non-empty list of strings")
        prompts = [tokenizer.encode(t) for t in texts]
        for i, ids in enumerate(prompts):
            if not ids:
                raise RequestError("text: the prompt is empty" + ("" if single else f" (batch item {i})"))
        return prompts, single
    if not isinstance(input_ids, list) or not input_ids:
        raise RequestError("input_ids: expected a non-empty list of token ids (or a list of such lists)")
    if all(_is_int(t) for t in input_ids):
        return [list(input_ids)], True
    if all(isinstance(row, list) and row and all(_is_int(t) for t in row) for row in input_ids):
        return [list(row) for row in input_ids], False
    raise RequestError("input_ids: expected a non-empty list of integer token ids (or a list of such lists)")


def _check_ids(ids: list[int], vocab_size: int, where: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"input_ids: token id {bad} is outside the vocabulary [0, {vocab_size}){where}")


def _token_ids_logprob(value: Any, batch: int, is_single: bool, n: int, vocab_size: int) -> list:
    """SGLang's `token_ids_logprob` per prompt (its `_normalize_logprob_params`): null or [] = none;
    an id = [id]; a list of ids = the same list for every prompt; for a batch, a list per prompt
    (null = none for that prompt), not with n > 1."""
    key = "token_ids_logprob"
    if value is None or value == []:
        return [None] * batch
    if _is_int(value):
        value = [value]
    if not isinstance(value, list):
        raise RequestError(
            f"{key}: expected a list of token ids (or, for a batch, a list of such lists), got {show(value)}"
        )
    per: list[list[Any] | None]
    if all(_is_int(t) for t in value):
        per = [list(value)] * batch
    elif all(v is None or isinstance(v, list) for v in value):
        if is_single:
            raise RequestError(
                f"{key}: a list of lists needs a batch of prompts; for one prompt give a list of "
                f"token ids, got {show(value)}"
            )
        if len(value) != batch:
            raise RequestError(f"{key}: {len(value)} lists for a batch of {batch} prompts")
        if n > 1:
            raise RequestError(f"{key}: Cannot use list {key} with parallel_sample_num > 1")
        per = [None if v is None else list(v) for v in value]
    else:
        raise RequestError(
            f"{key}: expected integer token ids (or, for a batch, a list of lists of them), got {show(value)}"
        )
    for i, ids in enumerate(per):
        where = "" if is_single else f" (batch item {i})"
        for t in ids or ():
            if not _is_int(t):
                raise RequestError(f"{key}: expected integer token ids, got {show(t)}{where}")
            if not 0 <= t < vocab_size:  # SGLang's wording (TokenizerManager._validate_token_ids_logprob)
                raise RequestError(
                    f"{key} contains out-of-vocabulary token id {t}; valid range is [0, {vocab_size}).{where}"
                )
    return per


def _parallel_samples(sampling: list[dict]) -> int:
    ns = set()
    for sp in sampling:
        n = 1 if sp.get("n") is None else sp["n"]
        if not _is_int(n) or n < 1:
            raise RequestError(f"sampling_params.n: expected an integer >= 1, got {n!r}")
        ns.add(n)
    if len(ns) > 1:
        raise RequestError("sampling_params.n: must be the same for every item of a batch")
    return ns.pop()


def _per_item(body: dict, key: str, batch: int, is_single: bool, n: int, default: Any, check) -> list:
    value = body.get(key)
    if value is None:
        return [default] * batch
    if isinstance(value, list):
        if is_single or len(value) != batch:
            raise RequestError(f"{key}: a list needs a batch of the same length ({batch} prompts)")
        if n > 1:
            raise RequestError(f"{key}: Cannot use list {key} with parallel_sample_num > 1")
        return [default if v is None else check(key, v) for v in value]
    return [check(key, value)] * batch


def _rids(rid: Any, batch: int, n: int, is_single: bool) -> list[str]:
    """One id per engine request: the request's own (a string expanded to `{rid}_{i}` over a
    batch), but for parallel samples a fresh one each, as SGLang regenerates them."""
    if rid is None:
        pass
    elif isinstance(rid, str) and rid:
        if n == 1:
            return [rid] if is_single else [f"{rid}_{i}" for i in range(batch)]
    elif isinstance(rid, list) and not is_single and all(isinstance(r, str) and r for r in rid):
        if len(rid) != batch:
            raise RequestError(f"rid: {len(rid)} ids for a batch of {batch}")
        if len(set(rid)) != len(rid):  # SGLang's wording (GenerateReqInput._validate_rid_uniqueness)
            dups = sorted({r for r in rid if rid.count(r) > 1})
            raise RequestError(f"rid: Duplicate request IDs detected within the request: {dups}")
        if n == 1:
            return list(rid)
    else:
        raise RequestError("rid: expected a non-empty string (or, for a batch, a list of them)")
    return [uuid.uuid4().hex for _ in range(batch * n)]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(key: str, v: Any) -> int:
    if not _is_int(v):
        raise RequestError(f"{key}: expected an integer, got {v!r}")
    return v


def _bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise RequestError(f"{key}: expected true or false, got {v!r}")
    return v


# --- responses ----------------------------------------------------------------------------------


def generate_output(
    out: RequestOutput, req: Request, *, tokenizer, return_text_in_logprobs: bool, e2e_latency: float
) -> dict:
    """One `/generate` result (or one streamed chunk: cumulative text, ids and log-probs so far;
    `e2e_latency` only once the request has finished)."""
    meta: dict[str, Any] = {
        "id": out.rid,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": 0,
        "weight_version": str(out.weight_version),
        # Ours, not SGLang's: the weight version that sampled each output token (parallel to
        # output_ids / output_token_logprobs); more than one value after a partial rollout.
        "output_token_weight_versions": [str(v) for v in out.output_token_weight_versions],
    }
    if out.finished:
        meta["e2e_latency"] = e2e_latency
    if req.return_logprob:
        with_text = tokenizer if return_text_in_logprobs else None
        meta["input_token_logprobs"] = logprob_triples(out.input_token_logprobs, with_text)
        meta["output_token_logprobs"] = logprob_triples(out.output_token_logprobs, with_text)
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [
                None if t is None else logprob_triples(t, with_text) for t in out.input_top_logprobs
            ]
            meta["output_top_logprobs"] = [logprob_triples(t, with_text) for t in out.output_top_logprobs]
        if req.token_ids_logprob is not None:  # SGLang: a position without values (the first input one) is None
            meta["input_token_ids_logprobs"] = [
                logprob_triples(t, with_text) if t else None for t in out.input_token_ids_logprobs
            ]
            meta["output_token_ids_logprobs"] = [
                logprob_triples(t, with_text) if t else None for t in out.output_token_ids_logprobs
            ]
    if req.return_routed_experts and out.routed_experts is not None:
        meta["routed_experts"] = encode_routed_experts(out.routed_experts)
    if req.return_sampling_mask:  # sampling-mask replay (SGLang's meta_info fields)
        meta["output_token_sampling_mask"] = [list(m) for m in out.output_token_sampling_mask]
        meta["output_token_sampling_logprobs"] = list(out.output_token_sampling_logprobs)
        meta["output_token_sampling_mask_length"] = len(out.output_token_sampling_mask)
    text = (
        out.text
        if out.text is not None
        else tokenizer.decode(out.output_ids, skip_special_tokens=req.sampling.skip_special_tokens)
    )
    return {"text": text, "output_ids": list(out.output_ids), "meta_info": meta}


def encode_routed_experts(routed: Any) -> str:
    """SGLang's meta_info["routed_experts"]: base64 of the little-endian int32 array
    [tokens - 1, layers, k] (token-major, then layer, then top-k slot)."""
    return base64.b64encode(np.ascontiguousarray(routed, dtype="<i4").tobytes()).decode("ascii")


def decode_routed_experts(value: str, num_tokens: int, num_layers: int) -> np.ndarray:
    """`encode_routed_experts` inverted, as slime decodes it: int32 [num_tokens - 1, num_layers, k]
    for a sequence of `num_tokens` tokens (prompt + output); ValueError naming the field on a size
    that does not split so."""
    flat = np.frombuffer(base64.b64decode(value), dtype="<i4").astype(np.int32)
    rows = max(num_tokens - 1, 0)
    if flat.size % max(rows * num_layers, 1) or (rows == 0) != (flat.size == 0):
        raise ValueError(
            f"routed_experts: {flat.size} expert ids do not split into {rows} tokens "
            f"(len(prompt) + len(output) - 1) x {num_layers} layers"
        )
    return flat.reshape(rows, num_layers, -1)


def logprob_triples(pairs, tokenizer=None) -> list[list]:
    """(logprob, token_id) pairs -> SGLang's [logprob, token_id, token_text or null] lists."""
    if tokenizer is None:
        return [[lp, tid, None] for lp, tid in pairs]
    return [[lp, tid, tokenizer.decode([tid])] for lp, tid in pairs]


def error_body(message: str, status: int = 400) -> dict:
    """SGLang's error shape (`_create_error_response`), plus the HTTP code."""
    return {"error": {"message": message, "code": status}}


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse(obj: Any) -> bytes:
    """One server-sent event, as SGLang streams them."""
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
