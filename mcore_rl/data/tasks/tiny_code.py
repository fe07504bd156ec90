"""A synthetic code task a 2-layer byte-level model learns from scratch: write f as a lambda.

    prompt   "f(x)=3x+1"        a, b in 1..9; also "x+b", "ax", "ax-b", "x^2+b"
    answer   "lambda x:3*x+1"   at most 14 bytes

The reward "tiny_code" runs the completion (its first line, stop markers cut) as `f = <answer>` in
the sandbox; unit tests at five points (`assert f(-3) == -8`, ...) run in the code reward's checker
and call `f` across the sandbox (`mcore_rl/rewards/checker.py`): reward = the fraction that pass,
so a near miss (right slope, wrong offset) still earns something. Any program that
computes f passes (`lambda x:1+3*x`, `lambda x:x*3+1`); one that hangs or forks costs its sample.
`score` is all-or-nothing. 178 distinct problems.

Difficulty (`benchmarks/task_learnability.py tiny_code --steps 50 100 300`: a plain-torch stand-in of the
demo shape, 2 layers, 64 wide, byte-level, 32 examples per step, greedy on 100 new draws): 6% of the
answers pass every test after 50 SFT steps, 78% after 100, 100% after 300. So an SFT warm start of
50-100 steps leaves RL or distillation room to improve.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from mcore_rl.data.tasks import register_task
from mcore_rl.rewards import RewardInput, register_reward
from mcore_rl.rewards.code import STOPS, score_completion
from mcore_rl.rewards.sandbox import Limits

POINTS = (-3, -1, 0, 2, 5)
LIMITS = Limits(cpu_s=2, wall_s=5, memory_mb=256, nproc=8, output_bytes=4096)
_PROMPT = re.compile(r"^f\(x\)=(\d?)x(\^2)?([+-]\d)?$")


def format_problem(a: int, square: bool, b: int) -> dict[str, str]:
    """f(x) = a·x (or x², with a = 1) + b, as a prompt and its reference lambda."""
    if square and a != 1:
        raise ValueError("squares have coefficient 1")
    coef = "" if a == 1 else str(a)
    const = "" if b == 0 else f"{b:+d}"
    term = "x*x" if square else ("x" if a == 1 else f"{a}*x")
    return {"prompt": f"f(x)={coef}x{'^2' if square else ''}{const}", "response": f"lambda x:{term}{const}"}


def all_problems() -> list[tuple[int, bool, int]]:
    out = [(1, False, b) for b in range(1, 10)] + [(a, False, 0) for a in range(2, 10)]
    out += [(a, False, s * b) for a in range(2, 10) for b in range(1, 10) for s in (1, -1)]
    return out + [(1, True, b) for b in range(1, 10)]


def parse(prompt: str) -> tuple[int, int, int]:
    """(a, power, b) of a prompt; ValueError if it is not one of this task's."""
    m = _PROMPT.match(prompt.strip())
    if m is None:
        raise ValueError(f"not a tiny_code prompt: {prompt!r}")
    return int(m.group(1) or 1), 2 if m.group(2) else 1, int(m.group(3) or 0)


def checks_for(prompt: str) -> list[str]:
    a, p, b = parse(prompt)
    return [f"assert f({x}) == {a * x**p + b}" for x in POINTS]


def answer_of(completion: str) -> str:
    for stop in STOPS + ("\n",):
        completion = completion.split(stop, 1)[0]
    return completion.strip()


@register_reward("tiny_code")
def tiny_code_reward(sample: RewardInput, mode: str = "fraction") -> dict[str, Any]:
    """Fraction of the prompt's unit tests that `f = <completion>` passes, run in the sandbox (option
    `mode: all`: 1.0 only when all pass)."""
    return score_completion(
        answer_of(sample.completion), checks_for(sample.prompt), mode=mode, template="f = {program}", limits=LIMITS
    )


@register_task("tiny_code")
@dataclass(frozen=True)
class TinyCodeTask:
    """Linear and quadratic functions to be written as Python lambdas."""

    name: str = "tiny_code"
    reward: str = "tiny_code"

    def examples(self, n: int, seed: int) -> list[tuple[str, Any]]:
        rng = random.Random(seed)
        probs = all_problems()
        return [(ex["prompt"], ex["response"]) for ex in (format_problem(*rng.choice(probs)) for _ in range(n))]

    def score(self, prompt: str, completion: str) -> float:
        return float(
            score_completion(
                answer_of(completion), checks_for(prompt), mode="all", template="f = {program}", limits=LIMITS
            )["reward"]
        )

    def max_prompt_tokens(self) -> int:
        return len("f(x)=x^2+9")

    def max_answer_tokens(self) -> int:
        return len("lambda x:9*x-9") + 1
