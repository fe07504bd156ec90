"""The shipped example agent as a training test runs it, with a transcript and chosen misbehaviour.

Run by `mcore-rl train` as an agent program (`data.domains[i].agent.command`), it runs
`examples/agents/calculator_agent.py`'s loop unchanged and writes the conversation it had to
`$TRANSCRIPT_DIR/<prompt index>-<episode>.json` (held-out prompts: `eval<index>-<episode>.json`), so the test can compare the trained samples with what
the agent saw. `$MISBEHAVE` (e.g. `0-1:crash,0-2:silent`) makes chosen episodes of chosen prompts
(`<prompt index>-<episode>`, read from the episode's base URL) misbehave after their first completion:
`crash` exits with status 3, `silent` exits 0 having printed nothing, `greedy` keeps asking (past
`max_completions`).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from openai import OpenAI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "agents"))
from calculator_agent import TOOLS, run  # the example is a script, not a package (its folder is put on sys.path)


def main() -> None:
    question = sys.stdin.read().strip()
    episode_id = os.environ["OPENAI_BASE_URL"].rstrip("/").split("/")[-2]  # .../episodes/<id>/v1
    _, index, j, _ = episode_id.rsplit("-", 3)
    key = f"{index}-{j}"
    plan = dict(item.split(":") for item in os.environ.get("MISBEHAVE", "").split(",") if item)
    client, model = OpenAI(max_retries=0), os.environ.get("OPENAI_MODEL", "policy")
    if key in plan:
        messages: Any = [{"role": "user", "content": question}]  # (the client's TypedDicts, as plain dicts)
        tools: Any = TOOLS
        client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=8)
        if plan[key] == "crash":
            sys.exit(3)
        if plan[key] == "silent":
            return
        for _ in range(100):  # greedy: more completions than any episode is allowed
            client.chat.completions.create(model=model, messages=messages, tools=tools, max_tokens=1)
        return
    answer, messages = run(client, model, question)
    with open(os.path.join(os.environ["TRANSCRIPT_DIR"], f"{key}.json"), "w") as f:
        json.dump(messages, f)
    print(answer)


if __name__ == "__main__":
    main()
