"""APPO's tree-rollout keys (`recipes/appo.py`): `rollout.appo`."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.config.rl_schema import RolloutConfig
from mcore_rl.config.sections import Section


@dataclass
class APPOConfig:
    """APPO's tree rollouts (`mcore_rl.algos.appo`): the group's N = rollout.group_size roots, then
    branches from the top-B tokens of each root by the branching score."""

    enabled: bool = False  # grow each training group into a tree (needs algorithm.advantage: appo)
    branch_points: int = 3  # B: branch points per root (the paper's best trade-off: N = 2, B = 3)
    budget: int = 0  # M: rollouts per prompt, roots and branches (0: N + N·B, one branch per point)
    gamma: float = 1.0  # γ of the future ratio Ω in the branching score
    clip: float = 0.2  # ε': Ω clipped to [1 - ε', 1 + ε'] before its z-score


SECTION = Section(RolloutConfig, "appo", APPOConfig)
