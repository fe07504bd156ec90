"""DeepSeek-V3's and Kimi-K2's tool-call formats (`deepseek_v3`, `deepseek_v31`, `kimi_k2`): what
their released chat templates write for an assistant message with tool calls is what the render
functions write, and the parsers read it back into the same calls.

The templates below are the assistant-with-tool-calls branches of the released chat templates
(DeepSeek-V3's `tokenizer_config.json`, DeepSeek-V3.1's, Kimi-K2-Instruct's), their tool-call lines
unchanged, rendered the way `transformers` renders chat templates.
"""

from __future__ import annotations

import json

import pytest

from mcore_rl.data.tool_calls import (
    ToolCall,
    parse_tool_calls,
    render_tool_calls,
    tool_call_format,
    tool_call_format_for,
)

DEEPSEEK_V3 = (
    "{% set ns = namespace(is_first=false) %}{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' and 'tool_calls' in message %}{%- for tool in message['tool_calls'] %}"
    "{%- if not ns.is_first %}{%- if message['content'] is none %}{{'<｜Assistant｜><｜tool▁calls▁begin｜>"
    "<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n'"
    " + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{%- else %}{{'<｜Assistant｜>' + "
    "message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
    "tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + "
    "'<｜tool▁call▁end｜>'}}{%- endif %}{%- set ns.is_first = true -%}{%- else %}{{'\\n' + '<｜tool▁call▁begin｜>' "
    "+ tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + "
    "tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endif %}{%- endfor %}"
    "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}"
)
DEEPSEEK_V31 = """{%- set ns = namespace(is_first=false) -%}
{%- for message in messages -%}
  {%- if message['role'] == 'assistant' and message['tool_calls'] -%}
    {%- for tool in message['tool_calls'] -%}
      {%- if not ns.is_first -%}
        {%- if not message['content'] -%}{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}
          {%- else -%}{{message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}
        {%- endif -%}
        {%- set ns.is_first = true -%}
        {%- else -%}{{'<｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}
      {%- endif -%}
    {%- endfor -%}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}
  {%- endif -%}
{%- endfor -%}"""
KIMI_K2 = """{%- for message in messages -%}
  {%- set role_name =  message.get('name') or  message['role'] -%}
  {%- if message['role'] == 'assistant' -%}
    <|im_assistant|>{{role_name}}<|im_middle|>
  {%- endif -%}
  {%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
    {%- if message['content'] -%}{{ message['content'] }}{%- endif -%}
    <|tool_calls_section_begin|>
    {%- for tool_call in message['tool_calls'] -%}
      {%- set formatted_id = tool_call['id'] -%}
      <|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>{% if tool_call['function']['arguments'] is string %}{{ tool_call['function']['arguments'] }}{% else %}{{ tool_call['function']['arguments'] | tojson }}{% endif %}<|tool_call_end|>
    {%- endfor -%}
    <|tool_calls_section_end|>
  {%- endif -%}
  <|im_end|>
{%- endfor -%}"""

CALLS = [
    ToolCall("get_weather", {"city": "北京", "days": 3, "units": {"temp": "C"}}),
    ToolCall("calculator", {"expression": "2 * (3 + 4)"}),
    ToolCall("now", {}),
]


def _template_text(template: str, content: str | None, calls: list[ToolCall], ids: list[str]) -> str:
    """The template's text of one assistant message (arguments as the OpenAI API sends them: a JSON
    string), as transformers renders it."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    tool_calls = [
        {
            "id": i,
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c, i in zip(calls, ids)
    ]
    message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
    return _compile_jinja_template(template).render(messages=[message])


@pytest.mark.parametrize("content", [None, "Let me check."])
@pytest.mark.parametrize(
    "fmt, template, header, end",
    [
        ("deepseek_v3", DEEPSEEK_V3, "<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
        ("deepseek_v31", DEEPSEEK_V31, "", "<｜end▁of▁sentence｜>"),
        ("kimi_k2", KIMI_K2, "<|im_assistant|>assistant<|im_middle|>", "<|im_end|>"),
    ],
)
def test_render_is_the_chat_template_and_parse_inverts_it(fmt, template, header, end, content) -> None:
    ids = [f"functions.{c.name}:{i}" for i, c in enumerate(CALLS)]  # Kimi's ids; the others drop them
    text = render_tool_calls(content or "", CALLS, fmt)
    assert header + text + end == _template_text(template, content, CALLS, ids)
    turn = parse_tool_calls(text, fmt)
    assert turn.content == (content or "") and not turn.errors
    assert [(c.name, c.arguments) for c in turn.calls] == [(c.name, c.arguments) for c in CALLS]
    assert "".join(c.raw for c in turn.calls) in text.replace("\n<｜tool▁call▁begin｜>", "<｜tool▁call▁begin｜>")
    if fmt == "kimi_k2":  # a call keeps the model's id (a tool message answers `## Return of <id>`)
        assert [c.id for c in turn.calls] == ids
        assert render_tool_calls(content or "", turn.calls, fmt) == text
    else:
        assert [c.id for c in turn.calls] == ["call_0", "call_1", "call_2"]


def test_the_deepseek_parser_reads_both_generations_and_kimi_ids_name_the_function() -> None:
    v31 = render_tool_calls("", CALLS[:1], "deepseek_v31")
    assert [c.arguments for c in parse_tool_calls(v31, "deepseek_v3").calls] == [CALLS[0].arguments]
    # Kimi-K2: the harness's own ids become Kimi's form, so the model still reads the function's name
    text = render_tool_calls(
        "", [ToolCall("now", {}, id="call_abc"), ToolCall("calc", {"x": 1}, id="call_d")], "kimi_k2"
    )
    assert "<|tool_call_begin|>functions.now:0<|tool_call_argument_begin|>{}" in text
    assert "<|tool_call_begin|>functions.calc:1<|tool_call_argument_begin|>" in text


@pytest.mark.parametrize(
    "fmt, text, errors",
    [
        (
            "deepseek_v3",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>ok\n```json\n{}\n```<｜tool▁call▁end｜>"
            '<｜tool▁call▁begin｜>function<｜tool▁sep｜>bad\n```json\n{"x": }\n```<｜tool▁call▁end｜>'
            "<｜tool▁call▁begin｜>no separator<｜tool▁call▁end｜>"
            '<｜tool▁call▁begin｜>function<｜tool▁sep｜>cut\n```json\n{"x": 1}',
            [
                "tool call 2: invalid JSON: Expecting value at column 7",
                "tool call 3: no <｜tool▁sep｜> between the call's type and its function name",
                "tool call 4: no closing <｜tool▁call▁end｜> (the turn ended inside the call)",
            ],
        ),
        (
            "kimi_k2",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.ok:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
            "<|tool_call_begin|>functions.a b:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
            "<|tool_call_begin|>functions.f:2{}<|tool_call_end|>"
            "<|tool_call_begin|>functions.g:3<|tool_call_argument_begin|>[1]<|tool_call_end|>"
            "<|tool_call_begin|>functions.cut:4<|tool_call_argument_begin|>{",
            [
                "tool call 2: call id 'functions.a b:1' is not functions.<name>:<index>",
                "tool call 3: no <|tool_call_argument_begin|> after the call's id",
                "tool call 4: arguments: expected an object, got list",
                "tool call 5: no closing <|tool_call_end|> (the turn ended inside the call)",
            ],
        ),
        (
            "kimi_k2",
            "Sure.<|tool_calls_section_begin|><|tool_calls_section_end|>",
            ["tool call 1: no <|tool_call_begin|> after <|tool_calls_section_begin|>"],
        ),
    ],
)
def test_malformed_calls_are_errors_naming_the_call(fmt, text, errors) -> None:
    turn = parse_tool_calls(text, fmt)
    assert turn.errors == errors
    assert [c.name for c in turn.calls] == (["ok"] if len(errors) > 1 else [])
    assert parse_tool_calls("no call here", fmt).content == "no call here"


def test_the_families_and_templates_name_the_formats() -> None:
    from mcore_rl.config.rl_environment import template_tool_format

    assert tool_call_format_for("deepseek_v3") == "deepseek_v3" and tool_call_format_for("kimi_k2") == "kimi_k2"
    assert (
        tool_call_format("deepseekv3").name == "deepseek_v3" and tool_call_format("deepseekv31").name == "deepseek_v31"
    )
    assert tool_call_format("kimi_k2").sglang_parser == "kimi_k2"
    # the config check reads the format from the chat template, which tells V3 from V3.1
    assert [template_tool_format(t)[0] for t in (DEEPSEEK_V3, DEEPSEEK_V31, KIMI_K2)] == [
        "deepseek_v3",
        "deepseek_v31",
        "kimi_k2",
    ]
    # GPT-OSS's template writes harmony channels (before this, only its model_type named the format)
    harmony = "{{- '<|start|>assistant to=functions.' + name + '<|channel|>commentary json<|message|>' }}"
    assert template_tool_format(harmony)[0] == "harmony"
