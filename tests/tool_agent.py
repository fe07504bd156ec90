"""A tiny model that has learned one tool-using conversation, and the agent that has it.

The built-in demo model (2 layers, byte tokenizer) is trained for a few seconds on the two replies of
a conversation with an `add` tool, as `mcore-rl serve` renders it (ChatML; tools in the system
message; calls in the hermes format): first a tool call, then, after the tool's result, the answer.
Served greedily it makes a real tool call, so the `openai` client's tool loop runs end to end.
`agent` is that loop as anyone writes it against the `openai` package; nothing in it knows the trainer.
"""

from __future__ import annotations

import json

import torch

from mcore_rl.data.tokenizer import load_tokenizer
from mcore_rl.rollout.openai_api import chat_prompt, chat_tools

ADD_TOOL = {"type": "function", "function": {"name": "add"}}
QUESTION = "2+3?"
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER = "It is 5."


def conversation_replies(
    tools: list[dict] | None = None, question: str = QUESTION, answer: str = ANSWER
) -> list[tuple[str, str]]:
    """(prompt text, reply text) of the two model turns the agent's conversation has (`tools`: the
    agent's tool list, default [ADD_TOOL])."""
    tok = load_tokenizer(None)
    rendered = chat_tools({"tools": tools or [ADD_TOOL]}, "hermes")
    user = [{"role": "user", "content": question}]
    call_msg = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
        ],
    }
    tool_msg = {"role": "tool", "tool_call_id": "call_1", "content": "5"}
    first = chat_prompt(user, tok, tools=rendered, tool_format="hermes")
    second = chat_prompt(user + [call_msg, tool_msg], tok, tools=rendered, tool_format="hermes")
    return [(first, CALL), (second, answer)]


def train_tool_model(steps: int = 150, seed: int = 0, tools: list[dict] | None = None, answer: str = ANSWER):
    """The demo model after learning the conversation's two replies (greedy decoding reproduces them).

    One sequence holds both: the second prompt begins with the first prompt and the first reply, so
    the loss is on the two replies (and their `<|im_end|>`) in one forward pass."""
    from mcore_rl.config.schema import ModelConfig
    from mcore_rl.hf import Qwen3ReferenceForCausalLM, hf_config_from_model_config

    tok = load_tokenizer(None)
    end = tok.token_to_id("<|im_end|>")  # type: ignore[attr-defined]  # the byte tokenizer names it
    (first, call), (second, answer) = conversation_replies(tools, answer=answer)
    assert second.startswith(first + call + "<|im_end|>")
    ids = torch.tensor(tok.encode(second + answer) + [end])
    labels = torch.full_like(ids, -100)
    for start, text in ((len(tok.encode(first)), call), (len(tok.encode(second)), answer)):
        n = len(tok.encode(text)) + 1  # the reply and its <|im_end|>
        labels[start : start + n] = ids[start : start + n]
    torch.manual_seed(seed)
    model = Qwen3ReferenceForCausalLM(hf_config_from_model_config(ModelConfig()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 200-token sequence: more threads only wait on each other (worse on a busy machine)
    try:
        for _ in range(steps):
            logits = model(input_ids=ids[None]).logits[0, :-1]
            loss = torch.nn.functional.cross_entropy(logits, labels[1:], ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if loss.item() < 1e-3:
                break
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def save_tool_model(directory: str, steps: int = 150, tools: list[dict] | None = None, answer: str = ANSWER) -> str:
    """The trained model as an HF directory `mcore-rl serve --model-path` reads (with the byte tokenizer)."""
    model = train_tool_model(steps, tools=tools, answer=answer)
    model.save_pretrained(directory, safe_serialization=True)
    load_tokenizer(None).save(directory)  # type: ignore[attr-defined]  # the byte tokenizer saves itself
    return directory


def add(a: int, b: int) -> int:
    return a + b


def agent(client, model: str, question: str = QUESTION, max_turns: int = 4) -> tuple[str, list[dict]]:
    """A plain `openai` tool loop: ask, run every tool call the reply makes, answer it, until a reply
    without calls. Returns the final answer and the conversation."""
    messages: list[dict] = [{"role": "user", "content": question}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=[ADD_TOOL], temperature=0.0, max_tokens=96
        )
        msg = reply.choices[0].message
        if not msg.tool_calls:
            messages.append({"role": "assistant", "content": msg.content})
            return msg.content or "", messages
        messages.append(
            {
                "role": "assistant",
                "content": msg.content,
                "tool_calls": [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": c.function.arguments},
                    }
                    for c in msg.tool_calls
                ],
            }
        )
        for c in msg.tool_calls:
            result = add(**json.loads(c.function.arguments))
            messages.append({"role": "tool", "tool_call_id": c.id, "content": str(result)})
    return "", messages


if __name__ == "__main__":  # a quick look: how long the training takes, whether greedy reproduces
    import time

    t = time.time()
    trained = train_tool_model()
    print(f"trained in {time.time() - t:.1f} s")
    tok = load_tokenizer(None)
    for prompt, reply in conversation_replies():
        ids = tok.encode(prompt)
        for _ in range(len(tok.encode(reply)) + 1):
            ids.append(int(trained(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        print(repr(tok.decode(ids[len(tok.encode(prompt)) :])))
