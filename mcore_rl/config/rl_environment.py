"""Rules of `data.domains[i].environment` (a multi-turn domain), checked with the rest of the RL config
before any worker starts; every message names the dotted key.

The environment must be registered (`mcore_rl.envs`, imported lazily as the other registries are) and
accept its options; its tool-call format must be the one the model's chat template speaks. The
template decides, not the architecture: SmolLM2 is a `llama` by `model_type` but chats in ChatML and
was tuned on `<tool_call>` blocks, never on Llama 3's `<|python_tag|>` / `ipython` turns. So, in order:
a chat template that writes tool calls (`<arg_key>` pairs in `<tool_call>`: glm45; `<tool_call>`: hermes;
`<|python_tag|>` or an `ipython` turn: llama3_json); else a ChatML template (`<|im_start|>`), whose tool layout is Hermes'; else, with no
template to read, the family of the `config.json` `model_type` next to `data.tokenizer_path`. The
bundled byte tokenizer has no chat template of its own and is rendered as ChatML.
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING

from mcore_rl.config.rules import Errors, need_registered

if TYPE_CHECKING:
    from mcore_rl.config.rl_schema import AnalyzerConfig, DomainConfig, RLConfig, SkillsConfig

# the tool-call format of the byte tokenizer's ChatML rendering
BYTE_TOKENIZER_FORMAT = "hermes"


def check_environment(cfg: RLConfig, i: int, dom: DomainConfig, errors: Errors) -> None:
    """The environment's name, options, guards and tool-call format."""
    env = dom.environment
    if env is None:
        return
    key, who = f"data.domains[{i}].environment", f"domain {dom.name!r}: "
    from mcore_rl.envs import env_names, env_options

    if need_registered(errors, f"{key}.name", "environment", env.name, env_names(), f" ({who.rstrip(': ')})"):
        try:
            env_options(env.name, **env.options)
        except ValueError as err:
            errors.need(False, f"{key}.options", f"{who}{err}")
    for name in ("max_turns", "max_tokens_per_turn", "max_invalid_calls"):
        value = getattr(env, name)
        errors.need(value >= 1, f"{key}.{name}", f"{who}must be >= 1, got {value}")
    errors.need(
        math.isfinite(env.invalid_penalty) and env.invalid_penalty >= 0,
        f"{key}.invalid_penalty",
        f"{who}must be a finite number >= 0, got {env.invalid_penalty}",
    )
    errors.need(env.memory_k >= 0, f"{key}.memory_k", f"{who}must be >= 0, got {env.memory_k}")
    errors.need(env.step_timeout_s > 0, f"{key}.step_timeout_s", f"{who}must be > 0, got {env.step_timeout_s}")
    errors.need(
        env.max_observation_chars >= 64,
        f"{key}.max_observation_chars",
        f"{who}must be >= 64, got {env.max_observation_chars}",
    )
    budget = dom.max_new_tokens or cfg.rollout.max_new_tokens
    errors.need(
        env.max_tokens_per_turn <= budget,
        f"{key}.max_tokens_per_turn",
        f"{who}{env.max_tokens_per_turn} is more than the episode's whole budget "
        f"(data.domains[{i}].max_new_tokens or rollout.max_new_tokens = {budget})",
    )
    errors.need(
        not dom.rewards,
        f"data.domains[{i}].rewards",
        f"{who}an environment domain is scored by its environment (the episode's return); list no reward heads",
    )
    errors.need(
        dom.template is None and not dom.chat_template,
        f"data.domains[{i}].template",
        f"{who}an environment's messages are rendered with the model's chat template; no prompt template",
    )
    check_tool_format(cfg, key, who, env.tool_format, errors)
    if env.skills is not None:
        check_skills(env.skills, f"{key}.skills", who, errors)
    tags = env.distill_span_tags
    errors.need(
        not tags or (len(tags) == 2 and all(isinstance(t, str) and t for t in tags)),
        f"{key}.distill_span_tags",
        f"{who}must be [] or two non-empty strings [open, close], got {tags!r}",
    )
    errors.need(
        not tags or bool(cfg.distill.losses),
        f"{key}.distill_span_tags",
        f"{who}marks the tokens distillation acts on, but distill.losses names no distillation term",
    )
    if env.analyzer is not None:
        check_analyzer(env.analyzer, f"{key}.analyzer", who, errors)
        context = cfg.model.max_position_embeddings
        errors.need(
            env.analyzer.max_new_tokens < context,
            f"{key}.analyzer.max_new_tokens",
            f"{who}{env.analyzer.max_new_tokens} leaves no room for the transcript in the engine's context "
            f"(model.max_position_embeddings = {context})",
        )


def check_analyzer(analyzer: AnalyzerConfig, key: str, who: str, errors: Errors) -> None:
    """SEED's analyzer: a lesson budget, a temperature and a transcript cap in range."""
    errors.need(
        analyzer.max_new_tokens >= 1, f"{key}.max_new_tokens", f"{who}must be >= 1, got {analyzer.max_new_tokens}"
    )
    errors.need(
        math.isfinite(analyzer.temperature) and analyzer.temperature >= 0,
        f"{key}.temperature",
        f"{who}must be a finite number >= 0, got {analyzer.temperature}",
    )
    errors.need(
        analyzer.max_transcript_chars >= 64,
        f"{key}.max_transcript_chars",
        f"{who}must be >= 64, got {analyzer.max_transcript_chars}",
    )


def check_skills(skills: SkillsConfig, key: str, who: str, errors: Errors) -> None:
    """The library file exists and every line is a skill (naming `file:line`); k and c in range."""
    from mcore_rl.envs.skills import SkillLibrary

    errors.need(skills.k >= 1, f"{key}.k", f"{who}must be >= 1, got {skills.k}")
    errors.need(
        math.isfinite(skills.ucb_c) and skills.ucb_c >= 0, f"{key}.ucb_c", f"{who}must be >= 0, got {skills.ucb_c}"
    )
    if not skills.path or not os.path.isfile(skills.path):
        errors.need(False, f"{key}.path", f"{who}{skills.path!r} is not a file (a skill library, one skill a line)")
        return
    try:
        library = SkillLibrary.load(skills.path)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        errors.need(False, f"{key}.path", f"{who}{err}")
        return
    errors.need(bool(library.skills), f"{key}.path", f"{who}{skills.path} holds no skill")


def check_privileged_teachers(cfg: RLConfig, errors: Errors) -> None:
    """A privileged teacher reading `Sample.info["privileged/<name>"]` (`context: info`) is routed only
    to environment domains whose environment gives that name (`register_env(privileged=...)`): any
    other sample would have no context and train nothing from the teacher."""
    from mcore_rl.envs import PRIVILEGED, env_entry, env_names
    from mcore_rl.envs.skills import HINDSIGHT, SKILLS

    claimed = {d for t in cfg.teachers for d in t.domains}
    for i, t in enumerate(cfg.teachers):
        if t.kind != "privileged" or t.context != "info" or not t.context_key.startswith(PRIVILEGED):
            continue
        key, name = f"teachers[{i}].context_key", t.context_key[len(PRIVILEGED) :]
        routed = [d for d in cfg.data.domains if (d.name in t.domains if t.domains else d.name not in claimed)]
        errors.need(
            bool(routed), key, f"{t.context_key!r} comes from an environment; no environment domain is routed here"
        )
        for dom in routed:
            env = dom.environment
            if env is None:
                errors.need(False, key, f"domain {dom.name!r} has no environment to give {t.context_key!r}")
            elif env.name in env_names():
                gives = tuple(env_entry(env.name).privileged)
                if env.skills is not None and env.skills.into == "privileged":
                    gives += (SKILLS,)
                if env.analyzer is not None:
                    gives += (HINDSIGHT,)
                errors.need(
                    name in gives,
                    key,
                    f"environment {env.name!r} (domain {dom.name!r}) gives no {t.context_key!r}; it gives: "
                    + (", ".join(PRIVILEGED + g for g in gives) or "none"),
                )


def check_tool_format(cfg: RLConfig, key: str, who: str, tool_format: str, errors: Errors) -> None:
    """A known format, and the model family's own (`none` always fits); `key`: the section holding it."""
    from mcore_rl.data.tool_calls import TOOL_CALL_FORMATS, tool_call_format_for

    if tool_format == "none":
        return
    names = sorted(TOOL_CALL_FORMATS)
    if not need_registered(errors, f"{key}.tool_format", "tool-call format", tool_format, ["none", *names]):
        return
    path = cfg.data.tokenizer_path
    if path is None:
        family, want = "the bundled byte tokenizer (ChatML)", BYTE_TOKENIZER_FORMAT
    else:
        template = _chat_template(path)
        by_template = template_tool_format(template) if template is not None else None
        model_type = _model_type(path)
        if by_template is not None:
            family, want = f"the chat template of {path!r}{by_template[1]}", by_template[0]
        elif model_type is None:
            return  # no template nor config.json to tell the family: the format is the recipe's word
        else:
            family, want = f"model_type {model_type!r}", tool_call_format_for(model_type) or ""
    errors.need(
        tool_format == want,
        f"{key}.tool_format",
        f"{who}{tool_format!r} is not the tool-call format of {family}"
        + (f" (its format: {want!r})" if want else " (no known tool-call format)"),
    )


def template_tool_format(template: str) -> tuple[str, str] | None:
    """(format, why) a chat template speaks, or None when it says nothing of tools: a template that
    writes calls names its format; a ChatML one that does not is Hermes' layout (the one built on it)."""
    from mcore_rl.data.tool_calls import (
        ARG_PAIRS_FORMAT,
        TOOL_CALL_FORMATS,
    )  # here, as above: loading config needs no data package

    for fmt in TOOL_CALL_FORMATS.values():  # a format that says what its templates hold
        if fmt.template_markers and all(m in template for m in fmt.template_markers):
            return fmt.name, f" (it writes {' and '.join(fmt.template_markers)})"
    if "<arg_key>" in template:  # GLM-4.5: <tool_call>name, then key/value pairs (not JSON)
        return ARG_PAIRS_FORMAT, " (it writes <tool_call> blocks of <arg_key>/<arg_value> pairs)"
    if "<tool_call>" in template:
        return "hermes", " (it writes <tool_call> blocks)"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json", " (it writes <|python_tag|> / ipython turns)"
    if "<|im_start|>" in template:
        return "hermes", " (ChatML, whose tool-call layout is Hermes')"
    return None


def _chat_template(path: str) -> str | None:
    """The tokenizer's default chat template (`chat_template.jinja`, else `tokenizer_config.json`'s
    `chat_template`: a string, or a list of named ones), if it has one."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        with open(os.path.join(folder, "chat_template.jinja"), encoding="utf-8") as f:
            return f.read()
    except OSError:
        pass
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            value = json.load(f).get("chat_template")
    except (OSError, ValueError):
        return None
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("tool_use") or named.get("default")
    return value if isinstance(value, str) else None


def _model_type(path: str) -> str | None:
    """The `model_type` of the `config.json` in the tokenizer's directory, if there is one."""
    config = os.path.join(path if os.path.isdir(path) else os.path.dirname(path), "config.json")
    try:
        with open(config, encoding="utf-8") as f:
            value = json.load(f).get("model_type")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, str) else None
