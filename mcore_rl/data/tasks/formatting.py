"""A formatting task with a programmatic checker: "write exactly N digits".

Prompt "3 digits #17:" asks for a completion of exactly three digits (any digits; the tag only
makes prompts distinct, so held-out prompts can be disjoint from the training ones); the reward
"formatting" checks it, or, with the option `pattern`, checks that the completion fully matches
that regular expression instead (a reward with options: `{name: formatting, options: {pattern:
"[0-9]+"}}`). A second, easy domain for multi-domain runs: a model that has learnt addition's
format already emits digits, so its length is what it has to learn.
"""

from __future__ import annotations

import random
import re
from typing import Any

from mcore_rl.data.tasks import register_task
from mcore_rl.rewards import RewardInput, register_reward

_PROMPT = re.compile(r"^\s*(\d+) digits #\d+:\s*$")
STOPS = ("<|endoftext|>", "<|im_end|>", "</s>", "\n")


def check_format(prompt: str, completion: str, pattern: str | None = None) -> float:
    """1.0 when the completion (cut at a stop marker) is exactly N digits, or fully matches `pattern`."""
    for stop in STOPS:
        completion = completion.split(stop, 1)[0]
    if pattern is not None:
        return 1.0 if re.fullmatch(pattern, completion) else 0.0
    m = _PROMPT.match(prompt)
    if m is None:
        raise ValueError(f"not a formatting prompt: {prompt!r}")
    return 1.0 if completion.isascii() and completion.isdigit() and len(completion) == int(m.group(1)) else 0.0


@register_reward("formatting")
def formatting_reward(sample: RewardInput, pattern: str | None = None) -> float:
    return check_format(sample.prompt, sample.completion, pattern)


@register_task("formatting")
class FormattingTask:
    """Prompts "N digits #T:" for N in [1, max_length], T in [0, 99]; the reference answer is N random digits."""

    name = "formatting"
    reward = "formatting"

    def __init__(self, max_length: int = 4, max_digits: int = 0) -> None:
        """`max_digits` is accepted and ignored, like every task's (`data.synthetic_task`)."""
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.max_length = max_length

    def examples(self, n: int, seed: int) -> list[tuple[str, Any]]:
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            k = rng.randint(1, self.max_length)
            out.append((f"{k} digits #{rng.randint(0, 99)}:", "".join(str(rng.randint(0, 9)) for _ in range(k))))
        return out

    def score(self, prompt: str, completion: str) -> float:
        return check_format(prompt, completion)

    def max_prompt_tokens(self) -> int:
        return len(f"{self.max_length} digits #99:")

    def max_answer_tokens(self) -> int:
        return self.max_length + 1
