"""MIPU's Step 2 keys (`recipes/mipu.py`): `algorithm.mismatch.mipu_*`, beside the correction's own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mcore_rl.config.rl_schema import MismatchCorrectionConfig
from mcore_rl.config.sections import Section


@dataclass
class MIPUConfig:
    """MIPU Step 2: accept or reject each update after its weight sync, on a validation batch."""

    validation_prompts: int = 8  # prompts of the validation batch (G samples each)
    c_start: float = 1e-3  # MIPU: tolerance c of the accept test at the first decision
    c_end: float = 0.0  # MIPU: c after annealing
    anneal_steps: int = 100  # MIPU: decisions over which c anneals from start to end
    count_rejected: bool = True  # MIPU: rejected updates advance the annealing clock too
    # MIPU Step 2's noise (docs/mismatch_correction.md): validation group size, decision rule, logged flip rate
    validation_group_size: int | None = None  # samples per validation prompt (null: rollout.group_size)
    decision: Literal["plain", "se"] = "plain"  # plain: T̂ ≥ -c (the paper); se: T̂ ≥ -c - z·SE
    z: float = 2.0  # the "se" rule's number of standard errors
    bootstrap: int = 200  # group-bootstrap resamples for the logged flip rate (0: off)

    def validation_prompts_needed(self) -> int:
        """The validation stream holds at least this many prompts (drawn whether MIPU is on or not)."""
        return self.validation_prompts


SECTION = Section(MismatchCorrectionConfig, "mipu_", MIPUConfig, flat=True)
