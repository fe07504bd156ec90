"""POLARIS's keys (`recipes/polaris.py`): `rollout.polaris`."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.config.rl_schema import RolloutConfig
from mcore_rl.config.sections import Section


@dataclass
class PolarisConfig:
    """POLARIS's zero-signal group repair (`mcore_rl.algos.polaris`, `mcore_rl.recipes.polaris`)."""

    rescue: bool = False  # an all-wrong group gets one wrong rollout replaced by its prompt's last correct one
    rescue_buffer_prompts: int = 100_000  # prompts the rescue buffer holds at most (least recently updated go)
    substitute: bool = False  # all-correct / all-wrong groups replaced by copies of mixed groups of the batch
    correct_reward: float = 1.0  # a rollout is correct when its reward is >= this


SECTION = Section(RolloutConfig, "polaris", PolarisConfig)
