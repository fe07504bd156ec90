"""LatentMoE (arXiv:2601.18089) on megatron-core's MoE layer.

megatron-core 0.16.1 already threads `TransformerConfig.moe_latent_size` through its MoE layer:
`MoELayer.preprocess` applies `fc1_latent_proj` (W_down, d -> l) to the tokens *before*
`dispatch_preprocess`, so the alltoall (or allgather) dispatcher permutes and sends l-wide rows;
routed experts (`MLP(is_expert=True)`) are built with input/output size l; `postprocess` applies
`fc2_latent_proj` (W_up, l -> d) after `combine_postprocess`, before the shared experts' full-width
output is added. The router reads the full-width input (`route` runs before `preprocess`).

What it lacks is a projection without transformer-engine: it builds both projections as
`TELinear(parallel_mode="duplicated")` and asserts TE is importable. So the LatentMoE layer here
*is* megatron-core's `MoELayer` (the spec is unchanged; `with_latent_moe` is the hook in
`spec.py`); without TE, `install_local_projections` lets it build them as `LatentProjection`, a
plain linear with TELinear's "duplicated" semantics:

- the full [out, in] weight on every tensor-parallel rank (no TP split: l is small, and with
  sequence parallelism each TP rank projects its own slice of tokens);
- initialised from the data-parallel RNG stream, identical on all TP/EP ranks;
- `param.sequence_parallel = config.sequence_parallel`, so `finalize_model_grads` sums the
  gradient over TP ranks under SP (each rank saw only its slice of the sequence);
- checkpointed as a replicated tensor (the router's treatment).

Expert-TP splits each expert's intermediate size m, which l does not touch; EP, TP/SP and PP need
nothing else. With TE installed the stock `TELinear` is used unchanged.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe import moe_layer
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_tensor_model_parallel_group_if_none

from mcore_rl.models.param_attrs import megatron_attrs


@contextlib.contextmanager
def _quiet_cpu_fork() -> Iterator[None]:
    """On CPU the RNG tracker's streams *are* CPU generator states, so its fork always logs
    "CPU RNG state changed within GPU RNG context"; that is expected there, not a bug."""
    if torch.cuda.is_available():
        yield
        return
    log = logging.getLogger(get_cuda_rng_tracker.__module__)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


class LatentProjection(MegatronModule):
    """A linear layer duplicated on every TP rank: TELinear(parallel_mode="duplicated") without TE.

    Takes TELinear's constructor arguments and returns `(output, bias_or_None)` like it.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: str | None,
        config: TransformerConfig,
        init_method: Callable[[torch.Tensor], Any],
        bias: bool,
        skip_bias_add: bool,
        skip_weight_param_allocation: bool = False,
        is_expert: bool = False,
        tp_group: torch.distributed.ProcessGroup | None = None,
        **_unused: Any,
    ) -> None:
        if parallel_mode != "duplicated" or is_expert or skip_weight_param_allocation:
            raise ValueError("LatentProjection only implements TELinear's non-expert 'duplicated' mode")
        super().__init__(config)
        self.skip_bias_add = skip_bias_add
        # For the default (replicated) sharded_state_dict of MegatronModule.
        self.tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        on_gpu = torch.cuda.is_available() and not config.use_cpu_initialization
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype, device=device))
        self.bias = (
            torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype, device=device)) if bias else None
        )
        if config.perform_initialization:
            with _quiet_cpu_fork(), get_cuda_rng_tracker().fork(get_data_parallel_rng_tracker_name()):
                init_method(self.weight)
        for param in (self.weight, self.bias):
            if param is not None:
                megatron_attrs(param).sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.skip_bias_add:
            return F.linear(x, self.weight), self.bias
        return F.linear(x, self.weight, self.bias), None


def install_local_projections() -> None:
    """Let megatron-core's `MoELayer` build its latent projections without transformer-engine.

    `MoELayer.__init__` reads the module globals `HAVE_TE` and `TELinear` of `moe_layer` only for
    the latent projections (and for fp8/fp4 recomputation, which needs TE anyway). Without TE we
    point them at `LatentProjection`; with TE nothing changes. Idempotent. The spec keeps the
    stock `MoELayer` class, because megatron-core's `TransformerLayer` hands its process groups
    only to an MoE layer whose spec module *is* `MoELayer`.
    """
    if getattr(moe_layer, "TELinear", None) is LatentProjection:
        return
    if moe_layer.HAVE_TE:
        return
    moe_layer.TELinear = LatentProjection
    moe_layer.HAVE_TE = True


def with_latent_moe(layer_spec: ModuleSpec, config: TransformerConfig) -> ModuleSpec:
    """The decoder layer spec for `config`: unchanged, but checked and made buildable for LatentMoE.

    With `config.moe_latent_size` set, megatron-core's MoE layer in the spec is the LatentMoE
    layer (see the module doc); this makes sure it can be built here.
    """
    if not config.moe_latent_size:
        return layer_spec
    mlp = layer_spec.submodules.mlp
    if not (isinstance(mlp, ModuleSpec) and isinstance(mlp.module, type) and issubclass(mlp.module, MoELayer)):
        raise ValueError("moe_latent_size needs an MoE model (num_moe_experts > 0)")
    install_local_projections()
    return layer_spec
