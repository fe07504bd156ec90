"""Rewards: the reward-function interface and runner (`base`), verifiers (math, the demo task).

`get_reward_fn(name)` returns a built-in per-sample reward function by name.
"""

from __future__ import annotations

from typing import Callable

from mcore_rl.rewards.base import RewardFunction, RewardInput, RewardResult, RewardRunner, annotate

_BUILTIN = {
    "addition": "mcore_rl.rewards.addition:addition_reward",
    "math": "mcore_rl.rewards.math_verify:math_reward",
}


def get_reward_fn(name: str) -> Callable[[RewardInput], float]:
    """A built-in reward function ("addition", "math"), or any "package.module:function"."""
    target = _BUILTIN.get(name, name)
    if ":" not in target:
        raise KeyError(f"unknown reward function {name!r}; built-in: {', '.join(sorted(_BUILTIN))} "
                       "(or give 'package.module:function')")
    import importlib

    module, attr = target.split(":", 1)
    return getattr(importlib.import_module(module), attr)


__all__ = ["RewardFunction", "RewardInput", "RewardResult", "RewardRunner", "annotate", "get_reward_fn"]
