"""AttnRes's keys (`hf/attn_res.py`, `models/attn_res.py`): `model.attn_res*`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mcore_rl.config.schema import ModelConfig
from mcore_rl.config.sections import Section


@dataclass
class AttnResKeys:
    """AttnRes (arXiv:2603.15031): attention over depth instead of residual sums."""

    attn_res: Literal["none", "full", "block"] = "none"  # none = plain residual sums
    attn_res_num_blocks: int = 8  # N for the Block variant


SECTION = Section(ModelConfig, "", AttnResKeys, flat=True)
