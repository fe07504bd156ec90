"""Tool-call demonstrations for an SFT warm-up of a model that cannot call the tool at all.

SmolLM2-135M-Instruct never writes a `<tool_call>` block when the Python tool is described in its
system message (docs/real_model_agent.md), so RL has no tool use to reinforce. This writes a
prompt/response jsonl for `mcore-rl sft` from an environment domain of a recipe: for each of `--num`
training questions (drawn with `--seed`, checked disjoint from the recipe's held-out questions), two
examples, as the episode would render them with the model's chat template:

1. the opening messages -> `<tool_call>{"name": "python", "arguments": {"code": "print(<expr>)"}}</tool_call>`;
2. the same plus that call and the tool's real answer (the environment runs the call in its sandbox)
   -> `<answer><the tool's output></answer>`.

    .venv/bin/python tools/make_tool_demos.py configs/smollm2_tool_demos.yaml --out runs/tool_demos.jsonl
"""

from __future__ import annotations

import argparse
import json
import re

from mcore_rl.config.rl_schema import RLConfig

EXPRESSION = re.compile(r"[-+*/() 0-9]+[0-9)]")


def expression(question: str) -> str:
    """The arithmetic expression of a reasoning-gym arithmetic question (its longest run of digits,
    operators and spaces)."""
    found = max(EXPRESSION.findall(question), key=len, default="")
    if not any(op in found for op in "+-*/"):
        raise ValueError(f"no arithmetic expression in {question!r}")
    return found.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--out", required=True)
    ap.add_argument("--num", type=int, default=12, help="questions per environment domain")
    ap.add_argument("--seed", type=int, default=777)
    args = ap.parse_args()

    from mcore_rl.agent.groups import environment_examples  # lazy: the engine stack
    from mcore_rl.agent.trajectory import ChatFormat
    from mcore_rl.config import load_config
    from mcore_rl.data.prompts import build_prompt_sets
    from mcore_rl.data.samples import Prompt
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.data.tool_calls import ToolCall, parse_tool_calls, render_tool_calls
    from mcore_rl.envs import make_env
    from mcore_rl.envs.base import AgentAction

    cfg = load_config(RLConfig, args.config, [])
    tok = load_tokenizer(cfg.data.tokenizer_path)
    held_out = {p.text for p in build_prompt_sets(cfg, tok, environment_examples).eval_prompts}
    n = 0
    with open(args.out, "w", encoding="utf-8") as out:
        for d in cfg.data.domains:
            env_cfg = d.environment
            if env_cfg is None:
                continue
            examples = environment_examples(d, args.num * 2, args.seed)
            kept = [(q, e) for q, e in examples if q not in held_out][: args.num]
            for i, (question, entry) in enumerate(kept):
                env = make_env(env_cfg.name, **env_cfg.options)
                try:
                    reset = env.reset(Prompt(ids=[], text=question, label=entry, domain=d.name, index=i), seed=i)
                    chat = ChatFormat(tok, reset.tools)
                    call = ToolCall("python", {"code": f"print({expression(question)})"})
                    turn = render_tool_calls("", [call], env_cfg.tool_format)
                    step = env.step(AgentAction(turn, parse_tool_calls(turn, env_cfg.tool_format)))
                    result = str(step.messages[0].get("content") or "").strip()
                    if step.done or not result:
                        raise RuntimeError(f"{question!r}: the tool did not answer ({step.info})")
                finally:
                    env.close()
                first = chat.render(reset.messages, add_generation_prompt=True)
                conversation = [*reset.messages, {"role": "assistant", "content": turn}, *step.messages]
                second = chat.render(conversation, add_generation_prompt=True)
                end = chat.closing.rstrip("\n")
                out.write(json.dumps({"prompt": first, "response": turn + end}) + "\n")
                out.write(json.dumps({"prompt": second, "response": f"<answer>{result}</answer>{end}"}) + "\n")
                n += 2
    print(f"wrote {n} examples to {args.out}")


if __name__ == "__main__":
    main()
