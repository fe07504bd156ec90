"""Re-Math's early-stopped refresh keys (`recipes/remath.py`): `data.mixture.stages[k].stop_*`."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.config.rl_schema import MixtureStageConfig
from mcore_rl.config.sections import Section


@dataclass
class RefreshStopConfig:
    """Re-Math's early-stopped refresh (the last stage only): end the run after `patience` evaluations
    in the stage without `metric` improving by more than `min_delta`."""

    # Re-Math's early-stopped refresh (recipes/remath.py; the last stage only): end the run after this many
    # evaluations in the stage without stop_metric improving by more than stop_min_delta; 0 = off
    patience: int = 0
    metric: str | None = None  # None = eval/<the stage's only domain>/score
    min_delta: float = 0.0  # Re-Math's stop: smallest change that counts as an improvement


SECTION = Section(MixtureStageConfig, "stop_", RefreshStopConfig, flat=True)
