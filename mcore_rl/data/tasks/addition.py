"""A synthetic, verifiable task for demos: multi-digit addition that a tiny model learns on CPU.

Format, shown for `max_digits=3`:

    prompt   "012+345="      operands zero-padded to `max_digits` digits, most significant first
    response "7530"          the sum 357 written least-significant digit first, zero-padded to
                             `max_digits + 1` digits

Why: zero-padding puts every digit at the same position in every example (position ids restart
per document), and writing the sum least-significant first lets the model emit each digit from two
operand digits plus the carry of the digit it has just written, instead of looking ahead through
every carry (cf. Lee et al. 2023, "Teaching Arithmetic to Small Transformers").

Difficulty, measured with a plain-torch stand-in of the default `ModelConfig` shape (2 layers, 64
wide, RoPE, block-diagonal attention), 8 packed rows of 64 tokens per step, AdamW lr 3e-3 with
cosine decay, greedy accuracy on 200 newly drawn problems (with one digit there are only 100
problems, so these were seen in training):
`max_digits=1` reaches 99.5% in 300 steps; `max_digits=2` sits on a plateau (units/tens digits at
chance) until about step 500 and reaches 99% after 1500 steps; `max_digits=3` is at 0% after 300
steps. Hence `DEFAULT_MAX_DIGITS = 1` for SFT demos that must learn in a few hundred steps; RL demos
can ask for more digits to leave room for improvement. SFT and RL share this module: the RL
reward is `addition_reward` (registered as "addition"), built on `verify_addition`.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from mcore_rl.data.tasks import register_task
from mcore_rl.rewards import RewardInput, register_reward

DEFAULT_MAX_DIGITS = 1

_PROMPT = re.compile(r"^\s*(\d+)\+(\d+)=\s*$")


def format_addition(a: int, b: int, max_digits: int, reversed_operands: bool = False) -> dict[str, str]:
    """The prompt/response pair for a + b (`reversed_operands`: the operands too least-significant first)."""
    x, y = f"{a:0{max_digits}d}", f"{b:0{max_digits}d}"
    if reversed_operands:
        x, y = x[::-1], y[::-1]
    return {"prompt": f"{x}+{y}=", "response": f"{a + b:0{max_digits + 1}d}"[::-1]}


def make_addition_examples(
    n: int, seed: int, max_digits: int = DEFAULT_MAX_DIGITS, reversed_operands: bool = False
) -> list[dict[str, str]]:
    """`n` random problems with operands of up to `max_digits` digits (deterministic in `seed`)."""
    if max_digits < 1:
        raise ValueError(f"max_digits must be >= 1, got {max_digits}")
    rng = random.Random(seed)
    hi = 10**max_digits - 1
    return [format_addition(rng.randint(0, hi), rng.randint(0, hi), max_digits, reversed_operands) for _ in range(n)]


def verify_addition(prompt: str, completion: str, reversed_operands: bool = False) -> float:
    """1.0 if `completion` is the reversed sum of the prompt's operands, else 0.0.

    Surrounding whitespace is ignored, and so are leading/trailing zeros (the value is compared, so
    "753" and "7530" are both right for 357); anything that is not all digits scores 0.
    """
    m = _PROMPT.match(prompt)
    if m is None:
        raise ValueError(f"not an addition prompt: {prompt!r}")
    answer = completion.strip()
    if not answer.isdigit() or not answer.isascii():
        return 0.0
    x, y = (m.group(1)[::-1], m.group(2)[::-1]) if reversed_operands else (m.group(1), m.group(2))
    return 1.0 if int(answer[::-1]) == int(x) + int(y) else 0.0


@register_reward("addition")
def addition_reward(sample: RewardInput) -> float:
    """`verify_addition(prompt, completion)`. The completion is cut at the first end-of-text
    marker or newline the engine may have left in the decoded text. A prompt that is not an
    addition problem raises (the runner records it as a reward error)."""
    completion = sample.completion
    for stop in ("<|endoftext|>", "<|im_end|>", "</s>", "\n"):
        completion = completion.split(stop, 1)[0]
    return verify_addition(sample.prompt, completion)


@register_reward("addition_lsd")
def addition_lsd_reward(sample: RewardInput) -> float:
    """`addition_reward` for prompts whose operands are written least-significant digit first."""
    completion = sample.completion
    for stop in ("<|endoftext|>", "<|im_end|>", "</s>", "\n"):
        completion = completion.split(stop, 1)[0]
    return verify_addition(sample.prompt, completion, reversed_operands=True)


@register_task("addition")
@dataclass(frozen=True)
class AdditionTask:
    """2-digit (or `max_digits`) addition, answer reversed; the demo task."""

    max_digits: int = DEFAULT_MAX_DIGITS
    name: str = "addition"
    reward: str = "addition"

    def examples(self, n: int, seed: int) -> list[tuple[str, Any]]:
        return [(ex["prompt"], ex["response"]) for ex in make_addition_examples(n, seed, self.max_digits)]

    def score(self, prompt: str, completion: str) -> float:
        return verify_addition(prompt, completion)

    def max_prompt_tokens(self) -> int:
        return 2 * self.max_digits + 2  # "12+34="

    def max_answer_tokens(self) -> int:
        return self.max_digits + 2  # the reversed sum has max_digits + 1 digits, then end-of-text


@register_task("addition_lsd")
@dataclass(frozen=True)
class AdditionLSDTask(AdditionTask):
    """Addition with every number least-significant digit first: "70+53=" is 07 + 35, answer "240".

    Each answer digit then sits a fixed distance after the two operand digits it adds (and after the
    previous pair, whose carry it needs), for every digit position: relative position (RoPE) alone
    finds them. With the operands most-significant first the distances differ per digit, so the model
    must first learn where it is in the answer; that is the plateau of "addition" (the digits at
    chance for a seed-dependent number of steps, docs/demo.md)."""

    name: str = "addition_lsd"
    reward: str = "addition_lsd"

    def examples(self, n: int, seed: int) -> list[tuple[str, Any]]:
        return [(ex["prompt"], ex["response"]) for ex in make_addition_examples(n, seed, self.max_digits, True)]

    def score(self, prompt: str, completion: str) -> float:
        return verify_addition(prompt, completion, reversed_operands=True)
