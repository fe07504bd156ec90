"""Rules of the mixed dense/MoE layer pattern, and of the `model.*` keys a model family owns.

They mirror what megatron-core's `TransformerConfig` and its router accept, and what the reference
model computes the same way. A family's own keys (its section, `model_keys.FAMILY_SECTIONS`) are
checked by its bundle (`ModelFamily.check_model`, docs/model_families.md), for every config: a model
of another arch must leave them at their defaults.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mcore_rl.config.model_keys import FAMILY_SECTIONS
from mcore_rl.config.model_keys.moe import MoEKeys
from mcore_rl.config.schema import DECODER_ARCHS, ModelConfig, ParallelConfig

if TYPE_CHECKING:
    from mcore_rl.config.rules import Errors


def check_mixed_moe(m: ModelConfig, errors: Errors) -> None:
    """Layer pattern, and each registered family's keys (its router, its attention, ...)."""
    check_moe_layer_pattern(m, errors)
    if m.arch in DECODER_ARCHS and all(m.section(s.cls) == s.cls() for s in FAMILY_SECTIONS):
        return  # no family's key is set: nothing of theirs to check, and no bundle to import
    # imported here: mcore_rl.hf loads torch and transformers, which the config tree alone does not need
    from mcore_rl.hf.families import FAMILIES

    for section in FAMILY_SECTIONS:  # a family's key off its default needs its arch, or one built on it
        owner: str = section.cls.family  # type: ignore[attr-defined]  # a ClassVar of every family's section
        owners = [f.name for f in FAMILIES if owner in (f.name, f.builds_on)]
        value: object = m.section(section.cls)
        default: object = section.cls()
        for key, name in section.yaml_keys().items():
            errors.need(
                getattr(value, name) == getattr(default, name) or m.arch in owners,
                f"model.{key}",
                f"is {getattr(value, name)} but needs model.arch={' or '.join(owners)} (arch is {m.arch!r})",
            )
    for family in FAMILIES:
        family.check_model(m, errors)


def check_family_layout(m: ModelConfig, p: ParallelConfig, errors: Errors) -> None:
    """The layout rules of every MoE model (`check_expert_gradient_reduction`), then those of the
    model's family (`ModelFamily.check_parallel`), if its arch is one."""
    check_expert_gradient_reduction(p, errors)
    if m.arch in DECODER_ARCHS:
        return
    # imported here: mcore_rl.hf loads torch and transformers, which the config tree alone does not need
    from mcore_rl.hf.families import family_named

    family = family_named(m.arch)
    if family is not None:
        family.check_parallel(m, p, errors)


def check_expert_gradient_reduction(p: ParallelConfig, errors: Errors) -> None:
    """Without expert parallelism, the expert-TP size must be the TP size.

    megatron-core 0.16.1 marks an expert's weights `allreduce` (reduced like dense weights, over the
    data-parallel group) whenever expert_model_parallel_size is 1 (`experts.py`,
    `tensor_parallel/layers.py`: `allreduce = not expert_parallel`). That group is the expert
    data-parallel one only when ETP == TP: with ETP < TP, each TP rank's experts see only its slice
    of the sequence (sequence parallelism) and the expert data-parallel group spans the TP ranks,
    but the gradients are summed over the data-parallel group, which does not - every expert
    gradient comes out as one rank's share (measured: TP=2 x ETP=1 x EP=1 on two ranks, Qwen3-MoE,
    expert gradients about half the reference's, loss equal; `tests/test_parity.py`). With EP > 1
    they are reduced over the expert data-parallel group and match."""
    etp = p.expert_tensor_parallel_size
    tp = p.tensor_model_parallel_size
    errors.need(
        p.expert_model_parallel_size > 1 or etp is None or etp == tp,
        "parallel.expert_tensor_parallel_size",
        f"is {etp} but tensor_model_parallel_size is {tp} with expert_model_parallel_size 1: megatron-core "
        "0.16.1 then reduces expert gradients over the data-parallel group only, missing the other TP ranks' "
        "tokens; use expert_model_parallel_size > 1 or expert_tensor_parallel_size = tensor_model_parallel_size",
    )


def check_moe_layer_pattern(m: ModelConfig, errors: Errors) -> None:
    pattern = m.section(MoEKeys).moe_layer_pattern
    if pattern is None:
        return
    key = "model.moe_layer_pattern"
    if not errors.need(
        m.is_moe,
        key,
        f"is {pattern} but the model is dense (arch {m.arch!r}); a per-layer MoE pattern needs an MoE arch",
    ):
        return
    errors.need(
        len(pattern) == m.num_layers,
        key,
        f"has {len(pattern)} entries but num_layers is {m.num_layers} (one 0/1 per layer)",
    )
    errors.need(all(p in (0, 1) for p in pattern), key, f"entries must be 0 (dense) or 1 (MoE), got {pattern}")
    errors.need(any(p == 1 for p in pattern), key, f"{pattern} has no MoE layer; use a dense arch instead")
