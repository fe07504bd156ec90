"""RMSNorm for megatron-core specs that, unlike `WrappedTorchNorm`, accepts sequence parallelism.

Under sequence parallelism each tensor-parallel rank normalises a different slice of tokens, so
the weight's gradient is partial on each rank; marking the weight `sequence_parallel` makes
megatron-core's `finalize_model_grads` sum it across the tensor-parallel group. That is all a norm
needs to support SP — the per-token computation is unchanged.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from mcore_rl.models.param_attrs import megatron_attrs


class RMSNorm(torch.nn.Module):
    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-6,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ) -> None:
        super().__init__()
        if normalization != "RMSNorm" or zero_centered_gamma:
            raise ValueError("mcore_rl RMSNorm supports plain RMSNorm only")
        self.eps = eps
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=_init_device(config))
        )
        megatron_attrs(self.weight).sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as the reference model (mcore_rl.hf): normalise in fp32, cast, scale.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _init_device(config: TransformerConfig) -> torch.device:
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
