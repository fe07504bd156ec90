"""Code reward: the program of a completion, judged against the task's tests.

The completion's program is the last ```python fenced block (or the last fenced block, or an
unclosed one cut by the token budget), else the whole completion as bare code. It runs alone in
the sandbox; the tests run outside it, in the checker (`mcore_rl/rewards/checker.py`), and reach
the program only through calls whose arguments and answers cross as plain data. So nothing the
program does — printing or writing fake results, forking, patching builtins, walking frames or
`gc`, returning an object whose `__eq__` is always true — can pass a test it does not solve.

reward = passed / total (`mode: "fraction"`, the default) or 1.0 only when all pass (`mode: "all"`);
a run that does not end cleanly scores 0. `info["kind"]` says why it is not 1: "wrong" (an
assertion failed), "error" (the program does not compile or raises, a test raised something else,
or the run ended early), "timeout" (CPU or wall time), "memory" (MemoryError / a crash at the
memory limit), "output" (stdout/stderr flood), "no_code" (nothing to run), "sandbox" (the sandbox
could not be built: a reward error, not the policy's fault).
"""

from __future__ import annotations

import json
import re
from dataclasses import fields
from typing import Any
from collections.abc import Mapping, Sequence

from mcore_rl.rewards.base import RewardInput
from mcore_rl.rewards.checker import CodeOutcome, run_tests
from mcore_rl.rewards.registry import register_reward
from mcore_rl.rewards.sandbox import Limits

__all__ = ["CodeOutcome", "extract_program", "limits_of", "run_tests", "score_completion"]

STOPS = ("<|endoftext|>", "<|im_end|>", "</s>")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
MODES = ("fraction", "all")


def extract_program(completion: str) -> str | None:
    """The program in a completion (see the module docstring); None if there is nothing to run."""
    for stop in STOPS:
        completion = completion.split(stop, 1)[0]
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(completion)]
    python = [body for lang, body in blocks if lang in ("python", "py", "python3")]
    code = python[-1] if python else blocks[-1][1] if blocks else completion
    return code if code.strip() else None


def _label(sample: RewardInput) -> dict[str, Any]:
    label = sample.label
    if isinstance(label, str):
        label = json.loads(label)
    if not isinstance(label, dict) or not isinstance(label.get("tests"), list):
        raise ValueError("the code reward's label must be a dict with a 'tests' list")
    return label


def limits_of(options: Mapping[str, Any] | None) -> Limits:
    """`Limits` with a label's or a task's overrides (unknown keys are refused)."""
    if not options:
        return Limits()
    known = {f.name for f in fields(Limits)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown sandbox limits {unknown}; known: {sorted(known)}")
    return Limits(**options)


def score_completion(
    completion: str,
    tests: Sequence[str],
    *,
    mode: str = "fraction",
    setup: str = "",
    template: str = "{program}",
    limits: Limits = Limits(),
    files: Mapping[str, bytes | str] | None = None,
    context: str = "",
    entry_points: Sequence[str] = (),
) -> dict[str, Any]:
    """The code reward of one completion: a dict with "reward" and the outcome as info. `setup`
    and `template` make the program (run in the sandbox); `context` and `entry_points` are the
    checker's (`checker.run_tests`)."""
    if mode not in MODES:
        raise ValueError(f"code reward mode must be one of {MODES}, got {mode!r}")
    code = extract_program(completion)
    if code is None:
        return {"reward": 0.0, "kind": "no_code", "passed": 0, "total": len(tests), "detail": "no program"}
    program = setup + template.replace("{program}", code)
    out = run_tests(program, tests, limits, files, context=context, entry_points=entry_points)
    return {
        "reward": out.reward(mode),
        "kind": out.kind,
        "passed": out.passed,
        "total": out.total,
        "detail": out.detail[:300],
    }


@register_reward("code")
def code_reward(
    sample: RewardInput, mode: str | None = None, limits: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Label: {"tests": [code, ...], "mode": "fraction" | "all", "setup": code run first,
    "template": "... {program} ..." (the program is substituted), "limits": {Limits field: value},
    "files": {relative path: text}, "context": trusted code the tests' namespace runs first,
    "entry_points": [names always taken from the program]}. The tests run in the checker, the
    program in the sandbox (module docstring). The options (a reward head's `options`) `mode` and `limits`
    override the label's."""
    label = _label(sample)
    return score_completion(
        sample.completion,
        label["tests"],
        mode=mode or label.get("mode", "fraction"),
        setup=label.get("setup", ""),
        template=label.get("template", "{program}"),
        limits=limits_of({**(label.get("limits") or {}), **(limits or {})}),
        files=label.get("files"),
        context=label.get("context", ""),
        entry_points=label.get("entry_points", ()),
    )


@register_reward("code_all")
def code_all_reward(sample: RewardInput, limits: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`code` with `mode: "all"` whatever the label says: 1.0 only when every test passes."""
    return code_reward(sample, mode="all", limits=limits)
