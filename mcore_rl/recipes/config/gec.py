"""EDGE-GRPO's guided error correction keys (`recipes/gec.py`): `rollout.gec`."""

from __future__ import annotations

from dataclasses import dataclass, field

from mcore_rl.config.rl_schema import RolloutConfig
from mcore_rl.config.sections import Section


@dataclass
class GECConfig:
    """EDGE-GRPO's guided error correction of wrong responses (`mcore_rl.algos.edge_gec`)."""

    enabled: bool = False  # repair wrong responses of a group (refuses rollout.runtime: async)
    probs: list[float] = field(default_factory=lambda: [0.5, 0.25, 0.25])  # reflect / reflect + answer / reference
    reflection: str = " Wait!"  # appended after the wrong response (ops 1 and 2)
    answer_hint: str = " The answer is {answer}."  # op 2, after the reflection ({answer}: the task's answer)
    correct_reward: float = 1.0  # a response is wrong when its reward is < this


SECTION = Section(RolloutConfig, "gec", GECConfig)
