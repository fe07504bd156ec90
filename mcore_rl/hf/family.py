"""What a model family brings to the shared reference model, its HF configs and its weight names.

The shared code (`configuration.py`, `modeling.py`, `weight_map.py`, the converter) handles the GQA
decoder every family here starts from: Qwen3 / Qwen3-MoE, with Llama 3, Qwen2 / Qwen2-MoE and
Mistral as fields of it (no QK-norm, q/k/v biases, a gated shared expert, a sliding window). A
family that differs in more than fields (its own attention, router or weight names) is one module
that fills a `ModelFamily` and is listed once in `families.py: FAMILIES`; the shared code asks the
family of a config for those parts and names no family. `docs/model_families.md` walks through one.

Part of the remote-code modeling files (imports only the standard library).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Callables take HF configs (ours or stock) and `ModelConfig`s as `Any`: this file is also remote
# code, where neither `mcore_rl` nor every stock config class can be imported.
HFConfig = Any
ModelConfigT = Any
Errors = Any  # mcore_rl.config.rules.Errors: `need(ok, key, message)` records a config error
Tensor = Any  # torch.Tensor; not imported so this record stays importable without torch


def _no_checks(model: ModelConfigT, errors: Errors) -> None:
    """A family without `model.*` keys of its own has nothing to check."""


def _no_layout_checks(model: ModelConfigT, parallel: Any, errors: Errors) -> None:
    """A family that megatron-core lays out like the GQA decoder has no layout rule of its own."""


@dataclass(frozen=True)
class ModelFamily:
    """One family's parts, each called by the shared code where the family differs from the GQA decoder.

    `name` is both `McoreRLConfig.family` and `ModelConfig.arch`; `stock_model_type` /
    `stock_class` the transformers family it converts from and exports to.
    """

    name: str
    stock_model_type: str
    stock_class: str
    # our HF config (configuration.py): the family's own fields with their defaults, and what it
    # derives from them once they are set
    config_fields: dict[str, Any]
    configure: Callable[[HFConfig], None]
    # HF config <-> ModelConfig (configuration.py)
    num_experts: Callable[[HFConfig], int]  # routed experts of an HF config (ours or stock)
    model_fields: Callable[[HFConfig], dict[str, Any]]  # ModelConfig fields beyond the GQA decoder's
    hf_fields: Callable[[ModelConfigT], dict[str, Any]]  # McoreRLConfig fields beyond the GQA decoder's
    moe_layer_pattern: Callable[[HFConfig], list[int]]  # of a stock config: 1 = MoE layer
    to_stock: Callable[[HFConfig], Any]  # the stock transformers config of our config
    unsupported: Callable[[HFConfig], list[str]]  # `field=value: reason` lines of a stock config
    # reference modeling (modeling.py): modules built from our config; attention None = the GQA
    # decoder's (`ReferenceAttention`, its weight names and megatron-core's GQA)
    attention: Callable[[HFConfig], Any] | None
    moe_block: Callable[[HFConfig], Any]
    stock_experts_fused: Callable[[HFConfig], bool]  # the installed stock class keeps experts fused
    # weight names (weight_map.py): one layer's megatron global name <-> HF names
    megatron_to_hf: Callable[[str, str, Tensor, ModelConfigT], list[tuple[str, Tensor]] | None]
    hf_to_megatron: Callable[[dict[str, Tensor], str, str, ModelConfigT, bool], dict[str, Tensor]]
    # export (convert/to_hf.py): tensors the stock class keeps in fp32 whatever the model's dtype
    fp32_tensors: tuple[str, ...] = ()
    # `ModelConfig` (config/moe_rules.py): the rules of the `model.*` keys the family owns (its section,
    # declared in config/model_keys/<family>.py and registered in its FAMILY_SECTIONS, where the loader
    # finds them without importing the bundle), run on every config: a model of another arch must
    # leave them at their defaults
    check_model: Callable[[ModelConfigT, Errors], None] = _no_checks
    # its rules on the `parallel:` layout (config/rules.py: check_expert_parallel), for its own arch
    check_parallel: Callable[[ModelConfigT, Any, Errors], None] = _no_layout_checks
    # FLOPs (models/flops.py) of one layer's attention for one token attending to `context` keys:
    # (projections, scores); None = the GQA decoder's count
    attention_flops: Callable[[ModelConfigT, float], tuple[float, float]] | None = None
    # parameters one rank holds of a layer (`mcore-rl profile`, profile/memory.py), where they differ
    # from the GQA decoder's: the attention's (megatron name within the layer, numel at TP `tp`),
    # replacing the decoder's q/k/v, output projection and QK-norms; None = the GQA decoder's
    attention_params: Callable[[ModelConfigT, int], list[tuple[str, int]]] | None = None
    # ... and what an MoE layer adds to the router and experts at expert-TP `etp`: (name within the
    # layer, or within one expert when the flag is set, numel); None = nothing
    moe_extra_params: Callable[[ModelConfigT, int], list[tuple[str, int, bool]]] | None = None
    # the family's attention has q/k/v/o biases: a stock config's `attention_bias=true` is taken
    attention_bias: bool = False
    # which layers `model.sliding_window` applies to (FLOPs of the attended context); None = every layer
    windowed_layers: Callable[[ModelConfigT], list[bool]] | None = None
    # model types whose config.json is this family's stock config under another name (read as it)
    config_aliases: tuple[str, ...] = ()
    # expert tensors the stock checkpoint stacks over the experts (`mlp.experts.<name>` [E, ...]) and
    # ours keeps per expert (`mlp.experts.{j}.<name>`, one HF name per megatron expert tensor)
    stacked_expert_tensors: tuple[str, ...] = ()
    # one megatron layer tensor (`rest` within the layer of HF prefix `prefix`) from the whole HF
    # tensors `read` returns by name, for the streaming importer, where the HF layout is not the
    # megatron one cut by rows (transposed, interleaved); None = the shared way (row slices)
    megatron_from_hf: Callable[[str, str, Callable[[str], Tensor], ModelConfigT], Tensor | None] | None = None
    # the module of the megatron-core half (models/<family>.py, its `MEGATRON` record:
    # models/family.py), found by name because hf/ imports no megatron; "" = none
    megatron: str = ""
    # the family whose parts (router, MoE block, weight names, `model.*` keys) this one reuses; its
    # two modules may then name that family and share its keys ("" = none)
    builds_on: str = ""
    # its stock configs may rotate a share of each head (`partial_rotary_factor` < 1)
    partial_rotary: bool = False


@dataclass(frozen=True)
class StockDecoder:
    """A stock `transformers` model type that is the GQA decoder with some fields set (Llama,
    Qwen2, Mistral, ...): what its config implies where it is silent, and the class it exports to.
    They differ in fields only, so they share one module (`stock_decoders.py`) and no code."""

    model_type: str
    stock_class: str
    qk_norm: bool  # the stock class always (Qwen3) or never (Llama, Qwen2, Mistral) has QK-norm
    qkv_bias: bool = False  # q/k/v biases without a `qkv_bias` field (Qwen2 always has them)
    shared_expert_gate: bool = False  # a gated shared expert without a `shared_expert_gate` field (Qwen2-MoE)
    windowed: bool = False  # its `sliding_window` is a window on every layer (Mistral)
    layer_pattern_keys: bool = False  # it writes the MoE layer pattern as decoder_sparse_step / mlp_only_layers
