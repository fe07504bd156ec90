"""Tool-call formats: parsing a model turn, writing calls back as the family's chat template does.

The chat templates are the real ones of Qwen2.5-Instruct and Llama 3.1 (`tests/chat_templates/`),
rendered by `transformers`; SGLang's `qwen25` and `llama3` parsers are the reference behaviour.
"""

from __future__ import annotations

import json
import os

import pytest

from mcore_rl.data.tool_calls import (
    TOOL_CALL_FORMATS,
    ToolCall,
    ToolSpec,
    openai_tool_calls,
    parse_tool_calls,
    render_tool_calls,
    tool_call_format,
    tool_call_format_for,
    tool_calls_from_openai,
)

TEMPLATES = os.path.join(os.path.dirname(__file__), "chat_templates")
WEATHER = ToolSpec(
    "get_weather",
    "Weather of a city",
    {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]},
)


def hf_tokenizer(template_file: str):
    """A tiny `transformers` tokenizer carrying a real family's chat template (rendering needs no vocabulary)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    with open(os.path.join(TEMPLATES, template_file)) as f:
        tok.chat_template = f.read()
    return tok


def assistant_text(tok, calls: list[ToolCall], content: str, header: str, end: str) -> str:
    """What the template writes for an assistant message with `calls` after the assistant header."""
    base = [{"role": "user", "content": "weather?"}]
    msg = {"role": "assistant", "content": content, "tool_calls": openai_tool_calls(calls)}
    for m in msg["tool_calls"]:  # templates take the arguments as an object, as servers hand them over
        m["function"]["arguments"] = json.loads(m["function"]["arguments"])
    tools = [WEATHER.to_openai()]
    before = tok.apply_chat_template(base, tools=tools, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(base + [msg], tools=tools, tokenize=False)
    assert full.startswith(before[: -len(header)]), (before, full)
    turn = full[len(before) - len(header) :]
    assert turn.startswith(header) and turn.endswith(end), turn
    return turn[len(header) : -len(end)]


CALLS = [
    ToolCall("get_weather", {"city": "Zürich", "unit": "celsius"}),
    ToolCall("get_weather", {"city": "Paris"}),
]


@pytest.mark.parametrize("content", ["", "Let me look that up."])
def test_hermes_renders_as_the_qwen25_template_and_parses_back(content):
    tok = hf_tokenizer("qwen2_5_instruct.jinja")
    # with no content the template's "\n" before the first call is the header's own newline
    text = assistant_text(tok, CALLS, content, "<|im_start|>assistant\n", "<|im_end|>\n")
    assert render_tool_calls(content, CALLS, "hermes") == text
    turn = parse_tool_calls(text, "hermes")
    assert turn.content == content and not turn.errors
    assert [(c.name, c.arguments, c.id) for c in turn.calls] == [
        ("get_weather", {"city": "Zürich", "unit": "celsius"}, "call_0"),
        ("get_weather", {"city": "Paris"}, "call_1"),
    ]
    assert "".join(c.raw for c in turn.calls) == text[text.index("<tool_call>") :].replace(
        "\n<tool_call>", "<tool_call>"
    )
    # the template offered the tool the way the parser expects calls
    system = tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[WEATHER.to_openai()], tokenize=False)
    assert json.dumps(WEATHER.to_openai(), ensure_ascii=False) in system and "<tool_call>" in system


def test_llama3_json_renders_as_the_llama31_template_and_parses_back():
    tok = hf_tokenizer("llama3_1_json.jinja")
    one = CALLS[:1]
    text = assistant_text(tok, one, "", "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>")
    assert (
        render_tool_calls("", one, "llama3_json")
        == text
        == ('{"name": "get_weather", "parameters": {"city": "Zürich", "unit": "celsius"}}')
    )
    turn = parse_tool_calls(text, "llama3_json")
    assert (
        not turn.errors
        and turn.content == ""
        and [(c.name, c.arguments) for c in turn.calls] == [("get_weather", {"city": "Zürich", "unit": "celsius"})]
    )
    # the template refuses several calls; the format joins them with SGLang's ";" and reads them back
    two = render_tool_calls("", CALLS, "llama3_json")
    assert [c.arguments for c in parse_tool_calls(two, "llama3_json").calls] == [c.arguments for c in CALLS]


def test_hermes_malformed_calls_become_errors_with_the_reason():
    text = (
        'thinking aloud\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"x": }\n</tool_call>\n'
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "c", "arguments": [1]}</tool_call>'
        '<tool_call>{"name": "d", "arguments": "{\\"y\\": 2}"}</tool_call>'
        '<tool_call>{"name": "e", "arg'
    )
    turn = parse_tool_calls(text, "hermes")
    assert turn.content == "thinking aloud"
    assert [(c.name, c.arguments) for c in turn.calls] == [("a", {"x": 1}), ("d", {"y": 2})]
    assert len(turn.errors) == 4, turn.errors
    assert turn.errors[0].startswith("tool call 2: invalid JSON: Expecting value")
    assert turn.errors[1] == 'tool call 3: no "name" (a non-empty string)'
    assert turn.errors[2] == "tool call 4: arguments: expected an object, got list"
    assert turn.errors[3] == "tool call 6: no closing </tool_call> (the turn ended inside the call)"
    # no call at all: the whole text is prose, untouched
    assert parse_tool_calls("  just an answer\n", "hermes") == parse_tool_calls("  just an answer\n", "hermes")
    assert parse_tool_calls("  just an answer\n", "hermes").content == "  just an answer\n"


def test_llama3_json_python_tag_lists_and_errors():
    turn = parse_tool_calls('I will call it.<|python_tag|>{"name": "f", "arguments": {"a": 1}}', "llama3_json")
    assert turn.content == "I will call it." and [(c.name, c.arguments) for c in turn.calls] == [("f", {"a": 1})]
    turn = parse_tool_calls('[{"name": "f", "parameters": {}}, {"name": "g", "parameters": {"b": "x"}}]', "llama3_json")
    assert [(c.name, c.arguments) for c in turn.calls] == [("f", {}), ("g", {"b": "x"})] and not turn.errors
    turn = parse_tool_calls('{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {', "llama3_json")
    assert [c.name for c in turn.calls] == ["f"] and turn.errors[0].startswith("tool call 2: invalid JSON")
    assert parse_tool_calls('{"answer": 4}', "llama3_json").errors == ['tool call 1: no "name" (a non-empty string)']
    assert parse_tool_calls("The answer is 4.", "llama3_json").calls == []


def test_registry_names_families_and_sglang_parsers():
    assert tool_call_format("qwen25") is TOOL_CALL_FORMATS["hermes"]
    assert tool_call_format("llama3") is TOOL_CALL_FORMATS["llama3_json"]
    assert tool_call_format_for("qwen3") == tool_call_format_for("qwen2") == "hermes"
    assert tool_call_format_for("llama") == "llama3_json" and tool_call_format_for("mistral") is None
    with pytest.raises(ValueError, match="unknown tool-call format 'pythonic'; known: hermes"):
        parse_tool_calls("", "pythonic")


def test_openai_tool_calls_round_trip_and_name_the_bad_field():
    items = openai_tool_calls([ToolCall("f", {"a": [1, 2]}, id="call_9")])
    assert items == [{"id": "call_9", "type": "function", "function": {"name": "f", "arguments": '{"a": [1, 2]}'}}]
    back = tool_calls_from_openai(items)
    assert [(c.name, c.arguments, c.id) for c in back] == [("f", {"a": [1, 2]}, "call_9")]
    with pytest.raises(ValueError, match=r"messages\[2\].tool_calls\[0\].function.arguments: invalid JSON string"):
        tool_calls_from_openai([{"function": {"name": "f", "arguments": "{oops"}}], "messages[2].tool_calls")
