"""GLM-4.5's tool-call format (`glm45`): what its chat template writes for an assistant message with
tool calls is what `render_glm45` writes, and `parse_glm45` reads it back into the same calls.

The template below is the assistant branch of GLM-4.5's released chat template (its tool-call
lines unchanged), rendered the way `transformers` renders chat templates.
"""

from __future__ import annotations

import pytest

from mcore_rl.data.tool_calls import (
    ToolCall,
    openai_tool_calls,
    parse_tool_calls,
    render_tool_calls,
    tool_call_format,
    tool_call_format_for,
)

ASSISTANT_BRANCH = """{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
<|assistant|>
{%- set content = m.content -%}
{{ '\\n<think></think>' }}
{%- if content.strip() -%}
{{ '\\n' + content.strip() }}
{%- endif -%}
{% if m.tool_calls %}
{% for tc in m.tool_calls %}
{%- if tc.function %}
    {%- set tc = tc.function %}
{%- endif %}
{{ '\\n<tool_call>' + tc.name }}
{% set _args = tc.arguments %}
{% for k, v in _args.items() %}
<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>
{% endfor %}
</tool_call>{% endfor %}
{% endif %}
{%- endif -%}
{%- endfor -%}"""

CALLS = [
    ToolCall("get_weather", {"city": "北京", "days": 3, "units": {"temp": "C"}, "hourly": False}),
    ToolCall("calculator", {"expression": "2 * (3 + 4)"}),
    ToolCall("now", {}),
]


def _template_text(content: str, calls: list[ToolCall]) -> str:
    """The released template's text of one assistant message, as transformers renders it."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    template = _compile_jinja_template(ASSISTANT_BRANCH)
    tool_calls = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return template.render(messages=[{"role": "assistant", "content": content, "tool_calls": tool_calls}])


@pytest.mark.parametrize("content", ["", "  Let me check.\n"])
def test_render_is_the_chat_template_and_parse_inverts_it(content: str) -> None:
    header = "<|assistant|>\n<think></think>"
    text = render_tool_calls(content, CALLS, "glm45")
    assert header + text == _template_text(content, CALLS)
    assert text.count("<tool_call>") == 3 and '<arg_value>{"temp": "C"}</arg_value>' in text
    turn = parse_tool_calls(text, "glm45")
    assert turn.content == content.strip() and not turn.errors
    assert [(c.name, c.arguments, c.id) for c in turn.calls] == [
        (c.name, c.arguments, f"call_{i}") for i, c in enumerate(CALLS)
    ]
    assert openai_tool_calls(turn.calls)[1]["function"]["arguments"] == '{"expression": "2 * (3 + 4)"}'


def test_malformed_calls_are_errors_naming_the_call() -> None:
    text = (
        "<tool_call>ok\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>"
        "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"
        "<tool_call>f\n<arg_key>a</arg_key>\n</tool_call>"
        "<tool_call>cut\n<arg_key>a</arg_key>"
    )
    turn = parse_tool_calls(text, "glm45")
    assert [c.name for c in turn.calls] == ["ok"] and turn.calls[0].arguments == {"a": 1}
    assert turn.errors == [
        "tool call 2: no function name after <tool_call>",
        "tool call 3: argument 1: expected <arg_key>k</arg_key> then <arg_value>v</arg_value>",
        "tool call 4: no closing </tool_call> (the turn ended inside the call)",
    ]
    assert parse_tool_calls("no call here", "glm45").content == "no call here"


def test_the_format_is_glm4_moe_s_sglang_s_glm45_and_its_template_s() -> None:
    from mcore_rl.config.rl_environment import template_tool_format

    assert tool_call_format_for("glm4_moe") == "glm45"
    assert tool_call_format("glm45").sglang_parser == "glm45"
    # the config check reads the format from the template: its <tool_call> blocks are not hermes'
    assert template_tool_format(ASSISTANT_BRANCH)[0] == "glm45"
