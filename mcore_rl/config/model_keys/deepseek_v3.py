"""DeepSeek-V3's keys (`hf/deepseek_v3.py`, which checks them, and `models/deepseek_v3.py`): its
sigmoid router with expert bias and grouped top-k, multi-head latent attention, and the MTP layers
carried through conversion."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from mcore_rl.config.schema import ModelConfig
from mcore_rl.config.sections import Section


@dataclass
class DeepSeekV3Keys:
    """DeepSeek-V3's router and multi-head latent attention (docs/deepseek_v3.md)."""

    family: ClassVar[str] = "deepseek_v3"  # the `hf/families.py` family whose bundle checks these keys

    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"  # sigmoid: DeepSeek-V3
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing (e_score_correction_bias)
    moe_router_bias_update_rate: float = 1e-3  # bias step per optimizer update, toward balance
    moe_router_num_groups: int | None = None  # grouped top-k: experts in groups (n_group)
    moe_router_group_topk: int | None = None  # ... of which this many are searched (topk_group)
    moe_router_topk_scaling_factor: float | None = None  # routed_scaling_factor; None = 1
    # Multi-head latent attention (DeepSeek-V2/V3); q_lora_rank None = full-rank query projection
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # MLA: low-rank query projection's rank
    kv_lora_rank: int = 32  # MLA: rank of the compressed key/value projection
    qk_head_dim: int = 16  # per-head query/key part without RoPE (HF qk_nope_head_dim)
    qk_pos_emb_head_dim: int = 8  # per-head RoPE part, key shared by all heads (HF qk_rope_head_dim)
    v_head_dim: int = 16  # MLA: per-head value size
    # DeepSeek-V3's multi-token-prediction layers (HF num_nextn_predict_layers): their tensors are
    # carried through conversion unchanged, not built or trained here (docs/deepseek_v3.md)
    mtp_num_layers_carried: int = 0


SECTION = Section(ModelConfig, "", DeepSeekV3Keys, flat=True)
