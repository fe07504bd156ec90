"""What a task is: its prompts, the reward function that scores them, and how it is evaluated.

A task is the unit the data side hands to the rest of the trainer. RL draws its training,
held-out and validation prompts from it (different seeds), the SFT warm start trains on its
reference answers, and the reward it names (registered in `mcore_rl.rewards` when the task module
is imported) scores the completions. Nothing outside the task's own module needs to know which
task a run is on.
"""

from __future__ import annotations

from typing import Any, Protocol


class Task(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def reward(self) -> str:
        """The registered reward function that scores this task's completions."""
        ...

    def examples(self, n: int, seed: int) -> list[tuple[str, Any]]:
        """`n` (prompt, reference answer) pairs, deterministic in `seed`. The answer is the SFT
        target and the RL label."""
        ...

    def score(self, prompt: str, completion: str) -> float:
        """The raw verifier: 1.0 for a right completion (no stop-marker handling)."""
        ...

    def max_prompt_tokens(self) -> int:
        """Upper bound on a prompt's length in bytes (= tokens of the byte-level tokenizer)."""
        ...

    def max_answer_tokens(self) -> int:
        """Tokens a right answer needs, with its end-of-text token."""
        ...
