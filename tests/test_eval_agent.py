"""`tools/eval_agent.py` and its pieces: the tool-free mode of an environment domain, the counting
of tool calls and invalid calls over real episodes of `reasoning_tools` (the real calculator, the
real hermes parser), the whole command on a tiny HF model, and `reasoning_tools`' system prompt."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from collections.abc import Sequence

import pytest

from tests.helpers import save_tiny_hf_model

from mcore_rl.config.rl_schema import DomainConfig, EnvironmentConfig, RLConfig
from mcore_rl.data.tokenizer import load_tokenizer
from mcore_rl.rollout.pool import Generation, GenRequest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS, f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def recipe(n: int) -> RLConfig:
    cfg = RLConfig()
    env = EnvironmentConfig(
        name="reasoning_tools",
        options={
            "dataset": "products",
            "dataset_options": {"min_digits": 2, "max_digits": 2},
            "tools": ["calculator"],
            "system_prompt": "Tools:\n{tools}",
        },
        tool_format="hermes",
        max_turns=3,
        max_tokens_per_turn=96,
    )
    cfg.data.domains = [DomainConfig(name="products", environment=env, max_new_tokens=1000)]
    cfg.data.domains[0].eval.num_prompts = n
    cfg.rollout.max_new_tokens = 1000
    cfg.train.seq_length = 2048
    return cfg


class ScriptedPolicy:
    """Stands in for the model (the environment, parser and episodes are real): on even questions it
    calls the calculator on the question's product and answers with the tool's result; on odd ones it
    first sends a call that is not JSON, then answers 0 (wrong)."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.demos = _module("make_tool_demos")

    def generate(self, requests: Sequence[GenRequest]) -> list[Generation]:
        out = []
        for r in requests:
            text = self.tok.decode(r.input_ids)
            question = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
            odd = int(question.split("*")[0].split()[-1]) % 2 == 1
            turn = text.count("<|im_start|>assistant\n") - 1  # the model turns so far
            tool = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", text, re.S)
            if turn < (2 if odd else 1):
                call = {"name": "calculator", "arguments": {"expression": self.demos.expression(question)}}
                reply = (
                    "<tool_call>{not json</tool_call>"
                    if odd and turn == 0
                    else f"<tool_call>{json.dumps(call)}</tool_call>"
                )
            else:
                reply = f"<answer>{'0' if odd else tool[-1].strip()}</answer>"
            ids = self.tok.encode(reply + "<|im_end|>")
            out.append(Generation(ids, [0.0] * len(ids), 0, "stop", reply, "scripted"))
        return out


def test_tool_calls_invalid_calls_and_accuracy_are_counted_per_episode():
    tool = _module("eval_agent")
    from mcore_rl.agent.groups import environment_examples
    from mcore_rl.data.prompts import build_prompt_sets

    cfg = recipe(6)
    tok = load_tokenizer(None)
    prompts = build_prompt_sets(cfg, tok, environment_examples).eval_prompts
    odd = [int(p.text.split("*")[0].split()[-1]) % 2 == 1 for p in prompts]
    r = tool.run_mode(cfg, ScriptedPolicy(tok), tok, prompts, show=1)["products"]
    assert r.correct == [not o for o in odd]  # the calculator's product is the answer
    assert r.invalid == odd and all(r.called)  # odd: one invalid call, then a valid one
    assert r.turns == [3 if o else 2 for o in odd]
    assert "<tool_call>" in r.shown[0] and len(r.shown) == 1
    row = r.row()
    assert row["accuracy"] == 1 - sum(odd) / 6 and row["tool_call_rate"] == 1.0

    plain = tool.mode_config(cfg, "plain").data.domains[0].environment
    assert plain.tool_format == "none" and plain.options["tools"] == [] and "system_prompt" not in plain.options
    assert cfg.data.domains[0].environment.tool_format == "hermes"  # the recipe itself is untouched
    p = tool.run_mode(tool.mode_config(cfg, "plain"), ScriptedPolicy(tok), tok, prompts, show=0)["products"]
    assert not any(p.called) and not any(p.correct) and p.turns == [1] * 6  # a call is just text: the answer


def test_the_system_prompt_names_the_offered_tools():
    from mcore_rl.data.samples import Prompt
    from mcore_rl.envs import make_env
    from mcore_rl.envs.reasoning_tools import SYSTEM, SYSTEM_NO_TOOLS

    def system(**options) -> str:
        env = make_env("reasoning_tools", dataset="products", **options)
        entry = {"question": "1 * 2", "answer": "2", "metadata": {}}
        try:
            return env.reset(Prompt(0, "1 * 2", [], entry), 0).messages[0]["content"]
        finally:
            env.close()

    assert system(tools=["calculator"]) == SYSTEM and system(tools=[]) == SYSTEM_NO_TOOLS
    text = system(tools=["calculator"], system_prompt="Use: {tools}.")
    assert text.startswith('Use: {"name": "calculator", "description": ') and text.endswith("}}.")
    assert json.loads(text[5:-1])["parameters"]["required"] == ["expression"]


@pytest.fixture(scope="module")
def tiny_hf_model(tmp_path_factory):
    """An HF-format directory of a 2-layer model with the byte tokenizer's vocabulary."""
    return save_tiny_hf_model(str(tmp_path_factory.mktemp("hf_model")), max_position_embeddings=1024)


def test_the_command_scores_both_modes_of_a_checkpoint(tiny_hf_model, tmp_path, capsys):
    recipe_path = tmp_path / "r.yaml"
    env = recipe(1).data.domains[0].environment
    recipe_path.write_text(
        "data:\n  domains:\n    - name: products\n"
        f"      environment: {json.dumps({'name': env.name, 'options': env.options, 'tool_format': 'hermes'})}\n"
        "      eval: {num_prompts: 3}\n"
        "rollout: {max_new_tokens: 48, context_length: 1024}\ntrain: {seq_length: 1024}\n"
        "model: {max_position_embeddings: 1024}\n"
    )
    out = tmp_path / "figures.json"
    _module("eval_agent").main(
        [str(recipe_path), "--models", f"tiny={tiny_hf_model}", "--json", str(out)]
        + ["data.domains[0].environment.max_tokens_per_turn=8"]
    )
    figures = json.loads(out.read_text())
    assert set(figures["tiny"]) == {"tool", "plain"}
    for mode in ("tool", "plain"):
        row = figures["tiny"][mode]["products"]
        assert row["n"] == 3 and 0 <= row["accuracy"] <= 1 and 1 <= row["turns_mean"] <= 3
    assert figures["tiny"]["plain"]["products"]["tool_call_rate"] == 0
    printed = capsys.readouterr().out
    assert "tiny     tool  products" in printed and "tiny     plain products" in printed
