"""The MTP draft heads' keys (`hf/mtp.py`, `models/mtp.py`): `model.mtp_num_layers`."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.config.schema import ModelConfig
from mcore_rl.config.sections import Section


@dataclass
class MTPKeys:
    """Multi-token prediction heads (DeepSeek-V3, arXiv:2412.19437) trained as speculative drafts."""

    # D MTP layers after the decoder, each one decoder layer of the model's kind; 0 = none. Depth d
    # predicts the token d + 1 positions ahead; the embedded engine drafts with them (MTP drafter).
    mtp_num_layers: int = 0


SECTION = Section(ModelConfig, "", MTPKeys, flat=True)
