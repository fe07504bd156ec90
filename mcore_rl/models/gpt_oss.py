"""megatron-core settings of the GPT-OSS family (`MEGATRON`, found through `hf/gpt_oss.py`).

Everything GPT-OSS needs is a `TransformerConfig` field of megatron-core 0.16.1, and its local
(no transformer-engine) path computes each: learned sinks (`softmax_type="learnable"`: the local
`DotProductAttention` keeps one `softmax_offset` logit per head of its rank and applies it with
`SoftmaxOne`), a window on some layers (`window_size` with `window_attn_skip_freq` as a per-layer
list, 1 = windowed; `models/sliding_window.py` keeps the packed-document mask there), biases on
every linear (`add_bias_linear`: q/k/v, the output projection, the router, both expert linears; an
expert's second bias is scaled by its routing probability, as stock does), and the clamped SwiGLU
(`activation_func=quick_gelu` = x * sigmoid(1.702 x) on the clamped gate, times the clamped up
projection plus `glu_linear_offset` 1). YaRN is `models/rope_scaling.py`'s, as for the GQA decoder.

One gap: the sink logits are split over TP ranks by head, but megatron-core 0.16.1 marks them as
an ordinary replicated parameter; `SinkDotProductAttention` marks them TP-split along dim 0 so
that `models/shards.py` gathers and scatters them like the heads they belong to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_tensor_model_parallel_group_if_none

from mcore_rl.config.model_keys.gpt_oss import GptOssKeys
from mcore_rl.config.schema import ModelConfig
from mcore_rl.models import rope_scaling
from mcore_rl.models.family import MegatronFamily
from mcore_rl.models.param_attrs import megatron_attrs


def transformer_config(model: ModelConfig) -> tuple[type[TransformerConfig], dict[str, Any]]:
    """The GQA decoder's config class (with YaRN's fields for YaRN) and GPT-OSS's fields."""
    k = model.section(GptOssKeys)
    pattern = k.sliding_window_pattern
    return rope_scaling.transformer_config_class(model), dict(
        softmax_type="learnable" if k.attention_sinks else "vanilla",
        add_bias_linear=k.linear_biases,
        gated_linear_unit=True,
        activation_func=quick_gelu,
        glu_linear_offset=1.0,
        activation_func_clamp_value=k.swiglu_limit,
        window_attn_skip_freq=None if pattern is None else [int(p) for p in pattern],
    )


def moe_kwargs(model: ModelConfig) -> dict[str, Any]:
    """GPT-OSS routes as megatron-core's `TopKRouter` does (top-k logits, softmax over them)."""
    return {}


class SinkDotProductAttention(DotProductAttention):
    """megatron-core's local attention, its per-head sink logits marked TP-split along dim 0."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.config.softmax_type == "learnable":
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)


_expert_bias_fix = False


def use_expert_biases() -> None:
    """Let an expert's output bias train under sequence parallelism with one expert-TP rank (the
    only expert-TP size megatron-core 0.16.1 builds expert biases for).

    megatron-core 0.16.1 adds an expert MLP's second bias, scaled by the routing probability, in
    place to the output of `linear_fc2` (`MLP.forward`: `output += bias * probs`). Over an expert-TP
    group of one rank that output is the reduction's input (`reduce_from_tensor_model_parallel_region`,
    or `reduce_scatter_to_sequence_parallel_region` with sequence parallelism) returned as-is from a
    custom autograd Function, which autograd refuses to modify in place ("Output 0 of
    _ReduceFromModelParallelRegion is a view and is being modified inplace"): the reductions return
    a copy over one rank (nothing is communicated)."""
    global _expert_bias_fix
    if _expert_bias_fix:
        return
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer.moe import experts

    for name in ("reduce_scatter_to_sequence_parallel_region", "reduce_from_tensor_model_parallel_region"):
        setattr(layers, name, _copy_over_one_rank(getattr(layers, name)))
    experts.SequentialMLP.__init__ = _without_sequence_parallel_bias(experts.SequentialMLP.__init__)
    _expert_bias_fix = True


def _copy_over_one_rank(reduce: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """A reduction of `RowParallelLinear`'s output that returns a copy over a one-rank group."""

    def reduced(input_: Tensor, group: Any = None, **kwargs: Any) -> Tensor:
        out = reduce(input_, group=group, **kwargs)
        return out.clone() if get_tensor_model_parallel_group_if_none(group).size() == 1 else out

    return reduced


def _without_sequence_parallel_bias(init: Callable[..., None]) -> Callable[..., None]:
    """`SequentialMLP.__init__`, then each expert's output bias unmarked as sequence parallel.

    megatron-core 0.16.1 marks it so (it is a `RowParallelLinear` bias), and `finalize_model_grads`
    then sums its gradient over the tensor-parallel group, as for a replicated weight whose
    gradient each rank holds for its slice of the sequence. An expert's gradient is already whole
    on its rank (its tokens come from every rank of the expert group, and the expert-data-parallel
    all-reduce adds the rest); with EP > 1 the tensor-parallel neighbours even hold other experts,
    whose biases' gradients it would add (TP=2 x EP=2 gradients differed from the reference)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        for expert in self.local_experts:
            bias = expert.linear_fc2.bias
            if bias is not None:
                megatron_attrs(bias).sequence_parallel = False

    return __init__


def local_attention_submodules(qk_norm: type) -> dict[str, type | ModuleSpec]:
    """The local spec's attention with sinks that shard with their heads (no QK-norm: `qk_norm` is
    the spec's identity); called once per spec, it also installs `use_expert_biases`."""
    use_expert_biases()
    return dict(q_layernorm=qk_norm, k_layernorm=qk_norm, core_attention=SinkDotProductAttention)


# transformer-engine computes attention sinks (`softmax_type="learnable"`) from 2.8 on
TE_MIN_VERSION_FOR_SINKS = "2.8.0"


def te_attention_submodules() -> dict[str, type | ModuleSpec]:
    """The TE spec's attention with TE's fused kernels for the sinks (transformer-engine >= 2.8; an
    older one is refused naming the version), the sinks marked TP-split as on the local path; it
    also installs `use_expert_biases`, which the TE spec's experts (`SequentialMLP`, no grouped GEMM)
    need as the local ones do. Written for the GPU path and `gpu`-marked in the tests (the TE parity
    row of tools/gpu_check.py); transformer-engine is not installed where the CPU suite runs."""
    from megatron.core.utils import get_te_version, is_te_min_version

    if not is_te_min_version(TE_MIN_VERSION_FOR_SINKS):
        raise ValueError(
            f"model.attention_sinks: transformer-engine {get_te_version()} has no attention sinks; "
            f"GPT-OSS needs transformer-engine >= {TE_MIN_VERSION_FOR_SINKS} (or none: the local spec computes them)"
        )
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    class TESinkDotProductAttention(TEDotProductAttention):
        """transformer-engine's attention, its per-head sink logits marked TP-split along dim 0."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.config.softmax_type == "learnable":
                set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)

    use_expert_biases()
    return dict(core_attention=TESinkDotProductAttention)


MEGATRON = MegatronFamily(
    transformer_config=transformer_config,
    moe_kwargs=moe_kwargs,
    layer_spec_kwargs={},
    local_attention_submodules=local_attention_submodules,
    te_attention_submodules=te_attention_submodules,
)
