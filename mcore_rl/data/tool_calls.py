"""Tool calls as plain data, and their text formats per model family.

A model asks for a tool in its family's own syntax (Qwen2.5/Qwen3 and Hermes: `<tool_call>{json}</tool_call>`;
Llama 3.x: a JSON object `{"name": ..., "parameters": ...}`; GLM-4.5: `<tool_call>name` and one
`<arg_key>k</arg_key><arg_value>v</arg_value>` pair per argument; GPT-OSS: a harmony message to
`functions.<name>`). The agentic runtime, the OpenAI-compatible
server and the per-episode proxy all parse the same way, so what the trainer trains on is what a
served model would have been understood to say.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the model sees it: the OpenAI `tools[i].function` object (`parameters` is a JSON schema)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def to_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass
class ToolCall:
    """One call the model made: the tool's name and its arguments (parsed JSON), the text it came from."""

    name: str
    arguments: dict[str, Any]
    id: str = ""  # the OpenAI tool_call id ("call_<n>") a tool message answers
    raw: str = ""  # the exact text of the call in the model's output


@dataclass
class ParsedTurn:
    """A model turn split into its prose and its tool calls; `errors` names each call that could not be
    parsed (bad JSON, no name), in order, so the harness can answer it as an invalid call."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCallFormat:
    """One family's tool-call syntax: how to read calls out of a model turn and how to write them back.

    `render(content, calls)` is the inverse of `parse`: the text of an assistant turn with those calls
    exactly as the family's chat template renders an assistant message with `tool_calls` (what follows
    the assistant header), so history the harness writes matches what the model would have said.
    """

    name: str
    sglang_parser: str  # SGLang's `--tool-call-parser` name for the same syntax
    model_types: tuple[str, ...]  # Hugging Face `config.model_type`s whose chat templates use it
    parse: Callable[[str], ParsedTurn]
    render: Callable[[str, Sequence[ToolCall]], str]


def _arguments(obj: dict[str, Any]) -> dict[str, Any] | str:
    """The call's arguments (`arguments`, or Llama's `parameters`), or why they are not an object."""
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string, as the OpenAI API does
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as err:
            return f"arguments: invalid JSON string ({err.msg} at column {err.colno})"
    if args is None:
        return {}
    if not isinstance(args, dict):
        return f"arguments: expected an object, got {type(args).__name__}"
    return args


def _call_of(obj: Any, raw: str, index: int) -> ToolCall | str:
    """A `ToolCall` from one decoded JSON value, or the reason it is not one."""
    if not isinstance(obj, dict):
        return f"expected a JSON object with name and arguments, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return 'no "name" (a non-empty string)'
    args = _arguments(obj)
    if isinstance(args, str):
        return args
    return ToolCall(name=name.strip(), arguments=args, id=f"call_{index}", raw=raw)


def _json_error(err: json.JSONDecodeError) -> str:
    return f"invalid JSON: {err.msg} at column {err.colno}"


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


def parse_tagged(text: str, read_call: Callable[[str, str, int], ToolCall | str]) -> ParsedTurn:
    """Calls in `<tool_call>...</tool_call>` blocks, any number, each body read by `read_call(body,
    raw, index)` (a `ToolCall`, or why it is not one). The prose is the text before the first call
    (stripped), as SGLang's parsers keep it; a block without its closing tag (a turn cut at the token
    cap inside a call) is an error."""
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return ParsedTurn(content=text)
    turn = ParsedTurn(content=text[:start].strip())
    pos = start
    while pos >= 0:
        body_at = pos + len(_HERMES_OPEN)
        end = text.find(_HERMES_CLOSE, body_at)
        n = len(turn.calls) + len(turn.errors) + 1
        if end < 0:
            turn.errors.append(f"tool call {n}: no closing {_HERMES_CLOSE} (the turn ended inside the call)")
            break
        call = read_call(text[body_at:end], text[pos : end + len(_HERMES_CLOSE)], len(turn.calls))
        if isinstance(call, str):
            turn.errors.append(f"tool call {n}: {call}")
        else:
            turn.calls.append(call)
        pos = text.find(_HERMES_OPEN, end + len(_HERMES_CLOSE))
    return turn


def _hermes_call(body: str, raw: str, index: int) -> ToolCall | str:
    try:
        return _call_of(json.loads(body), raw, index)
    except json.JSONDecodeError as err:
        return _json_error(err)


def parse_hermes(text: str) -> ParsedTurn:
    """Qwen2.5 / Qwen3 / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number."""
    return parse_tagged(text, _hermes_call)


def render_hermes(content: str, calls: Sequence[ToolCall]) -> str:
    """As the Qwen2.5 and Qwen3 chat templates render an assistant message with tool calls."""
    blocks = [
        f'{_HERMES_OPEN}\n{{"name": "{c.name}", "arguments": {json.dumps(c.arguments, ensure_ascii=False)}}}\n'
        f"{_HERMES_CLOSE}"
        for c in calls
    ]
    if not blocks:
        return content
    return (content + "\n" if content else "") + "\n".join(blocks)


PYTHON_TAG = "<|python_tag|>"
_LLAMA_SEPARATOR = ";"


def parse_llama3_json(text: str) -> ParsedTurn:
    """Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}`, after an optional `<|python_tag|>`.

    As SGLang's `llama3` parser reads them: a turn is a call when it holds the python tag (the prose is
    what precedes it) or starts with `{` / `[` (no prose); several calls are separated by `;` or form
    a JSON list. A turn that starts with `{` but is no call is an error, not prose: in this format the
    model chose to call.
    """
    if PYTHON_TAG in text:
        content, action = text.split(PYTHON_TAG, 1)
    elif text.lstrip().startswith(("{", "[")):
        content, action = "", text
    else:
        return ParsedTurn(content=text)
    turn = ParsedTurn(content=content.strip())
    action = action.strip()
    if action.startswith("["):
        try:
            items = json.loads(action)
        except json.JSONDecodeError as err:
            turn.errors.append(f"tool call 1: {_json_error(err)}")
            return turn
        objects = [
            (obj, json.dumps(obj, ensure_ascii=False)) for obj in (items if isinstance(items, list) else [items])
        ]
    else:
        objects = []
        decoder, pos = json.JSONDecoder(), 0
        while pos < len(action):
            try:
                obj, end = decoder.raw_decode(action, pos)
            except json.JSONDecodeError as err:
                objects.append((err, action[pos:]))
                break
            objects.append((obj, action[pos:end]))
            pos = end
            while pos < len(action) and (action[pos].isspace() or action[pos] == _LLAMA_SEPARATOR):
                pos += 1
    for n, (obj, raw) in enumerate(objects, 1):
        call = _json_error(obj) if isinstance(obj, json.JSONDecodeError) else _call_of(obj, raw, len(turn.calls))
        if isinstance(call, str):
            turn.errors.append(f"tool call {n}: {call}")
        else:
            turn.calls.append(call)
    return turn


def render_llama3_json(content: str, calls: Sequence[ToolCall]) -> str:
    """As the Llama 3.1 chat template renders an assistant message with a tool call: the JSON object
    alone (the template drops the message's content; it allows one call, so several are joined with
    SGLang's `;` separator)."""
    if not calls:
        return content
    return "; ".join(
        f'{{"name": "{c.name}", "parameters": {json.dumps(c.arguments, ensure_ascii=False)}}}' for c in calls
    )


_ARG_KEY, _ARG_KEY_END, _ARG_VALUE, _ARG_VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"


def _glm45_value(text: str) -> Any:
    """An argument's value as GLM-4.5's template writes it: a string as is, anything else as JSON.
    Text that is valid JSON reads as that value (without the tool's schema a string argument "42"
    cannot be told from the number; SGLang's `glm45` parser asks the schema), other text as a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _glm45_call(body: str, raw: str, index: int) -> ToolCall | str:
    """One `<tool_call>` block's body (name, then key/value pairs) as a `ToolCall`, or why it is not one."""
    cut = body.find(_ARG_KEY)
    name = (body if cut < 0 else body[:cut]).strip()
    if not name:
        return "no function name after <tool_call>"
    args: dict[str, Any] = {}
    pos = cut
    while pos >= 0:
        key_end = body.find(_ARG_KEY_END, pos)
        value_at = body.find(_ARG_VALUE, key_end) if key_end >= 0 else -1
        value_end = body.find(_ARG_VALUE_END, value_at) if value_at >= 0 else -1
        if value_end < 0 or body[key_end + len(_ARG_KEY_END) : value_at].strip():
            return f"argument {len(args) + 1}: expected <arg_key>k</arg_key> then <arg_value>v</arg_value>"
        key = body[pos + len(_ARG_KEY) : key_end].strip()
        args[key] = _glm45_value(body[value_at + len(_ARG_VALUE) : value_end])
        pos = body.find(_ARG_KEY, value_end)
    return ToolCall(name=name, arguments=args, id=f"call_{index}", raw=raw)


def parse_glm45(text: str) -> ParsedTurn:
    """GLM-4.5 / GLM-4.6: `<tool_call>name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n...</tool_call>`,
    any number (`parse_tagged`); a block without a name or a value for each key is an error."""
    return parse_tagged(text, _glm45_call)


def render_glm45(content: str, calls: Sequence[ToolCall]) -> str:
    """As GLM-4.5's chat template renders an assistant message's content and tool calls (after its
    think block): a newline before the stripped content, then each call on its own lines, a string
    value as is and any other as JSON."""
    out = "\n" + content.strip() if content.strip() else ""
    for c in calls:
        pairs = "".join(
            f"{_ARG_KEY}{k}{_ARG_KEY_END}\n{_ARG_VALUE}"
            f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}{_ARG_VALUE_END}\n"
            for k, v in c.arguments.items()
        )
        out += f"\n{_HERMES_OPEN}{c.name}\n{pairs}{_HERMES_CLOSE}"
    return out


# The format whose calls are key/value pairs in <tool_call> blocks, which a chat template shows by `<arg_key>`.
ARG_PAIRS_FORMAT = "glm45"

# OpenAI's harmony format (GPT-OSS): a turn is messages, each `<|start|>assistant` (the first one's header
# is the prompt's), a channel and a body; a call is a message to a recipient `functions.<name>`.
HARMONY_START = "<|start|>assistant"
_HARMONY_MESSAGE, _HARMONY_CALL = "<|message|>", "<|call|>"
_HARMONY_ENDS = ("<|end|>", _HARMONY_CALL, "<|return|>")
_HARMONY_RECIPIENT = re.compile(r"\bto=(\S+?)(?=<\||\s|$)")
_HARMONY_CHANNEL = re.compile(r"<\|channel\|>(\w+)")
_FUNCTIONS = "functions."


def parse_harmony(text: str) -> ParsedTurn:
    """GPT-OSS's harmony messages: a call is a message whose header names a recipient `to=functions.<name>`
    (before or after its `<|channel|>`, as the released template writes it and as the model also
    generates it) with the JSON arguments as its body, ended by `<|call|>`; the prose is the `final`
    channel's text, else the analysis / commentary text (where the template puts an assistant
    message's content when it carries calls). A call without `<|call|>` (the turn ended inside it) is
    an error. Text without harmony markup is all prose."""
    if _HARMONY_MESSAGE not in text:
        return ParsedTurn(content=text)
    final: list[str] = []
    other: list[str] = []
    turn = ParsedTurn(content="")
    for i, segment in enumerate(text.split(HARMONY_START)):
        header, sep, body = segment.partition(_HARMONY_MESSAGE)
        if not sep:
            continue
        ends = [(body.find(e), e) for e in _HARMONY_ENDS if e in body]
        at, end = min(ends) if ends else (len(body), "")
        recipient = _HARMONY_RECIPIENT.search(header)
        channel = _HARMONY_CHANNEL.search(header)
        if recipient is None:
            (final if channel and channel.group(1) == "final" else other).append(body[:at])
            continue
        n = len(turn.calls) + len(turn.errors) + 1
        if end != _HARMONY_CALL:
            turn.errors.append(f"tool call {n}: no closing {_HARMONY_CALL} (the turn ended inside the call)")
            continue
        name = recipient.group(1).removeprefix(_FUNCTIONS)
        raw = (HARMONY_START if i else "") + header + sep + body[:at] + end  # the call's message as written
        try:
            call = _call_of({"name": name, "arguments": json.loads(body[:at])}, raw, len(turn.calls))
        except json.JSONDecodeError as err:
            call = _json_error(err)
        if isinstance(call, str):
            turn.errors.append(f"tool call {n}: {call}")
        else:
            turn.calls.append(call)
    turn.content = "".join(final) if final else "".join(other)
    return turn


def render_harmony(content: str, calls: Sequence[ToolCall]) -> str:
    """As the GPT-OSS chat template renders an assistant message, after its first `<|start|>assistant`:
    with calls, the content as an analysis message, then each call as a message to `functions.<name>`
    in the commentary channel with its JSON arguments, ended by `<|call|>` (the template renders one
    call per message); without calls, the content in the final channel."""
    if not calls:
        return f"<|channel|>final{_HARMONY_MESSAGE}{content}<|end|>"
    messages = [f"{HARMONY_START}<|channel|>analysis{_HARMONY_MESSAGE}{content}<|end|>"] if content else []
    messages += [
        f"{HARMONY_START} to={_FUNCTIONS}{c.name}<|channel|>commentary json{_HARMONY_MESSAGE}"
        f"{json.dumps(c.arguments, ensure_ascii=False)}{_HARMONY_CALL}"
        for c in calls
    ]
    return "".join(messages)[len(HARMONY_START) :]


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    f.name: f
    for f in (
        ToolCallFormat(
            name="hermes",
            sglang_parser="qwen25",
            model_types=("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "mcore_rl_qwen3", "mcore_rl"),
            parse=parse_hermes,
            render=render_hermes,
        ),
        ToolCallFormat(
            name="llama3_json",
            sglang_parser="llama3",
            model_types=("llama",),
            parse=parse_llama3_json,
            render=render_llama3_json,
        ),
        ToolCallFormat(
            name=ARG_PAIRS_FORMAT,
            sglang_parser="glm45",
            model_types=("glm4_moe",),
            parse=parse_glm45,
            render=render_glm45,
        ),
        ToolCallFormat(
            name="harmony",
            sglang_parser="gpt-oss",
            model_types=("gpt_oss",),
            parse=parse_harmony,
            render=render_harmony,
        ),
    )
}


def tool_call_format(name: str) -> ToolCallFormat:
    """The format registered as `name` (or under SGLang's parser name for it); a clear error otherwise."""
    for fmt in TOOL_CALL_FORMATS.values():
        if name in (fmt.name, fmt.sglang_parser):
            return fmt
    known = ", ".join(f"{f.name} (SGLang: {f.sglang_parser})" for f in TOOL_CALL_FORMATS.values())
    raise ValueError(f"unknown tool-call format {name!r}; known: {known}")


def tool_call_format_for(model_type: str) -> str | None:
    """The tool-call format of a model family (its HF `config.model_type`), or None when none is known."""
    for fmt in TOOL_CALL_FORMATS.values():
        if model_type in fmt.model_types:
            return fmt.name
    return None


def parse_tool_calls(text: str, fmt: str) -> ParsedTurn:
    """Split a model turn into prose and tool calls in the format `fmt`; malformed calls go to `errors`."""
    return tool_call_format(fmt).parse(text)


def render_tool_calls(content: str, calls: Sequence[ToolCall], fmt: str) -> str:
    """The assistant text carrying `calls` in the format `fmt` (the inverse of `parse_tool_calls`)."""
    return tool_call_format(fmt).render(content, calls)


def openai_tool_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """Calls as an OpenAI assistant message's `tool_calls` (arguments as a JSON string, as the API has them)."""
    return [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in calls
    ]


def tool_calls_from_openai(items: Any, where: str = "tool_calls") -> list[ToolCall]:
    """An OpenAI assistant message's `tool_calls` as `ToolCall`s; a ValueError naming the bad field."""
    if not isinstance(items, list):
        raise ValueError(f"{where}: expected a list of tool calls")
    calls = []
    for i, item in enumerate(items):
        fn = item.get("function") if isinstance(item, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}[{i}].function: expected an object with a string name")
        args = _arguments(fn)
        if isinstance(args, str):
            raise ValueError(f"{where}[{i}].function.{args}")
        calls.append(ToolCall(name=fn["name"], arguments=args, id=str(item.get("id") or "")))
    return calls
