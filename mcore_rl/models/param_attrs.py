"""The attributes megatron-core (and this package) set on parameters at runtime, typed.

megatron-core marks parameters with plain attributes (`partition_dim`, `sequence_parallel`,
`main_grad`, ...) that `torch.nn.Parameter` does not declare. `megatron_attrs(p)` is `p` itself,
seen through a protocol that declares them, so reads and writes are type-checked; it does nothing
at runtime. Only torch here: `convert` and `models` both use it.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch


class MegatronParamAttrs(Protocol):
    partition_dim: int  # set by set_tensor_model_parallel_attributes
    sequence_parallel: bool  # partial grads under SP, summed over TP by finalize_model_grads
    data_parallel_sharded: bool  # ngram tables sharded over DP (models/ngram_embedding.py)
    main_grad: torch.Tensor  # megatron DDP's gradient buffer
    grad_added_to_main_grad: bool
    _main_grad_hooked: bool


def megatron_attrs(param: torch.Tensor) -> MegatronParamAttrs:
    """`param` itself, typed with megatron-core's dynamic parameter attributes."""
    return cast(MegatronParamAttrs, param)
