"""MoE's keys (the shared MoE of `hf/layers.py` and `models/spec.py`): `model.num_experts`, `model.moe_*`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mcore_rl.config.schema import ModelConfig
from mcore_rl.config.sections import Section


@dataclass
class MoEKeys:
    """Routed experts in the MLPs (used when `model.is_moe`: arch qwen3_moe or a MoE family)."""

    num_experts: int = 0  # routed experts per MoE layer (0 = dense MLPs)
    moe_router_topk: int = 2  # experts per token
    moe_ffn_hidden_size: int | None = None  # per-expert intermediate size; None = ffn_hidden_size
    moe_shared_expert_intermediate_size: int | None = None  # None = no shared expert
    moe_aux_loss_coeff: float = 0.0  # load-balancing aux loss weight (0 = off)
    moe_norm_topk_prob: bool = True  # renormalise the top-k probabilities (Qwen3-MoE default)
    # megatron-core's token dispatcher across expert-parallel ranks
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    moe_shared_expert_gate: bool = False  # Qwen2-MoE: shared expert output x sigmoid(x . w_gate), w_gate [1, hidden]
    # Mixed dense/MoE layers (docs/deepseek_v3.md): one entry per layer, 1 = MoE MLP, 0 = dense MLP of
    # ffn_hidden_size; None = every layer MoE.
    moe_layer_pattern: list[int] | None = None


SECTION = Section(ModelConfig, "", MoEKeys, flat=True)
