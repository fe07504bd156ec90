"""S2L-PO's keys (`recipes/s2l_po.py`): `rollout.explorer`, an engine group of a smaller model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mcore_rl.config.rl_schema import EngineGroupConfig, RolloutConfig
from mcore_rl.config.sections import Section


@dataclass
class ExplorerConfig(EngineGroupConfig):
    """S2L-PO (`mcore_rl.algos.s2l_po`): a frozen smaller model supplies a decaying share of each group.

    Off unless `urls` (running SGLang / `mcore-rl serve` servers) or `model_path` (an HF checkpoint on
    which the trainer starts `num_engines` `mcore-rl serve` processes) is set. During the first
    `mix_steps` training steps ⌈α·G⌉ samples of every training group come from these engines (α decays
    linearly from `share` to 0, `schedule` names the registered "explorer_schedule"), the rest from
    the policy's; evaluation and validation batches never use them. Their μ is the small model's
    log-probs; `correction` says what the mismatch correction sees for them ("explorer_logp": that
    μ, so TIS/MIS weight them as off-policy; "none": π_old, IS weight 1). The engines are never
    synced and must share the policy's tokenizer (checked before training).
    """

    share: float = 1.0  # α_0: the explorer's share of a group at the first step
    mix_steps: int = 8  # T_mix: steps with explorer samples (α reaches 0 at step T_mix; <= 1: none)
    schedule: str = "s2l_po"  # registered in mcore_rl.algos as an "explorer_schedule"
    # what the mismatch correction sees as μ of explorer samples
    correction: Literal["explorer_logp", "none"] = "explorer_logp"

    @property
    def enabled(self) -> bool:
        return bool(self.urls or self.model_path)


SECTION = Section(RolloutConfig, "explorer", ExplorerConfig, help="S2L-PO's smaller model (off by default)")
