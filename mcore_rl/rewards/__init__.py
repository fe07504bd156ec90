"""Rewards: the reward-function interface and runner (`base`), the name registry, verifiers.

`get_reward_fn(name)` returns a registered per-sample reward function ("math", a task's reward
such as "addition" once `mcore_rl.data.tasks` is imported), or any "package.module:function".
"""

from __future__ import annotations

from mcore_rl.rewards.base import RewardFunction, RewardInput, RewardResult, RewardRunner, annotate
from mcore_rl.rewards.registry import get_reward_fn, is_import_path, register_reward, reward_names

__all__ = [
    "RewardFunction",
    "RewardInput",
    "RewardResult",
    "RewardRunner",
    "annotate",
    "get_reward_fn",
    "is_import_path",
    "register_reward",
    "reward_names",
]
