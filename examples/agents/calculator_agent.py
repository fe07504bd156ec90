"""A tool-using agent written against the `openai` client, as anyone writes one; nothing in it knows
the trainer.

It reads a question on stdin, asks the model with an `add` tool, runs every call the reply makes
locally, sends the results back, and prints the final answer (the first reply without calls) on
stdout. The client takes its endpoint from the environment (`OPENAI_BASE_URL`, `OPENAI_API_KEY`;
`OPENAI_MODEL` names the model). `mcore-rl train` runs it once per episode
(`data.domains[i].agent.command: [python, examples/agents/calculator_agent.py]`), gives each run
its episode's base URL, and scores what it prints with the domain's reward.

    OPENAI_BASE_URL=http://127.0.0.1:30000/v1 OPENAI_API_KEY=- python calculator_agent.py <<< "2+3?"
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]


def add(a: float, b: float) -> float:
    return a + b


def call_tool(name: str, arguments: str) -> str:
    """The tool's result as the message content; a bad call is answered with what was wrong."""
    try:
        args = json.loads(arguments)
        if name != "add":
            return f"error: no tool named {name!r}"
        return str(add(**args))
    except (ValueError, TypeError) as err:
        return f"error: {err}"


def run(client: OpenAI, model: str, question: str, max_turns: int = 4) -> tuple[str, list[dict[str, Any]]]:
    """The tool loop: the final answer and the conversation."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=96)
        msg = reply.choices[0].message
        if not msg.tool_calls:
            messages.append({"role": "assistant", "content": msg.content})
            return msg.content or "", messages
        function_calls = [c for c in msg.tool_calls if c.type == "function"]  # (no custom tools offered)
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in function_calls
        ]
        messages.append({"role": "assistant", "content": msg.content, "tool_calls": calls})
        for c in function_calls:
            result = call_tool(c.function.name, c.function.arguments)
            messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
    return "", messages


def main() -> None:
    question = sys.stdin.read().strip()
    answer, _ = run(OpenAI(max_retries=0), os.environ.get("OPENAI_MODEL", "policy"), question)
    print(answer)


if __name__ == "__main__":
    main()
