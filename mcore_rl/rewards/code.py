"""Code reward: the program of a completion, run against the task's tests in the sandbox.

The completion's program is the last ```python fenced block (or the last fenced block, or an
unclosed one cut by the token budget), else the whole completion as bare code. One sandbox run
executes it and then each test (a piece of code, usually `assert`s) in its namespace; the harness
reports every test as it finishes on the sandbox's results channel, so a run killed half-way still
counts the tests that passed before.

reward = passed / total (`mode: "fraction"`, the default) or 1.0 only when all pass (`mode: "all"`);
`info["kind"]` says why it is not 1: "wrong" (an assertion failed), "error" (the program does not
compile or raises, or a test raised something else), "timeout" (CPU or wall time), "memory"
(MemoryError / a crash at the memory limit), "output" (stdout/stderr flood), "no_code" (nothing
to run), "sandbox" (the sandbox could not be built: a reward error, not the policy's fault).

The result lines carry a per-run random token the program does not see in its own namespace, so
printing or writing fake results does not count; a program that goes looking for the token in the
interpreter's memory (frames, `gc`) could forge it (docs/sandbox.md).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional, Sequence

from mcore_rl.rewards.base import RewardInput
from mcore_rl.rewards.registry import register_reward
from mcore_rl.rewards.sandbox import Limits, SandboxResult, run_python

STOPS = ("<|endoftext|>", "<|im_end|>", "</s>")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
MODES = ("fraction", "all")


def extract_program(completion: str) -> Optional[str]:
    """The program in a completion (see the module docstring); None if there is nothing to run."""
    for stop in STOPS:
        completion = completion.split(stop, 1)[0]
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(completion)]
    python = [body for lang, body in blocks if lang in ("python", "py", "python3")]
    code = python[-1] if python else blocks[-1][1] if blocks else completion
    return code if code.strip() else None


_HARNESS = '''\
import os as _os
def _mcore_harness(token, program, tests):
    def report(*parts):
        _os.write(3, (" ".join([token] + [str(p) for p in parts]) + "\\n").encode())
    def kind(exc):
        if isinstance(exc, MemoryError):
            return "memory"
        return "wrong" if isinstance(exc, AssertionError) else "error"
    scope = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(program, "solution.py", "exec"), scope)
    except BaseException as exc:
        report("program", kind(exc) if not isinstance(exc, AssertionError) else "error", type(exc).__name__)
        return
    report("program", "ok", "-")
    for i, test in enumerate(tests):
        try:
            exec(compile(test, "test_%d.py" % i, "exec"), scope)
        except BaseException as exc:
            report("test", i, kind(exc), type(exc).__name__)
        else:
            report("test", i, "pass", "-")
    report("done")
'''


def harness_source(program: str, tests: Sequence[str], token: str) -> str:
    """The sandbox's main.py: the harness, then one call that runs `program` and `tests`."""
    # the token travels as a constant of the call only: the program's own namespace never holds it
    return f"{_HARNESS}_mcore_harness({token!r}, {program!r}, {list(tests)!r})\n"


@dataclass
class CodeOutcome:
    passed: int
    total: int
    kind: str  # "pass" or a failure kind (module docstring)
    detail: str = ""
    sandbox: Optional[SandboxResult] = field(default=None, repr=False)

    def reward(self, mode: str = "fraction") -> float:
        if self.total == 0:
            return 0.0
        if mode == "all":
            return 1.0 if self.passed == self.total else 0.0
        return self.passed / self.total


def run_tests(program: str, tests: Sequence[str], limits: Limits = Limits(),
              files: Optional[Mapping[str, bytes | str]] = None, stdin: bytes = b"") -> CodeOutcome:
    """Run `program` then each test in one sandbox; count what passed and say why the rest did not."""
    token = secrets.token_hex(16)
    res = run_python(harness_source(program, tests, token), files=files, stdin=stdin, limits=limits)
    if res.status == "setup_error":
        raise RuntimeError(f"code reward: {res.error}")
    passed, first_failure, loaded, done = 0, None, None, False
    for line in res.results.decode(errors="replace").splitlines():
        parts = line.split(" ")
        if not parts or parts[0] != token:
            continue
        if parts[1:2] == ["program"] and len(parts) >= 4:
            loaded = parts[2] == "ok"
            if not loaded:
                first_failure = (parts[2], f"the program raised {parts[3]}")
        elif parts[1:2] == ["test"] and len(parts) >= 5:
            if parts[3] == "pass":
                passed += 1
            elif first_failure is None:
                first_failure = (parts[3], f"test {parts[2]}: {parts[4]}")
        elif parts[1:2] == ["done"]:
            done = True
    total = len(tests)
    out = CodeOutcome(passed, total, "pass", sandbox=res)
    if res.status == "timeout":
        out.kind, out.detail = "timeout", res.error or ""
    elif res.status == "output_limit":
        out.kind, out.detail = "output", res.error or ""
    elif res.memory_error and (first_failure is None or first_failure[0] in ("memory", "error")) and passed < total:
        out.kind, out.detail = "memory", (first_failure or ("", res.error or "out of memory"))[1]
    elif first_failure is not None:
        out.kind, out.detail = first_failure
    elif not done or loaded is None:
        # it exited (sys.exit / os._exit / a signal) before the harness finished: not a pass
        out.kind = "error"
        out.detail = res.error or f"the program ended the run early (exit status {res.returncode})"
    return out


def _label(sample: RewardInput) -> dict[str, Any]:
    label = sample.label
    if isinstance(label, str):
        label = json.loads(label)
    if not isinstance(label, dict) or not isinstance(label.get("tests"), list):
        raise ValueError("the code reward's label must be a dict with a 'tests' list")
    return label


def limits_of(options: Optional[Mapping[str, Any]]) -> Limits:
    """`Limits` with a label's or a task's overrides (unknown keys are refused)."""
    if not options:
        return Limits()
    known = {f.name for f in fields(Limits)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown sandbox limits {unknown}; known: {sorted(known)}")
    return Limits(**options)


def score_completion(completion: str, tests: Sequence[str], *, mode: str = "fraction", setup: str = "",
                     template: str = "{program}", limits: Limits = Limits(),
                     files: Optional[Mapping[str, bytes | str]] = None) -> dict[str, Any]:
    """The code reward of one completion: a dict with "reward" and the outcome as info."""
    if mode not in MODES:
        raise ValueError(f"code reward mode must be one of {MODES}, got {mode!r}")
    code = extract_program(completion)
    if code is None:
        return {"reward": 0.0, "kind": "no_code", "passed": 0, "total": len(tests), "detail": "no program"}
    program = setup + template.replace("{program}", code)
    out = run_tests(program, tests, limits, files)
    return {"reward": out.reward(mode), "kind": out.kind, "passed": out.passed, "total": out.total,
            "detail": out.detail[:300]}


@register_reward("code")
def code_reward(sample: RewardInput, mode: Optional[str] = None,
                limits: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """Label: {"tests": [code, ...], "mode": "fraction" | "all", "setup": code run first,
    "template": "... {program} ..." (the program is substituted), "limits": {Limits field: value},
    "files": {relative path: text}}. The options (a reward head's `options`) `mode` and `limits`
    override the label's."""
    label = _label(sample)
    return score_completion(sample.completion, label["tests"], mode=mode or label.get("mode", "fraction"),
                            setup=label.get("setup", ""), template=label.get("template", "{program}"),
                            limits=limits_of({**(label.get("limits") or {}), **(limits or {})}),
                            files=label.get("files"))


@register_reward("code_all")
def code_all_reward(sample: RewardInput, limits: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """`code` with `mode: "all"` whatever the label says: 1.0 only when every test passes."""
    return code_reward(sample, mode="all", limits=limits)
