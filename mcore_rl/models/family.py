"""The megatron-core half of a model family: what it changes in `TransformerConfig` and the layer spec.

A family's `hf/<family>.py` record (`hf/family.py: ModelFamily`) names its megatron-core module
(`ModelFamily.megatron`, `models/<family>.py`), which ends in `MEGATRON = MegatronFamily(...)`. It is
found by name because `hf/` imports no megatron; the builder and the spec ask `megatron_family`
and name no family.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_rl.config.schema import ModelConfig
from mcore_rl.hf.families import family_named


@dataclass(frozen=True)
class MegatronFamily:
    """One family's megatron-core settings, each called by `models/builder.py` or `models/spec.py`."""

    # the TransformerConfig class and the fields the family adds to it
    transformer_config: Callable[[ModelConfig], tuple[type[TransformerConfig], dict[str, Any]]]
    # MoE fields of TransformerConfig beyond the GQA decoder's (its router)
    moe_kwargs: Callable[[ModelConfig], dict[str, Any]]
    # keyword arguments of megatron-core's `get_gpt_layer_*_spec` (e.g. its attention's flag)
    layer_spec_kwargs: dict[str, Any]
    # the local (no transformer-engine) spec's self-attention submodules to replace, given the
    # QK-norm class; called once per spec, so it may also patch megatron-core for the local path
    local_attention_submodules: Callable[[type], dict[str, type | ModuleSpec]]
    # the transformer-engine spec's self-attention submodules to replace (None: TE's as they are);
    # called once per spec, so it may also check the TE version and patch megatron-core
    te_attention_submodules: Callable[[], dict[str, type | ModuleSpec]] | None = None
    # the MoE layers' router class (megatron-core's `TopKRouter` when None)
    router: type[TopKRouter] | None = None
    # the family's attention builds its RoPE (plain or scaled) from its TransformerConfig fields, so
    # GPTModel builds none and `models/rope_scaling.py` adds nothing
    rope_in_attention: bool = False


def megatron_family(model: ModelConfig) -> MegatronFamily | None:
    """The megatron-core half of `model.arch`'s family; None for the GQA decoder's archs."""
    family = family_named(model.arch)
    if family is None or not family.megatron:
        return None
    record: MegatronFamily = importlib.import_module(family.megatron).MEGATRON
    return record
