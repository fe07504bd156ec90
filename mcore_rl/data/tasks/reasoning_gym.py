"""reasoning-gym (`reasoning-gym==0.1.25`) as tasks: any of its 100+ procedural generators, scored
by the generator's own `score_answer`.

`get_task("reasoning_gym", dataset="chain_sum", **options)` builds one (options are the dataset's
config fields, e.g. `min_terms`); a domain names it as `reasoning_gym: chain_sum`. The RL label of
a prompt is the generator's whole entry (question, answer, metadata), which is what the scorer
reads; the reward "reasoning_gym" runs that scorer in the reward workers, on the completion's
`<answer>...</answer>` when it has one, else (option `extract`) on the whole completion, nothing,
or its last number (stop markers cut). The
package is imported only when a reasoning-gym task is built or scored (it takes about a second).
"""

from __future__ import annotations

import re
import typing
from functools import cache
from typing import Any, Literal
from collections.abc import Callable

from mcore_rl.data.tasks import register_task
from mcore_rl.rewards import RewardInput, register_reward

STOPS = ("<|endoftext|>", "<|im_end|>", "</s>")


def dataset_names() -> list[str]:
    """Every generator reasoning-gym registers."""
    import reasoning_gym

    return sorted(reasoning_gym.factory.DATASETS)


def _config_fields(dataset: str) -> set[str]:
    import dataclasses

    import reasoning_gym

    return {f.name for f in dataclasses.fields(reasoning_gym.factory.DATASETS[dataset][1])}


@cache
def _scorer(dataset: str) -> Callable[[str, dict], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(dataset)


Extraction = Literal["auto", "tag", "last_number"]
EXTRACTIONS: tuple[str, ...] = typing.get_args(Extraction)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def answer_of(completion: str, extract: Extraction = "auto") -> str:
    """What the scorer judges. Every mode takes the `<answer>` tag's content when there is one;
    without it: "auto" the whole completion, "tag" nothing (the answer must be tagged),
    "last_number" the completion's last number (commas dropped) - for numeric tasks and models
    that state the result in prose ("3 * 9 = 27"), as GSM8K-style graders do."""
    from reasoning_gym.utils import extract_answer

    if extract not in EXTRACTIONS:
        raise ValueError(f"extract: {extract!r} is not one of {', '.join(EXTRACTIONS)}")
    for stop in STOPS:
        completion = completion.split(stop, 1)[0]
    tagged = extract_answer(completion, tag_name="answer")
    if tagged is not None:
        return tagged
    if extract == "last_number":
        numbers = _NUMBER.findall(completion)
        return numbers[-1].replace(",", "") if numbers else ""
    return "" if extract == "tag" else completion.strip()


@register_reward("reasoning_gym")
def reasoning_gym_reward(sample: RewardInput, extract: Extraction = "auto") -> float:
    """The generator's own score of the completion's answer (`answer_of`); the label is the
    generator's entry."""
    entry = sample.label
    if not isinstance(entry, dict) or "metadata" not in entry:
        raise ValueError("the label is not a reasoning-gym entry (a dict with 'metadata')")
    return float(_scorer(entry["metadata"]["source_dataset"])(answer_of(sample.completion, extract), entry))


@register_task("reasoning_gym")
class ReasoningGymTask:
    """One reasoning-gym generator; `options` are its config fields (refused ones fail here)."""

    name = "reasoning_gym"
    reward = "reasoning_gym"

    def __init__(self, dataset: str = "chain_sum", **options: Any) -> None:
        """`options` go to the generator's config. `max_digits` (which every task accepts, from
        `data.synthetic_max_digits`) is dropped for generators that have no such field."""
        names = dataset_names()
        if dataset not in names:
            raise ValueError(f"unknown reasoning-gym dataset {dataset!r}; available: {', '.join(names)}")
        if "max_digits" in options and "max_digits" not in _config_fields(dataset):
            options.pop("max_digits")
        self.dataset, self.options = dataset, dict(options)
        self._entries(1, 0)  # options the generator refuses fail now (TypeError / ValueError)

    def _entries(self, n: int, seed: int) -> list[dict]:
        import reasoning_gym

        return list(reasoning_gym.create_dataset(self.dataset, seed=seed, size=n, **self.options))

    def rl_examples(self, n: int, seed: int) -> list[tuple[str, Any]]:
        """(question, entry): the scorer needs the entry, not just the answer."""
        return [(e["question"], e) for e in self._entries(n, seed)]

    def examples(self, n: int, seed: int) -> list[tuple[str, Any]]:
        return [(e["question"], str(e["answer"])) for e in self._entries(n, seed)]

    def score(self, prompt: str, completion: str) -> float:
        raise ValueError(
            "a reasoning-gym completion is scored against its entry (the RL label): use the 'reasoning_gym' reward"
        )

    def max_prompt_tokens(self) -> int:
        return 0  # unknown: checked on the drawn prompts when the pools are built

    def max_answer_tokens(self) -> int:
        return 0
