"""LatentMoE's key (`hf/latent_moe.py`, `models/latent_moe.py`): `model.moe_latent_size`."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.config.schema import ModelConfig
from mcore_rl.config.sections import Section


@dataclass
class LatentMoEKeys:
    """LatentMoE (arXiv:2601.18089): routed experts that work in a latent space."""

    # the latent size l: W_down d->l, experts in l, W_up l->d; None = ordinary MoE. Router and shared
    # experts stay full width.
    moe_latent_size: int | None = None


SECTION = Section(ModelConfig, "", LatentMoEKeys, flat=True)
