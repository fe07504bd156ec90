"""The tool-call format rule of an environment domain reads the model's chat template first: SmolLM2
is a `llama` by `model_type` but chats in ChatML, so its format is hermes, not llama3_json."""

from __future__ import annotations

import json
import os

import pytest

from mcore_rl.config.rl_environment import check_tool_format, template_tool_format
from mcore_rl.config.rl_schema import DomainConfig, EnvironmentConfig, RLConfig
from mcore_rl.config.rules import Errors

TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates")


def template(name: str) -> str:
    with open(os.path.join(TEMPLATES, name), encoding="utf-8") as f:
        return f.read()


def tokenizer_dir(tmp_path, model_type: str, chat_template: str | None, as_file: bool = False) -> str:
    """A tokenizer folder as a converted checkpoint has it: config.json and the template."""
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": model_type}, f)
    config = {} if chat_template is None or as_file else {"chat_template": chat_template}
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump(config, f)
    if as_file and chat_template is not None:
        (tmp_path / "chat_template.jinja").write_text(chat_template)
    return str(tmp_path)


def problems(path: str, fmt: str) -> list[str]:
    cfg = RLConfig()
    cfg.data.tokenizer_path = path
    env = EnvironmentConfig(name="reasoning_tools", tool_format=fmt)
    cfg.data.domains = [DomainConfig(name="d", environment=env)]
    errors = Errors()
    check_tool_format(cfg, "data.domains[0].environment", "domain 'd': ", env.tool_format, errors)
    return list(errors.lines)


def test_each_real_template_names_its_format():
    assert template_tool_format(template("qwen2_5_instruct.jinja"))[0] == "hermes"
    assert template_tool_format(template("llama3_1_json.jinja"))[0] == "llama3_json"
    assert template_tool_format(template("smollm2_instruct.jinja"))[0] == "hermes"  # ChatML
    assert template_tool_format("{{ messages[0]['content'] }}") is None


@pytest.mark.parametrize("as_file", [False, True])
def test_a_llama_with_a_chatml_template_speaks_hermes(tmp_path, as_file):
    path = tokenizer_dir(tmp_path, "llama", template("smollm2_instruct.jinja"), as_file)
    assert problems(path, "hermes") == []
    (msg,) = problems(path, "llama3_json")
    assert msg.startswith("data.domains[0].environment.tool_format: domain 'd': 'llama3_json' is not the tool-call")
    assert "ChatML" in msg and "(its format: 'hermes')" in msg


def test_a_llama_3_template_keeps_llama3_json_and_no_template_falls_back_to_the_family(tmp_path):
    path = tokenizer_dir(tmp_path, "llama", template("llama3_1_json.jinja"))
    assert problems(path, "llama3_json") == []
    assert "(its format: 'llama3_json')" in problems(path, "hermes")[0]
    path = tokenizer_dir(tmp_path, "llama", None)
    assert problems(path, "llama3_json") == []
    assert "model_type 'llama'" in problems(path, "hermes")[0]
