"""OpenAI-compatible `/v1/completions` and `/v1/chat/completions` on top of the engine requests.

Shapes follow the OpenAI API as SGLang serves it (`entrypoints/openai/protocol.py`), including
SGLang's extra sampling fields (`top_k`, `min_p`, `min_tokens`, `stop_token_ids`, `ignore_eos`,
`skip_special_tokens`, `no_stop_trim`) and `matched_stop` in each choice. Choices are ordered
prompt by prompt, `n` per prompt. Log-probs are the raw model distribution's, as on `/generate`.

Chat prompts use the tokenizer's own chat template when it has one (`apply_chat_template`, given
`chat_template_kwargs`, and with `reasoning_effort` turned into `thinking` / `enable_thinking` as
SGLang does); otherwise (the bundled byte tokenizer) the ChatML layout
`<|im_start|>role\\ncontent<|im_end|>\\n` with `<|im_start|>assistant\\n` appended (or, with
`continue_final_message`, the last assistant message left open), and `<|im_end|>` as an extra
stop token. `input_ids` replaces the templated prompt, as in SGLang.

Tools, as SGLang serves them with a `--tool-call-parser`: `tools` go to the chat template
(`apply_chat_template(tools=...)`; the ChatML fallback lists them in the system message), earlier
assistant `tool_calls` are handed to the template with their arguments as objects, and the reply is
parsed in the model family's format (`data/tool_calls.py`): the calls come back as the message's
`tool_calls` with `finish_reason` "tool_calls", the prose before them as its content. `tool_choice`
"none" neither renders nor parses tools; "required" and a named function are enforced by writing
the opening of a call (`<tool_call>\n` or `<tool_call>\n{"name": "f", "arguments": ` in the hermes
format) at the start of the reply as part of the prompt: the engine has no grammar, so the
arguments themselves are not constrained to the schema, and a reply whose call does not parse comes
back as plain content. A streamed reply with tools is sent whole when it finishes (one content and
tool-call delta), not token by token.

Every field SGLang's `CompletionRequest` / `ChatCompletionRequest` define is accepted when its
value is one the engine honours: routing and cache hints with any value; the reasoning-parser
switches (`separate_reasoning`, `stream_reasoning`), which change nothing without a reasoning
parser, as in SGLang; features the engine lacks (legacy `functions`, LoRA, hidden states, grammars)
only at their default. Other names are refused. Length checks are SGLang's (`protocol.check_lengths`): an
explicit `max_tokens` (completions always have one, default 16) must fit beside the prompt; a chat
`max_tokens` / `max_completion_tokens` above the context length is refused first, with SGLang's
"max_completion_tokens is too large" message. The penalties, `logit_bias` and `stop_regex` are
SGLang's sampling parameters (`rollout/engine/sampling.py`).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from mcore_rl.data.tool_calls import (
    ParsedTurn,
    ToolCall,
    openai_tool_calls,
    parse_tool_calls,
    render_tool_calls,
    tool_calls_from_openai,
)
from mcore_rl.rollout.engine.core import Request, RequestOutput
from mcore_rl.rollout.protocol import RequestError, check_fields, check_lengths, sampling_params_from_json, show

# OpenAI name -> SGLang sampling_params name.
_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "no_stop_trim": "no_stop_trim",
    "seed": "sampling_seed",
    "min_tokens": "min_new_tokens",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "logit_bias": "logit_bias",
    "regex": "regex",
    "json_schema": "json_schema",
    "ebnf": "ebnf",
    "stop_regex": "stop_regex",
    "custom_params": "custom_params",
}
_COMMON = {"model", "n", "stream", "stream_options", "max_tokens", "logprobs", "response_format", *_SAMPLING}
# Metadata, routing and cache hints (SGLang's and OpenAI's): no token changes; any value of the type.
_IGNORED: dict[str, tuple[type, ...]] = {
    "user": (str,),
    "metadata": (dict,),
    "store": (bool,),
    "service_tier": (str,),
    "rid": (str, list),
    "extra_body": (dict,),
    "session_id": (str,),
    "extra_key": (str, list),
    "cache_salt": (str, list),
    "priority": (int,),
    "routed_dp_rank": (int,),
    "disagg_prefill_dp_rank": (int,),
    "data_parallel_rank": (int,),
    "custom_labels": (dict,),
}
# SGLang features the engine lacks: accepted at their default only.
_UNSUPPORTED: dict[str, object] = {
    "return_hidden_states": False,
    "return_routed_experts": False,
    "routed_experts_start_len": 0,
    "return_cached_tokens_details": False,
    "return_token_ids": False,
    "lora_path": None,
    "session_params": None,
    "custom_logit_processor": None,
    "images_config": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "ngram_corpus_id": None,
}
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo"}
_COMPLETION_UNSUPPORTED = _UNSUPPORTED | {"suffix": None, "best_of": None}
_CHAT_FIELDS = _COMMON | {
    "messages",
    "top_logprobs",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "input_ids",
    "chat_template_kwargs",
    "reasoning_effort",
    "continue_final_message",
    "separate_reasoning",
    "stream_reasoning",
    "task",
}
_CHAT_UNSUPPORTED = _UNSUPPORTED | {
    "functions": None,
    "function_call": None,
    "audio": None,
    "modalities": None,
    "prediction": None,
    "return_prompt_token_ids": False,
    "return_meta_info": False,
    "max_dynamic_patch": None,
    "min_dynamic_patch": None,
    "use_audio_in_video": False,
}
_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_TASKS = ("action", "query", "authority", "domain", "title", "read_url")


@dataclass
class ChatTools:
    """The tools of a chat request that uses them: what the template is given, how the reply is read."""

    tools: list[dict[str, Any]]  # the request's `tools`, as the template takes them
    fmt: str  # the tool-call format the reply is parsed in (`data/tool_calls.py`)
    required: bool = False  # tool_choice "required" or a named function
    function: str | None = None  # tool_choice names this function
    parallel: bool = True  # parallel_tool_calls: false keeps the first call only
    prefix: str = ""  # the opening of a call written at the start of the reply (required / named)

    def parse(self, text: str) -> ParsedTurn:
        turn = parse_tool_calls(self.prefix + text, self.fmt)
        if not self.parallel:
            turn.calls = turn.calls[:1]
        for call in turn.calls:  # ids unique across a conversation, as SGLang's "call_<hex>"
            call.id = f"call_{uuid.uuid4().hex[:24]}"
        return turn


@dataclass
class OpenAIInput:
    """A parsed OpenAI request: `n` engine requests per prompt, prompt by prompt."""

    chat: bool
    requests: list[Request]
    prompts: list[list[int]]
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None  # top-k per position when log-probs are asked for, else None
    model: str | None = None  # as the request named it
    echo_texts: list[str] | None = None
    tools: ChatTools | None = None  # chat with tools in use (see the module docstring)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def parse_completion(body: Any, *, tokenizer, vocab_size: int, context_length: int) -> OpenAIInput:
    _object(body)
    check_fields(body, _COMPLETION_FIELDS, _IGNORED, _COMPLETION_UNSUPPORTED)
    if body.get("best_of") not in (None, body.get("n", 1)):
        raise RequestError("best_of: not supported by the embedded engine (only best_of == n)")
    max_tokens = body.get("max_tokens", 16)
    if _is_int(max_tokens) and max_tokens <= 0:
        raise RequestError(f"max_tokens: max_tokens must be positive, got {max_tokens}")
    prompts, texts = _completion_prompts(body.get("prompt"), tokenizer)
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= vocab_size):
        raise RequestError(f"logprobs: expected an integer in [0, {vocab_size}] or null, got {logprobs!r}")
    echo = _bool(body, "echo", False)
    inp = _build(
        body,
        prompts,
        max_tokens,
        "max_tokens",
        logprobs,
        False,
        echo and logprobs is not None,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        context_length=context_length,
        extra_stop=[],
    )
    inp.echo_texts = texts if echo else None
    return inp


def parse_chat(
    body: Any, *, tokenizer, vocab_size: int, context_length: int, tool_format: str | None = None
) -> OpenAIInput:
    """`tool_format`: the server's tool-call parser (None: a request with tools is refused)."""
    _object(body)
    check_fields(body, _CHAT_FIELDS, _IGNORED, _CHAT_UNSUPPORTED)
    for key in ("separate_reasoning", "stream_reasoning"):
        _bool(body, key, True)  # no reasoning parser: nothing for them to change
    if body.get("task") not in (None, *_TASKS):
        raise RequestError(f"task: expected one of {', '.join(_TASKS)} or null, got {show(body['task'])}")
    tools = chat_tools(body, tool_format)
    continue_final = _bool(body, "continue_final_message", False)
    if tools is not None and tools.prefix and continue_final:
        raise RequestError("tool_choice: a required or named tool call cannot continue the final message")
    prompt = chat_prompt(
        body.get("messages"),
        tokenizer,
        continue_final=continue_final,
        template_kwargs=chat_template_kwargs(body),
        tools=tools,
        tool_format=tool_format,
    )
    if tools is not None:
        prompt += tools.prefix
    ids = body.get("input_ids")
    if ids is None:
        ids = tokenizer.encode(prompt)
    elif not isinstance(ids, list) or not ids or not all(_is_int(t) for t in ids):
        raise RequestError("input_ids: expected a non-empty list of integer token ids")
    top = body.get("top_logprobs")
    if top is not None and (not _is_int(top) or not 0 <= top <= vocab_size):
        raise RequestError(f"top_logprobs: expected an integer in [0, {vocab_size}], got {top!r}")
    logprobs = (top or 0) if _bool(body, "logprobs", False) else None
    if top and logprobs is None:
        raise RequestError("top_logprobs: needs logprobs: true")
    max_tokens, key = body.get("max_tokens"), "max_tokens"
    if body.get("max_completion_tokens") is not None:
        max_tokens, key = body["max_completion_tokens"], "max_completion_tokens"
    if _is_int(max_tokens) and max_tokens > context_length:  # SGLang's chat check and wording (_validate_request)
        raise RequestError(
            f"{key}: max_completion_tokens is too large: {max_tokens}. This model supports at most "
            f"{context_length} completion tokens."
        )
    end = getattr(tokenizer, "token_to_id", None)
    extra_stop = [end("<|im_end|>")] if end is not None and not hasattr(tokenizer, "apply_chat_template") else []
    if tools is not None and body.get("skip_special_tokens") is None:
        body = {**body, "skip_special_tokens": False}  # as SGLang: a call may open with a special token
    inp = _build(
        body,
        [ids],
        max_tokens,
        key,
        logprobs,
        True,
        False,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        context_length=context_length,
        extra_stop=extra_stop,
    )
    inp.tools = tools
    return inp


def chat_tools(body: dict, tool_format: str | None) -> ChatTools | None:
    """The request's `tools` / `tool_choice` / `parallel_tool_calls`, checked; None when no tools are
    in use (none given, or tool_choice "none")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = _bool(body, "parallel_tool_calls", True)
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):  # without tools "auto" is "none"
            raise RequestError(f"tool_choice: {show(choice)} needs tools; none were given")
        return None
    if not isinstance(tools, list):
        raise RequestError("tools: expected a list of {type: function, function: {name, parameters}} objects")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise RequestError(f"tools[{i}]: expected {{type: function, function: {{name, parameters}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"tools[{i}].function.name: expected a non-empty string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise RequestError(f"tools[{i}].function.parameters: expected a JSON schema object")
        names.append(fn["name"])
    function = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError('tool_choice: expected "none", "auto", "required" or {type: function, function: {name}}')
        function = fn["name"]
        if function not in names:
            raise RequestError(f"tool_choice.function.name: {function!r} is not among the tools ({', '.join(names)})")
    elif choice not in (None, "none", "auto", "required"):
        raise RequestError(f'tool_choice: expected "none", "auto", "required" or a named function, got {show(choice)}')
    if choice == "none":
        return None
    if tool_format is None:
        raise RequestError(
            "tools: this server has no tool-call parser for its model; start it with --tool-call-parser "
            "(a format of data/tool_calls.py or its SGLang name, e.g. hermes / qwen25)"
        )
    offered = [t for t in tools if function is None or t["function"]["name"] == function]
    required = choice == "required" or function is not None
    prefix = ""
    if required:
        opening = render_tool_calls("", [ToolCall(function or "\x00", {})], tool_format)
        # the text of a call up to its name (required) or up to its arguments (named function)
        prefix = opening[: opening.index("\x00")] if function is None else opening[: opening.index("{}")]
    return ChatTools(offered, tool_format, required, function, parallel, prefix)


def chat_template_kwargs(body: dict) -> dict:
    """`chat_template_kwargs`, with `reasoning_effort` as SGLang maps it (thinking on unless "none")."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise RequestError(f"chat_template_kwargs: expected an object or null, got {show(kwargs)}")
    kwargs = dict(kwargs)
    effort = body.get("reasoning_effort")
    if effort is not None:
        if isinstance(effort, str) and effort not in REASONING_EFFORTS:
            try:
                effort = float(effort)
            except ValueError:
                raise RequestError(
                    f"reasoning_effort: expected one of {', '.join(REASONING_EFFORTS)} or a "
                    f"number in [0, 0.99], got {effort!r}"
                ) from None
        if (
            isinstance(effort, bool)
            or not isinstance(effort, (str, int, float))
            or (not isinstance(effort, str) and not 0.0 <= effort <= 0.99)
        ):
            raise RequestError(
                f"reasoning_effort: expected one of {', '.join(REASONING_EFFORTS)} or a number "
                f"in [0, 0.99], got {show(body['reasoning_effort'])}"
            )
        kwargs.setdefault("thinking", effort != "none")
        kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs


def chat_prompt(
    messages: Any,
    tokenizer,
    continue_final: bool = False,
    template_kwargs: dict | None = None,
    tools: ChatTools | None = None,
    tool_format: str | None = None,
) -> str:
    """The prompt text for a chat request (see the module docstring). `tool_format` renders earlier
    tool calls in the ChatML fallback (default: hermes)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: expected a non-empty list of {role, content} objects")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}]: expected an object with a string role")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(
                        f"messages[{i}].content[{j}]: only text parts are supported by the embedded engine"
                    )
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise RequestError(f"messages[{i}].content: expected a string or a list of text parts")
        msg: dict[str, Any] = {"role": m["role"], "content": content}
        if m.get("tool_calls"):
            try:
                calls = tool_calls_from_openai(m["tool_calls"], f"messages[{i}].tool_calls")
            except ValueError as err:
                raise RequestError(str(err)) from None
            msg["tool_calls"] = [  # templates take the arguments as an object (`| tojson`)
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ]
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        clean.append(msg)
    if continue_final and clean[-1]["role"] != "assistant":
        raise RequestError("continue_final_message: the last message must be an assistant message to continue")
    template = getattr(tokenizer, "apply_chat_template", None)
    if template is not None and getattr(tokenizer, "has_chat_template", True):
        extra = dict(template_kwargs or {})
        if continue_final:
            extra["continue_final_message"] = True
        if tools is not None:
            extra["tools"] = tools.tools
        try:
            return template(clean, add_generation_prompt=not continue_final, tokenize=False, **extra)
        except ValueError:  # an HF tokenizer without a chat template: fall back to ChatML
            pass
    text = "".join(f"<|im_start|>{m['role']}\n{chatml_content(m, tool_format)}<|im_end|>\n" for m in clean)
    if tools is not None:
        text = chatml_tools(tools) + text
    if continue_final:  # leave the last (assistant) message open
        return text[: -len("<|im_end|>\n")]
    return text + "<|im_start|>assistant\n"


def chatml_content(message: dict[str, Any], tool_format: str | None) -> str:
    """A message's text in the ChatML fallback: an assistant's tool calls written in the format."""
    calls = message.get("tool_calls")
    if not calls:
        return message["content"]
    parsed = [ToolCall(c["function"]["name"], c["function"]["arguments"], c["id"]) for c in calls]
    return render_tool_calls(message["content"], parsed, tool_format or "hermes")


def chatml_tools(tools: ChatTools) -> str:
    """The ChatML fallback's system message offering the tools: one JSON object a line, as Qwen2.5's
    template lists them (a model without a chat template has no trained tool prompt to match)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.tools)
    return f"<|im_start|>system\n<tools>\n{lines}\n</tools><|im_end|>\n"


def _build(
    body,
    prompts,
    max_tokens,
    max_key,
    logprobs,
    chat,
    prompt_logprobs,
    *,
    tokenizer,
    vocab_size,
    context_length,
    extra_stop,
) -> OpenAIInput:
    n = body.get("n", 1)
    if not _is_int(n) or n < 1:
        raise RequestError(f"n: expected an integer >= 1, got {n!r}")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("stream_options: expected an object")
    check_fields(options, {"include_usage"}, set(), {"continuous_usage_stats": False}, prefix="stream_options.")
    include_usage = options.get("include_usage", False)
    if include_usage is None:
        include_usage = False
    if not isinstance(include_usage, bool):
        raise RequestError("stream_options.include_usage: expected true or false")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise RequestError('response_format: only {"type": "text"} is supported by the embedded engine')
    sp: dict[str, Any] = {_SAMPLING[k]: v for k, v in body.items() if k in _SAMPLING and v is not None}
    if max_tokens is not None:
        sp["max_new_tokens"] = max_tokens
    if extra_stop and not sp.get("ignore_eos"):
        stop_ids = sp.get("stop_token_ids", [])
        sp["stop_token_ids"] = (
            stop_ids + extra_stop if isinstance(stop_ids, list) else stop_ids
        )  # a bad type is reported below
    names = {v: k for k, v in _SAMPLING.items()} | {"max_new_tokens": max_key}
    requests = []
    base = uuid.uuid4().hex
    for p, ids in enumerate(prompts):
        for j in range(n):
            check_lengths(len(ids), max_tokens, context_length, "messages" if chat else "prompt", max_key)
            try:
                params = sampling_params_from_json(dict(sp))
                if max_tokens is None:  # "as long as the context allows", as SGLang's chat does
                    params.max_new_tokens = context_length - len(ids)
                params.validate(context_length, len(ids), vocab_size)
            except ValueError as err:
                raise RequestError(_openai_names(str(err), names)) from None
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise RequestError(f"prompt: token id {bad} is outside the vocabulary [0, {vocab_size})")
            requests.append(
                Request(
                    rid=f"{base}-{p}-{j}",
                    input_ids=ids,
                    sampling=params,
                    return_logprob=logprobs is not None,
                    top_logprobs_num=logprobs or 0,
                    logprob_start_len=0 if prompt_logprobs else -1,
                    stream=stream,
                )
            )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"model: expected a string, got {model!r}")
    return OpenAIInput(chat, requests, prompts, n, stream, include_usage, logprobs, model)


def _openai_names(message: str, names: dict[str, str]) -> str:
    """Error messages name the OpenAI field, not the engine's."""
    if message.startswith("sampling_params."):
        key, _, rest = message.removeprefix("sampling_params.").partition(":")
        return f"{names.get(key, key)}:{rest}"
    return message


def _completion_prompts(prompt: Any, tokenizer) -> tuple[list[list[int]], list[str]]:
    if isinstance(prompt, str):
        items: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(x, str) or isinstance(x, list) for x in prompt):
        items = prompt
    else:
        raise RequestError("prompt: expected a string, a list of strings, a list of token ids or a list of such lists")
    prompts, texts = [], []
    for i, item in enumerate(items):
        if isinstance(item, str):
            ids, text = tokenizer.encode(item), item
        elif item and all(_is_int(t) for t in item):
            ids, text = list(item), None
        else:
            raise RequestError(f"prompt[{i}]: expected a string or a non-empty list of integer token ids")
        if not ids:
            raise RequestError(f"prompt[{i}]: the prompt is empty")
        prompts.append(ids)
        texts.append(text if text is not None else tokenizer.decode(ids))
    return prompts, texts


# --- responses ----------------------------------------------------------------------------------


def usage(inp: OpenAIInput, outs: list[RequestOutput]) -> dict:
    prompt = sum(len(p) for p in inp.prompts)
    completion = sum(o.completion_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def finish(out: RequestOutput) -> tuple[str | None, Any]:
    reason = out.finish_reason or {}
    return _REASONS.get(str(reason.get("type"))), reason.get("matched")


def completion_response(inp: OpenAIInput, outs: list[RequestOutput], *, model: str, tokenizer) -> dict:
    choices = []
    for i, out in enumerate(outs):
        text = out.text or ""
        lp = None
        if inp.logprobs is not None:
            pairs: list[tuple[float | None, int]] = list(out.output_token_logprobs)
            tops: list[list[tuple[float, int]] | None] = list(out.output_top_logprobs)
            if inp.echo_texts is not None:
                pairs, tops = list(out.input_token_logprobs) + pairs, list(out.input_top_logprobs) + tops
            lp = completion_logprobs(pairs, tops, tokenizer, inp.logprobs)
        if inp.echo_texts is not None:
            text = inp.echo_texts[i // inp.n] + text
        reason, matched = finish(out)
        choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": reason, "matched_stop": matched})
    return {
        "id": f"cmpl-{inp.id}",
        "object": "text_completion",
        "created": inp.created,
        "model": model,
        "choices": choices,
        "usage": usage(inp, outs),
    }


def chat_response(inp: OpenAIInput, outs: list[RequestOutput], *, model: str, tokenizer) -> dict:
    choices = []
    for i, out in enumerate(outs):
        reason, matched = finish(out)
        lp = None
        if inp.logprobs is not None:
            lp = {"content": chat_logprobs(out.output_token_logprobs, out.output_top_logprobs, tokenizer, inp.logprobs)}
        message, reason = chat_message(inp, out.text or "", reason)
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": lp,
                "finish_reason": reason,
                "matched_stop": matched,
            }
        )
    return {
        "id": f"chatcmpl-{inp.id}",
        "object": "chat.completion",
        "created": inp.created,
        "model": model,
        "choices": choices,
        "usage": usage(inp, outs),
    }


def chat_message(inp: OpenAIInput, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message of one choice and its finish reason: with tools in use, the calls the
    reply holds as `tool_calls` ("tool_calls" when the engine stopped on its own), as SGLang does."""
    if inp.tools is None:
        return {"role": "assistant", "content": text}, reason
    turn = inp.tools.parse(text)
    if not turn.calls:  # no call, or none that parsed: the reply as it came
        return {"role": "assistant", "content": inp.tools.prefix + text}, reason
    message = {"role": "assistant", "content": turn.content or None, "tool_calls": openai_tool_calls(turn.calls)}
    return message, "tool_calls" if reason == "stop" else reason


def completion_logprobs(pairs, tops, tokenizer, k: int) -> dict:
    tokens = [tokenizer.decode([tid]) for _, tid in pairs]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _ in pairs],
        "top_logprobs": [None if t is None else {tokenizer.decode([tid]): lp for lp, tid in t[:k]} for t in tops],
        "text_offset": offsets,
    }


def chat_logprobs(pairs, tops, tokenizer, k: int) -> list[dict]:
    def entry(lp: float, tid: int) -> dict:
        token = tokenizer.decode([tid])
        return {"token": token, "logprob": lp, "bytes": list(token.encode("utf-8"))}

    return [entry(lp, tid) | {"top_logprobs": [entry(a, b) for a, b in top[:k]]} for (lp, tid), top in zip(pairs, tops)]


class StreamState:
    """Turns a choice's cumulative outputs into OpenAI deltas. Text that a later token could still
    change is held back: an incomplete UTF-8 character, or the tail that might start a stop string."""

    def __init__(self, inp: OpenAIInput, index: int, req: Request) -> None:
        self.inp, self.index = inp, index
        self.holdback = max((len(s) for s in req.sampling.stop or []), default=1) - 1
        self.sent_text = ""
        self.sent_tokens = 0
        self.started = False

    def chunk(self, out: RequestOutput, *, model: str, tokenizer) -> dict | None:
        text = out.text or ""
        if self.inp.chat and self.inp.tools is not None and not out.finished:
            text = ""  # a reply with tools is parsed whole: sent when it finishes
        elif not out.finished:
            text = text.rstrip("\ufffd")
            text = text[: max(len(self.sent_text), len(text) - self.holdback)]
        delta = text[len(self.sent_text) :] if text.startswith(self.sent_text) else ""
        self.sent_text += delta
        new_pairs = out.output_token_logprobs[self.sent_tokens :]
        new_tops = out.output_top_logprobs[self.sent_tokens :]
        self.sent_tokens = len(out.output_token_logprobs)
        reason, matched = finish(out) if out.finished else (None, None)
        if not delta and not out.finished and not new_pairs and self.started:
            return None
        lp = None
        if self.inp.chat:
            if self.inp.logprobs is not None:
                lp = {"content": chat_logprobs(new_pairs, new_tops, tokenizer, self.inp.logprobs)}
            d: dict[str, Any] = {"content": delta} if self.started else {"role": "assistant", "content": delta}
            if self.inp.tools is not None and out.finished:
                message, reason = chat_message(self.inp, self.sent_text, reason)
                d["content"] = message["content"]
                if message.get("tool_calls"):
                    d["tool_calls"] = [{"index": k} | c for k, c in enumerate(message["tool_calls"])]
            self.started = True
            choice = {"index": self.index, "delta": d, "logprobs": lp, "finish_reason": reason, "matched_stop": matched}
            return {
                "id": f"chatcmpl-{self.inp.id}",
                "object": "chat.completion.chunk",
                "created": self.inp.created,
                "model": model,
                "choices": [choice],
            }
        if self.inp.logprobs is not None:
            lp = completion_logprobs(new_pairs, new_tops, tokenizer, self.inp.logprobs)
        if not self.started and self.inp.echo_texts is not None:
            delta = self.inp.echo_texts[self.index // self.inp.n] + delta
        self.started = True
        choice = {"index": self.index, "text": delta, "logprobs": lp, "finish_reason": reason, "matched_stop": matched}
        return {
            "id": f"cmpl-{self.inp.id}",
            "object": "text_completion",
            "created": self.inp.created,
            "model": model,
            "choices": [choice],
        }


def usage_chunk(inp: OpenAIInput, outs: list[RequestOutput], model: str) -> dict:
    obj = "chat.completion.chunk" if inp.chat else "text_completion"
    prefix = "chatcmpl" if inp.chat else "cmpl"
    return {
        "id": f"{prefix}-{inp.id}",
        "object": obj,
        "created": inp.created,
        "model": model,
        "choices": [],
        "usage": usage(inp, outs),
    }


def model_card(model: str, context_length: int) -> dict:
    """SGLang's `ModelCard` (what the `openai` client's `models.retrieve` reads)."""
    return {
        "id": model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "mcore-rl",
        "root": model,
        "parent": None,
        "max_model_len": context_length,
    }


def models_list(model: str, context_length: int) -> dict:
    return {"object": "list", "data": [model_card(model, context_length)]}


def model_not_found(model: str) -> dict:
    """SGLang's 404 body for `/v1/models/{model}` naming a model it does not serve."""
    return {
        "error": {
            "message": f"The model '{model}' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


def _object(body: Any) -> None:
    if not isinstance(body, dict):
        raise RequestError(f"body: expected a JSON object, got {type(body).__name__}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"{key}: expected true or false, got {v!r}")
    return v


# --- /tokenize, /detokenize ---------------------------------------------------------------------

_TOKENIZE_FIELDS = {
    "model",
    "prompt",
    "messages",
    "tool_choice",
    "reasoning_effort",
    "continue_final_message",
    "chat_template_kwargs",
    "add_special_tokens",
}


def tokenize(body: Any, *, tokenizer, context_length: int) -> dict:
    """SGLang's `TokenizeRequest` -> `TokenizeResponse`: `prompt` (a string or a list of them) or
    chat `messages` (templated as `/v1/chat/completions` does) -> their token ids."""
    _object(body)
    check_fields(body, _TOKENIZE_FIELDS, {}, {"tools": None})
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise RequestError("prompt, messages: Exactly one of 'prompt' or 'messages' must be provided.")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise RequestError("tool_choice: tools are not supported by the embedded engine (only 'none' or 'auto')")
    special = _bool(body, "add_special_tokens", True)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=True) if special else tokenizer.encode(text)

    if messages is not None:
        text = chat_prompt(
            messages,
            tokenizer,
            continue_final=_bool(body, "continue_final_message", False),
            template_kwargs=chat_template_kwargs(body),
        )
        tokens: Any = tokenizer.encode(text)  # the template already holds the special tokens
        count: Any = len(tokens)
    elif isinstance(prompt, str):
        tokens = encode(prompt)
        count = len(tokens)
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        tokens = [encode(p) for p in prompt]
        count = [len(t) for t in tokens]
    else:
        raise RequestError(f"prompt: expected a string or a list of strings, got {type(prompt).__name__}")
    return {"tokens": tokens, "count": count, "max_model_len": context_length}


def detokenize(body: Any, *, tokenizer, vocab_size: int) -> dict:
    """SGLang's `DetokenizeRequest` -> `DetokenizeResponse`: token ids (or a list of such lists) -> text."""
    _object(body)
    check_fields(body, {"model", "tokens", "skip_special_tokens"}, {}, {})
    tokens = body.get("tokens")
    skip = _bool(body, "skip_special_tokens", True)

    def decode(ids: Any, where: str) -> str:
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            raise RequestError(f"tokens{where}: expected a list of integer token ids")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(f"tokens{where}: token id {bad} is outside the vocabulary [0, {vocab_size})")
        return tokenizer.decode(ids, skip_special_tokens=skip)

    if not isinstance(tokens, list):
        raise RequestError("tokens: expected a list of token ids or a list of such lists")
    if tokens and isinstance(tokens[0], list):
        return {"text": [decode(ids, f"[{i}]") for i, ids in enumerate(tokens)]}
    return {"text": decode(tokens, "")}
