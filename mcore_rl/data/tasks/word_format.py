"""word_format: a synthetic formatting task with a programmatic checker built on the
instruction-following verifiers (`mcore_rl.rewards.instruction_following`), short enough for a
tiny byte-level model.

    "up:cat dog"     -> "CAT DOG"           upper case
    "low:CAT DOG"    -> "cat dog"           lower case
    "list:cat dog"   -> "- cat\\n- dog"      one bullet per word
    "json:cat dog"   -> '["cat","dog"]'     a JSON array
    "quote:cat dog"  -> '"cat dog"'         in double quotes

One to three words from a 16-word vocabulary; answers of at most 19 bytes. The prompt decides the
constraints (`constraints_for`): the format's own (case, bullet count, JSON array, quotes), the
words (all present: `include`) and their number. The reward "word_format" is the fraction satisfied,
so a response with the right words in the wrong format earns part of it; `score` is all-or-nothing.

Difficulty (`benchmarks/task_learnability.py word_format --steps 50 100 300`, the stand-in of tiny_code's
docstring): exactly right 1% / 12% / 93% of the time after 50 / 100 / 300 SFT steps, mean reward
0.27 / 0.69 / 0.98 (the words come before the formats).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from mcore_rl.data.tasks import register_task
from mcore_rl.rewards import RewardInput, register_reward
from mcore_rl.rewards.instruction_following import clean, satisfied, score

VOCAB = ("cat", "dog", "sun", "red", "big", "map", "cup", "box", "hat", "pen", "sky", "owl", "fig", "jam", "kit", "log")
FORMATS = ("up", "low", "list", "json", "quote")


def format_example(fmt: str, words: list[str]) -> dict[str, str]:
    if fmt == "up":
        return {"prompt": f"up:{' '.join(words)}", "response": " ".join(words).upper()}
    if fmt == "low":
        return {"prompt": f"low:{' '.join(words).upper()}", "response": " ".join(words)}
    if fmt == "list":
        return {"prompt": f"list:{' '.join(words)}", "response": "\n".join(f"- {w}" for w in words)}
    if fmt == "json":
        return {"prompt": f"json:{' '.join(words)}", "response": json.dumps(words, separators=(",", ":"))}
    if fmt == "quote":
        return {"prompt": f"quote:{' '.join(words)}", "response": '"' + " ".join(words) + '"'}
    raise ValueError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")


def constraints_for(prompt: str) -> list[dict[str, Any]]:
    """The constraints a prompt asks for, as instruction-following verifier specs."""
    fmt, sep, rest = prompt.strip().partition(":")
    words = rest.lower().split()
    if not sep or fmt not in FORMATS or not words:
        raise ValueError(f"not a word_format prompt: {prompt!r}")
    n = len(words)
    by_format: dict[str, list[dict[str, Any]]] = {
        "up": [{"type": "case", "case": "upper"}],
        "low": [{"type": "case", "case": "lower"}],
        "list": [{"type": "bullets", "count": n}, {"type": "lines", "count": n}],
        "json": [{"type": "json", "kind": "array"}, {"type": "starts_with", "text": "["}],
        "quote": [{"type": "quoted"}],
    }
    return by_format[fmt] + [{"type": "include", "words": words}, {"type": "words", "count": n}]


@register_reward("word_format")
def word_format_reward(sample: RewardInput, mode: str = "fraction") -> dict[str, Any]:
    """Fraction of the prompt's constraints the completion satisfies (option `mode: all`: all or nothing)."""
    constraints = constraints_for(sample.prompt)
    verdicts = satisfied(clean(sample.completion).strip(), constraints)
    return {"reward": score(verdicts, mode), "failed": [c["type"] for c, v in zip(constraints, verdicts) if not v]}


@register_task("word_format")
@dataclass(frozen=True)
class WordFormatTask:
    """Reformat 1-3 words: upper/lower case, a bullet list, a JSON array, a quotation."""

    max_words: int = 3
    name: str = "word_format"
    reward: str = "word_format"

    def examples(self, n: int, seed: int) -> list[tuple[str, Any]]:
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            ex = format_example(rng.choice(FORMATS), rng.sample(VOCAB, rng.randint(1, self.max_words)))
            out.append((ex["prompt"], ex["response"]))
        return out

    def score(self, prompt: str, completion: str) -> float:
        return score(satisfied(completion.strip(), constraints_for(prompt)), "all")

    def max_prompt_tokens(self) -> int:
        return len("quote:") + 4 * self.max_words - 1

    def max_answer_tokens(self) -> int:
        return 6 * self.max_words + 2  # '["cat","dog","sun"]' (19 bytes for 3 words), then end-of-text
