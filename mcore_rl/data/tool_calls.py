"""Tool calls as plain data, and their text formats per model family.

A model asks for a tool in its family's own syntax (Qwen2.5/Qwen3 and Hermes: `<tool_call>{json}</tool_call>`;
Llama 3.x: a JSON object `{"name": ..., "parameters": ...}`). The agentic runtime, the OpenAI-compatible
server and the per-episode proxy all parse the same way, so what the trainer trains on is what a
served model would have been understood to say.
"""

from __future__ import annotations

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
