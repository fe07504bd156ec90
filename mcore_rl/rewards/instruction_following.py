"""Instruction-following rewards: constraints checked by code (AutoIF, Qwen, ICLR 2025).

A constraint is a dict `{"type": name, **params}`; `VERIFIERS[name](response, **params)` says
whether the response satisfies it. Built in:

- length: `words`, `sentences`, `chars`, `paragraphs`, `lines` (`min` / `max`, either or both),
- format: `starts_with`, `ends_with` (`text`), `bullets` / `sections` / `placeholders` (`min` /
  `max` / `count`), `case` (`"lower"`, `"upper"`, `"title"`), `quoted`, `no_commas`,
- keywords: `include` / `exclude` (`words`, whole words, case-insensitive), `frequency` (`word`,
  `min` / `max` / `count`),
- JSON: `json` (the whole response, or one ```json block, parses; `keys`: required top-level keys;
  `kind`: "object" or "array"),
- `python`: AutoIF's own kind, an LLM-written verification function `evaluate(response) -> bool`
  (`code`), run in the sandbox (`mcore_rl.rewards.sandbox`), never in this process.

The reward "instruction_following" reads the constraints from the sample's label (a list, or a
dict with "constraints" and "mode") and returns the fraction satisfied (`mode: "fraction"`) or 1.0
only when all are (`mode: "all"`); "autoif" scores a response with a label's verification functions
the AutoIF way (mean over functions, `keep_response` at > 0.5). The AutoIF data filters
(`cross_validate`, `keep_response`, `preference_pairs`) are here too: they are what turns
LLM-written verifiers into a reward one can trust.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any
from collections.abc import Callable, Sequence

from mcore_rl.rewards.base import RewardInput
from mcore_rl.rewards.sandbox import Limits, run_python
from mcore_rl.rewards.registry import register_reward

STOPS = ("<|endoftext|>", "<|im_end|>", "</s>")
MODES = ("fraction", "all")

_WORD = re.compile(r"[A-Za-z0-9]+(?:['’-][A-Za-z0-9]+)*")
_SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)")
_BULLET = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s+\S", re.MULTILINE)
_PLACEHOLDER = re.compile(r"\[[^\[\]\n]+\]")
_JSON_BLOCK = re.compile(r"```(?:json)?\s*\n(.*?)```", re.DOTALL)


def _bounded(n: int, min: int | None = None, max: int | None = None, count: int | None = None) -> bool:
    if count is not None and n != count:
        return False
    return (min is None or n >= min) and (max is None or n <= max)


def words(text: str) -> list[str]:
    return _WORD.findall(text)


def count_sentences(text: str) -> int:
    """Sentences: runs of text ended by . ! or ? (a trailing unterminated run counts too)."""
    text = text.strip()
    if not text:
        return 0
    ends = len(_SENTENCE_END.findall(text))
    return ends + (0 if _SENTENCE_END.search(text[-1:] + " ") else 1)


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]


def _has_word(text: str, word: str) -> int:
    return len(re.findall(rf"(?<![A-Za-z0-9]){re.escape(word)}(?![A-Za-z0-9])", text, re.IGNORECASE))


def _json_value(text: str) -> tuple[bool, Any]:
    candidates = [text.strip()] + [m.strip() for m in _JSON_BLOCK.findall(text)]
    for c in candidates:
        try:
            return True, json.loads(c)
        except ValueError:
            continue
    return False, None


def check_json(response: str, keys: Sequence[str] = (), kind: str | None = None) -> bool:
    ok, value = _json_value(response)
    if not ok:
        return False
    if kind == "object" and not isinstance(value, dict) or kind == "array" and not isinstance(value, list):
        return False
    if keys:
        return isinstance(value, dict) and all(k in value for k in keys)
    return True


def check_case(response: str, case: str) -> bool:
    letters = [c for c in response if c.isalpha()]
    if not letters:
        return False
    if case == "lower":
        return all(c.islower() for c in letters)
    if case == "upper":
        return all(c.isupper() for c in letters)
    if case == "title":
        return all(w[0].isupper() for w in words(response) if w[0].isalpha())
    raise ValueError(f"case must be 'lower', 'upper' or 'title', got {case!r}")


def check_sections(response: str, marker: str = "Section", **bounds: Any) -> bool:
    """Sections are lines that start with `marker` (e.g. "Section 1", or "#" for Markdown headers)."""
    n = sum(1 for line in response.splitlines() if line.lstrip().startswith(marker))
    return _bounded(n, **bounds)


def check_frequency(response: str, word: str, **bounds: Any) -> bool:
    return _bounded(_has_word(response, word), **bounds)


VERIFIERS: dict[str, Callable[..., bool]] = {
    "words": lambda r, **b: _bounded(len(words(r)), **b),
    "sentences": lambda r, **b: _bounded(count_sentences(r), **b),
    "chars": lambda r, **b: _bounded(len(r), **b),
    "paragraphs": lambda r, **b: _bounded(len(_paragraphs(r)), **b),
    "lines": lambda r, **b: _bounded(len([x for x in r.strip().splitlines() if x.strip()]), **b),
    "starts_with": lambda r, text: r.lstrip().startswith(text),
    "ends_with": lambda r, text: r.rstrip().endswith(text),
    "bullets": lambda r, **b: _bounded(len(_BULLET.findall(r)), **b),
    "sections": check_sections,
    "placeholders": lambda r, **b: _bounded(len(_PLACEHOLDER.findall(r)), **b),
    "case": lambda r, case: check_case(r, case),
    "quoted": lambda r: len(r.strip()) >= 2 and r.strip()[0] == r.strip()[-1] == '"',
    "no_commas": lambda r: "," not in r,
    "include": lambda r, words: all(_has_word(r, w) for w in words),
    "exclude": lambda r, words: not any(_has_word(r, w) for w in words),
    "frequency": check_frequency,
    "json": check_json,
}


def check(response: str, constraint: dict[str, Any]) -> bool:
    """Whether `response` satisfies one constraint. An unknown type or parameter is a ValueError
    that names it (a broken label, not a wrong answer: the runner records it as a reward error)."""
    params = dict(constraint)
    kind = params.pop("type", None)
    if kind == "python":
        return run_verifiers(response, [params["code"]])[0]
    if kind not in VERIFIERS:
        raise ValueError(f"unknown constraint type {kind!r}; known: {', '.join(sorted(VERIFIERS))}, python")
    try:
        return bool(VERIFIERS[kind](response, **params))
    except TypeError as exc:
        raise ValueError(f"constraint {kind!r}: bad parameters {sorted(params)}: {exc}") from None


def clean(completion: str) -> str:
    for stop in STOPS:
        completion = completion.split(stop, 1)[0]
    return completion


def satisfied(response: str, constraints: Sequence[dict[str, Any]]) -> list[bool]:
    """One verdict per constraint; `python` ones share one sandbox run."""
    out: list[bool | None] = [None] * len(constraints)
    python = [i for i, c in enumerate(constraints) if c.get("type") == "python"]
    if python:
        for i, v in zip(python, run_verifiers(response, [constraints[i]["code"] for i in python])):
            out[i] = v
    for i, c in enumerate(constraints):
        if out[i] is None:
            out[i] = check(response, c)
    return [bool(v) for v in out]


def score(verdicts: Sequence[bool], mode: str = "fraction") -> float:
    if mode not in MODES:
        raise ValueError(f"instruction-following mode must be one of {MODES}, got {mode!r}")
    if not verdicts:
        return 0.0
    if mode == "all":
        return float(all(verdicts))
    return sum(verdicts) / len(verdicts)


def _constraints_of(label: Any) -> tuple[list[dict[str, Any]], str]:
    if isinstance(label, str):
        label = json.loads(label)
    if isinstance(label, list):
        return label, "fraction"
    if isinstance(label, dict) and isinstance(label.get("constraints"), list):
        return label["constraints"], label.get("mode", "fraction")
    raise ValueError("the instruction-following label must be a list of constraints or a dict with 'constraints'")


@register_reward("instruction_following")
def instruction_following_reward(sample: RewardInput, mode: str | None = None) -> dict[str, Any]:
    """Fraction (or all, `mode: "all"`) of the label's constraints the completion satisfies; the
    option `mode` overrides the label's."""
    constraints, label_mode = _constraints_of(sample.label)
    verdicts = satisfied(clean(sample.completion), constraints)
    return {
        "reward": score(verdicts, mode or label_mode),
        "satisfied": sum(verdicts),
        "total": len(verdicts),
        "failed": [c.get("type") for c, v in zip(constraints, verdicts) if not v],
    }


# ------------------------------------------------------------------ AutoIF verification functions

_VERIFY_HARNESS = """\
import os as _os
def _mcore_verify(token, response, functions):
    for i, code in enumerate(functions):
        scope = {"__name__": "verifier", "__builtins__": __builtins__}
        try:
            exec(compile(code, "verifier_%d.py" % i, "exec"), scope)
            ok = scope["evaluate"](response) is True
        except BaseException:
            ok = False
        _os.write(3, ("%s %d %d\\n" % (token, i, ok)).encode())
"""


def run_verifiers(response: str, functions: Sequence[str], limits: Limits | None = None) -> list[bool]:
    """f(response) for each verification function (code defining `evaluate(response) -> bool`), in
    one sandbox run; a function that fails to compile, raises, returns a non-True value or runs out
    of time counts as False. A sandbox that cannot be built raises."""
    token = secrets.token_hex(16)
    source = f"{_VERIFY_HARNESS}_mcore_verify({token!r}, {response!r}, {list(functions)!r})\n"
    res = run_python(source, limits=limits or Limits(cpu_s=5, wall_s=10, memory_mb=256))
    if res.status == "setup_error":
        raise RuntimeError(f"AutoIF verifiers: {res.error}")
    out = [False] * len(functions)
    for line in res.results.decode(errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == token and parts[1].isdigit() and int(parts[1]) < len(out):
            out[int(parts[1])] = parts[2] == "1"
    return out


def cross_validate(passes: Sequence[Sequence[bool]]) -> tuple[list[int], list[int]]:
    """AutoIF's cross-validation: passes[f][c] says whether function f accepts test case c as its
    label says. Keeps the functions whose accuracy over the cases is > 0.5 and the cases whose
    accuracy over the functions is > 0.5 (both strict, over the full matrix). The instruction is
    kept iff some (function, case) pair survives, i.e. both lists are non-empty."""
    if not passes:
        return [], []
    n_cases = len(passes[0])
    if any(len(row) != n_cases for row in passes):
        raise ValueError("cross_validate needs a rectangular functions x cases matrix")
    funcs = [f for f, row in enumerate(passes) if n_cases and sum(map(bool, row)) / n_cases > 0.5]
    cases = [c for c in range(n_cases) if sum(bool(row[c]) for row in passes) / len(passes) > 0.5]
    if not funcs or not cases:
        return [], []
    return funcs, cases


def response_score(verdicts: Sequence[bool]) -> float:
    """The response-level score: mean over the surviving functions of f(y)."""
    return sum(map(bool, verdicts)) / len(verdicts) if verdicts else 0.0


def keep_response(score: float) -> bool:
    """AutoIF keeps a response iff its score is > 0.5 (0.5 itself is rejected)."""
    return score > 0.5


def preference_pairs(scores: Sequence[float]) -> list[tuple[int, int]]:
    """(chosen, rejected) index pairs for DPO: chosen have score > 0.5, rejected score == 0; a
    response scored in (0, 0.5] is never used on either side."""
    chosen = [i for i, s in enumerate(scores) if s > 0.5]
    rejected = [i for i, s in enumerate(scores) if s == 0]
    return [(c, r) for c in chosen for r in rejected]


@register_reward("autoif")
def autoif_reward(sample: RewardInput) -> dict[str, Any]:
    """Label {"functions": [code, ...]} (the verification functions that survived
    `cross_validate`): reward = mean over them of evaluate(completion); `kept` is `keep_response`."""
    label = json.loads(sample.label) if isinstance(sample.label, str) else sample.label
    if not isinstance(label, dict) or not isinstance(label.get("functions"), list) or not label["functions"]:
        raise ValueError("the autoif label must be a dict with a non-empty 'functions' list")
    s = response_score(run_verifiers(clean(sample.completion), label["functions"]))
    return {"reward": s, "kept": keep_response(s)}
