"""Reward of the synthetic addition demo task (`data.synthetic`): 1 for the right reversed sum."""

from __future__ import annotations

from mcore_rl.data.synthetic import verify_addition
from mcore_rl.rewards.base import RewardInput


def addition_reward(sample: RewardInput) -> float:
    """`verify_addition(prompt, completion)`. The completion is cut at the first end-of-text
    marker or newline the engine may have left in the decoded text. A prompt that is not an
    addition problem raises (the runner records it as a reward error)."""
    completion = sample.completion
    for stop in ("<|endoftext|>", "<|im_end|>", "</s>", "\n"):
        completion = completion.split(stop, 1)[0]
    return verify_addition(sample.prompt, completion)
