"""EffOPD's keys (`recipes/effopd.py`): `distill.effopd`."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.config.rl_schema import DistillConfig
from mcore_rl.config.sections import Section


@dataclass
class EffOPDConfig:
    """EffOPD weight extrapolation: at rollout steps 1, 2, 4, 8, ... try W + 2k·Δ (k = 1..num_candidates)
    on a validation set and keep the last candidate of the run whose score does not drop."""

    enabled: bool = False  # try extrapolated weights at steps 1, 2, 4, 8, ...
    validation_prompts: int = 50  # the paper: 50 training samples (greedy, mean reward)
    num_candidates: int = 5  # candidates per try (k = 1 .. num_candidates)
    scale: float = 2.0  # candidate k = W + scale·k·Δ


SECTION = Section(DistillConfig, "effopd", EffOPDConfig)
