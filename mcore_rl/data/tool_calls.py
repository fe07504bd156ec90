"""Tool calls as plain data, and their text formats per model family.

A model asks for a tool in its family's own syntax (Qwen2.5/Qwen3 and Hermes: `<tool_call>{json}</tool_call>`;
Llama 3.x: a JSON object `{"name": ..., "parameters": ...}`; GLM-4.5: `<tool_call>name` and one
`<arg_key>k</arg_key><arg_value>v</arg_value>` pair per argument; GPT-OSS: a harmony message to
`functions.<name>`; DeepSeek-V3 and Kimi-K2: a section of calls between their own special tokens). The agentic runtime, the OpenAI-compatible
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
    # text a chat template holds when it speaks this format (all of them), checked in registry order
    # before the hermes / llama3 / ChatML rules of `config/rl_environment.py`; () = none
    template_markers: tuple[str, ...] = ()


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


def _sections(
    text: str, section: tuple[str, str], call: tuple[str, str], read_call: Callable[[str, str, int], ToolCall | str]
) -> ParsedTurn:
    """Calls in a tool-call section (`section` = its begin and end markers), each between `call`'s
    markers and its body read by `read_call(body, raw, index)`: DeepSeek-V3's and Kimi-K2's layout.
    The prose is the text before the section (stripped); a call without its end marker (the turn
    ended inside it) is an error, and so is a section that never opens a call."""
    begin, end = section
    start = text.find(begin)
    if start < 0:
        return ParsedTurn(content=text)
    turn = ParsedTurn(content=text[:start].strip())
    stop = text.find(end, start)
    body = text[start + len(begin) : len(text) if stop < 0 else stop]
    pos = body.find(call[0])
    if pos < 0:
        turn.errors.append(f"tool call 1: no {call[0]} after {begin}")
    while pos >= 0:
        at = pos + len(call[0])
        close = body.find(call[1], at)
        n = len(turn.calls) + len(turn.errors) + 1
        if close < 0:
            turn.errors.append(f"tool call {n}: no closing {call[1]} (the turn ended inside the call)")
            break
        got = read_call(body[at:close], body[pos : close + len(call[1])], len(turn.calls))
        if isinstance(got, str):
            turn.errors.append(f"tool call {n}: {got}")
        else:
            turn.calls.append(got)
        pos = body.find(call[0], close + len(call[1]))
    return turn


def _json_arguments(name: str, text: str, raw: str, index: int) -> ToolCall | str:
    try:
        return _call_of({"name": name, "arguments": json.loads(text)}, raw, index)
    except json.JSONDecodeError as err:
        return _json_error(err)


# DeepSeek-V3 / R1 (and V3.1): a section of calls, each `function<｜tool▁sep｜>name` then the JSON
# arguments in a ```json fence (V3.1: `name<｜tool▁sep｜>{json}`, no fence).
DEEPSEEK_SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
DEEPSEEK_CALL = ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")
_DEEPSEEK_SEP, _JSON_FENCE, _FENCE = "<｜tool▁sep｜>", "```json", "```"


def _deepseek_call(body: str, raw: str, index: int) -> ToolCall | str:
    head, sep, rest = body.partition(_DEEPSEEK_SEP)
    if not sep:
        return f"no {_DEEPSEEK_SEP} between the call's type and its function name"
    if head.strip() == "function" and _JSON_FENCE in rest:  # V3: `function<sep>name\n```json\n{...}\n````
        name, _, fenced = rest.partition(_JSON_FENCE)
        if not fenced.rstrip().endswith(_FENCE):
            return f"arguments: no closing {_FENCE} after {_JSON_FENCE}"
        return _json_arguments(name.strip(), fenced.rstrip()[: -len(_FENCE)], raw, index)
    return _json_arguments(head.strip(), rest, raw, index)  # V3.1: `name<sep>{...}`


def parse_deepseek_v3(text: str) -> ParsedTurn:
    """DeepSeek-V3 / R1: `<｜tool▁calls▁begin｜>`, then each call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>name`,
    its JSON arguments in a ```json fence on their own lines, `<｜tool▁call▁end｜>`; then
    `<｜tool▁calls▁end｜>`. V3.1's calls (`name<｜tool▁sep｜>{args}`, no fence) are read too (SGLang's
    `deepseekv3` / `deepseekv31`)."""
    return _sections(text, DEEPSEEK_SECTION, DEEPSEEK_CALL, _deepseek_call)


def render_deepseek_v3(content: str, calls: Sequence[ToolCall]) -> str:
    """As DeepSeek-V3's released chat template renders an assistant message with tool calls, after
    `<｜Assistant｜>` and before `<｜end▁of▁sentence｜>`: the content, the section, the calls joined by
    a newline."""
    if not calls:
        return content
    blocks = [
        f"{DEEPSEEK_CALL[0]}function{_DEEPSEEK_SEP}{c.name}\n{_JSON_FENCE}\n"
        f"{json.dumps(c.arguments, ensure_ascii=False)}\n{_FENCE}{DEEPSEEK_CALL[1]}"
        for c in calls
    ]
    joined = "\n".join(blocks)
    return f"{content}{DEEPSEEK_SECTION[0]}{joined}{DEEPSEEK_SECTION[1]}"


def render_deepseek_v31(content: str, calls: Sequence[ToolCall]) -> str:
    """As DeepSeek-V3.1's chat template renders an assistant message with tool calls: no type, no fence,
    no separator between calls."""
    if not calls:
        return content
    blocks = "".join(
        f"{DEEPSEEK_CALL[0]}{c.name}{_DEEPSEEK_SEP}{json.dumps(c.arguments, ensure_ascii=False)}{DEEPSEEK_CALL[1]}"
        for c in calls
    )
    return f"{content}{DEEPSEEK_SECTION[0]}{blocks}{DEEPSEEK_SECTION[1]}"


# Kimi-K2: a section of calls, each `<|tool_call_begin|>functions.<name>:<index>` then
# `<|tool_call_argument_begin|>{json}<|tool_call_end|>`; the id names the function.
KIMI_SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
KIMI_CALL = ("<|tool_call_begin|>", "<|tool_call_end|>")
_KIMI_ARGUMENTS = "<|tool_call_argument_begin|>"
_KIMI_ID = re.compile(r"^\s*(?:functions\.)?(?P<name>[^\s:]+?)(?::(?P<index>\d+))?\s*$")


def _kimi_call(body: str, raw: str, index: int) -> ToolCall | str:
    call_id, sep, args = body.partition(_KIMI_ARGUMENTS)
    if not sep:
        return f"no {_KIMI_ARGUMENTS} after the call's id"
    m = _KIMI_ID.match(call_id)
    if m is None:
        return f"call id {call_id.strip()!r} is not functions.<name>:<index>"
    call = _json_arguments(m.group("name"), args, raw, index)
    if isinstance(call, ToolCall):
        call.id = call_id.strip()  # the model's own id: a tool message answers it (`## Return of <id>`)
    return call


def parse_kimi_k2(text: str) -> ParsedTurn:
    """Kimi-K2: `<|tool_calls_section_begin|>`, calls `<|tool_call_begin|>functions.name:i`
    `<|tool_call_argument_begin|>{args}<|tool_call_end|>`, `<|tool_calls_section_end|>` (SGLang's
    `kimi_k2`); a call keeps the model's id, which names the function and the call's index."""
    return _sections(text, KIMI_SECTION, KIMI_CALL, _kimi_call)


def render_kimi_k2(content: str, calls: Sequence[ToolCall]) -> str:
    """As Kimi-K2's released chat template renders an assistant message with tool calls, after its
    header: the content, then the section. A call's id is written as the template writes it; one not
    in Kimi's `functions.<name>:<index>` form (the harness's `call_<n>`) becomes that form with its
    index in the turn, since the model reads the function's name from the id."""
    if not calls:
        return content
    blocks = []
    for i, c in enumerate(calls):
        m = _KIMI_ID.match(c.id) if c.id.startswith("functions.") else None
        call_id = c.id if m is not None and m.group("name") == c.name else f"functions.{c.name}:{i}"
        blocks.append(
            f"{KIMI_CALL[0]}{call_id}{_KIMI_ARGUMENTS}{json.dumps(c.arguments, ensure_ascii=False)}{KIMI_CALL[1]}"
        )
    return f"{content}{KIMI_SECTION[0]}{''.join(blocks)}{KIMI_SECTION[1]}"


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
            template_markers=("<|channel|>",),
        ),
        ToolCallFormat(
            name="deepseek_v3",
            sglang_parser="deepseekv3",
            model_types=("deepseek_v3",),
            parse=parse_deepseek_v3,
            render=render_deepseek_v3,
            template_markers=(DEEPSEEK_SECTION[0], _JSON_FENCE),
        ),
        ToolCallFormat(
            name="deepseek_v31",
            sglang_parser="deepseekv31",
            model_types=(),  # model_type deepseek_v3 as V3 is; told apart by its chat template
            parse=parse_deepseek_v3,
            render=render_deepseek_v31,
            template_markers=(DEEPSEEK_SECTION[0],),
        ),
        ToolCallFormat(
            name="kimi_k2",
            sglang_parser="kimi_k2",
            model_types=("kimi_k2",),
            parse=parse_kimi_k2,
            render=render_kimi_k2,
            template_markers=(KIMI_SECTION[0],),
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
