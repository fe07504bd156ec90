"""GPT-OSS's harmony tool calls (`data/tool_calls.py`): rendered as the released chat template renders
an assistant message with `tool_calls` (the strings below are that template's output, after the
generation prompt `<|start|>assistant`), parsed back, and read the way the model also writes them
(the recipient after the channel, a `<|constrain|>` token); malformed calls become errors."""

from __future__ import annotations

from mcore_rl.data.tool_calls import (
    TOOL_CALL_FORMATS,
    ToolCall,
    parse_tool_calls,
    render_tool_calls,
    tool_call_format,
    tool_call_format_for,
)

CALL = ToolCall("get_weather", {"city": "Zürich", "unit": "celsius"})
# The released template: the content as an analysis message, then the call to functions.<name> in
# the commentary channel, its arguments through `tojson`, ended by <|call|>.
TEMPLATE_WITH_CONTENT = (
    "<|channel|>analysis<|message|>Let me look that up.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    '{"city": "Zürich", "unit": "celsius"}<|call|>'
)


def test_harmony_renders_as_the_template_and_parses_back() -> None:
    assert render_tool_calls("Let me look that up.", [CALL], "harmony") == TEMPLATE_WITH_CONTENT
    turn = parse_tool_calls(TEMPLATE_WITH_CONTENT, "harmony")
    assert turn.content == "Let me look that up." and not turn.errors
    assert [(c.name, c.arguments, c.id) for c in turn.calls] == [("get_weather", CALL.arguments, "call_0")]
    assert turn.calls[0].raw == TEMPLATE_WITH_CONTENT[TEMPLATE_WITH_CONTENT.index("<|start|>") :]
    # no content: the call message right after the prompt's header
    alone = render_tool_calls("", [CALL], "harmony")
    assert (
        alone
        == ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Zürich", "unit": "celsius"}<|call|>'
    )
    assert [c.name for c in parse_tool_calls(alone, "harmony").calls] == ["get_weather"]
    # no calls: the final channel
    assert render_tool_calls("It is 21 C.", [], "harmony") == "<|channel|>final<|message|>It is 21 C.<|end|>"
    assert parse_tool_calls("<|channel|>final<|message|>It is 21 C.<|end|>", "harmony").content == "It is 21 C."


def test_harmony_reads_what_the_model_writes() -> None:
    """Reasoning, then the recipient after the channel with a constraint token; two calls in a row."""
    text = (
        "<|channel|>analysis<|message|>Need the weather twice.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
        "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>"
    )
    turn = parse_tool_calls(text, "harmony")
    assert not turn.errors and turn.content == "Need the weather twice."
    assert [(c.name, c.arguments) for c in turn.calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    # a final answer is the prose, reasoning is not
    answer = "<|channel|>analysis<|message|>easy<|end|><|start|>assistant<|channel|>final<|message|>42<|return|>"
    assert parse_tool_calls(answer, "harmony").content == "42"
    assert parse_tool_calls("plain text", "harmony").content == "plain text"


def test_harmony_malformed_calls_become_errors() -> None:
    cut = '<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Pa'
    turn = parse_tool_calls(cut, "harmony")
    assert turn.calls == [] and turn.errors == ["tool call 1: no closing <|call|> (the turn ended inside the call)"]
    bad = '<|channel|>commentary to=functions.get_weather json<|message|>{"city": }<|call|>'
    (error,) = parse_tool_calls(bad, "harmony").errors
    assert error.startswith("tool call 1: ") and "JSON" in error


def test_harmony_is_gpt_oss_format_and_sglang_parser() -> None:
    assert tool_call_format("gpt-oss") is TOOL_CALL_FORMATS["harmony"]
    assert tool_call_format_for("gpt_oss") == "harmony"
