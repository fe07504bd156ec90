"""The DeepSeek-V3 family: multi-head latent attention and the sigmoid MoE of the reference model,
its HF config translation (stock `DeepseekV3Config` <-> `ModelConfig` <-> ours with
`family="deepseek_v3"`), what of a stock config it refuses, and its weight names; registered in
`families.py` as `FAMILY` (the megatron-core side is `mcore_rl/models/deepseek_v3.py`).

Part of the remote-code modeling files (imports only torch and its siblings). Parameter names are those
of stock `DeepseekV3ForCausalLM` checkpoints::

    model.layers.{i}.self_attn.q_proj.weight                          (q_lora_rank None)
    model.layers.{i}.self_attn.{q_a_proj,q_a_layernorm,q_b_proj}.weight (q_lora_rank set)
    model.layers.{i}.self_attn.{kv_a_proj_with_mqa,kv_a_layernorm,kv_b_proj,o_proj}.weight
    model.layers.{i}.mlp.gate.weight [E, hidden], model.layers.{i}.mlp.gate.e_score_correction_bias [E]
    model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight
    model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight

Routing is `route` (stock `DeepseekV3TopkRouter`'s arithmetic, which the megatron-core router of
`models/deepseek_v3.py` also calls): sigmoid scores; the expert bias is added only to choose the
experts; grouped top-k ranks each group by the sum of its best 2 biased scores and searches the
best `topk_group` groups; the chosen (unbiased) scores are renormalised when `norm_topk_prob` and
multiplied by `routed_scaling_factor`.

MLA caches the compressed latent per layer, as transformers does: the cache's (k, v) pair is
(normalised kv latent [b, 1, s, kv_lora_rank], rotated shared key [b, 1, s, qk_rope_head_dim]).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from .family import ModelFamily
from .layers import ReferenceMLP, ReferenceRMSNorm, RoutingTap, is_moe_layer, run_experts
from .rope import ROPE_KEYS, rope_scaling_of, rope_type_of, yarn_mscale

if TYPE_CHECKING:  # in a try block: transformers' remote-code import check skips it (no mcore_rl needed)
    try:
        from mcore_rl.config.model_keys.deepseek_v3 import DeepSeekV3Keys
        from mcore_rl.config.model_keys.moe import MoEKeys
        from mcore_rl.config.rules import Errors
        from mcore_rl.config.schema import ModelConfig
    except ImportError:
        pass


# DeepSeek-V3 ranks a group by the sum of its best two (biased) scores, whatever topk and topk_group
# (stock `DeepseekV3TopkRouter`; megatron-core's own `group_limited_topk` takes topk // topk_group).
GROUP_RANK_EXPERTS = 2


def grouped_topk(scores: torch.Tensor, topk: int, num_groups: int | None, group_topk: int | None) -> torch.Tensor:
    """Expert indices [T, k] of the top-k `scores` [T, E], limited to the best `group_topk` groups."""
    if not group_topk:
        return torch.topk(scores, topk, dim=-1).indices
    assert num_groups, "topk_group needs n_group"
    t, e = scores.shape
    grouped = scores.view(t, num_groups, e // num_groups)
    group_scores = grouped.topk(GROUP_RANK_EXPERTS, dim=-1).values.sum(-1)
    chosen = torch.topk(group_scores, group_topk, dim=-1, sorted=False).indices
    mask = torch.zeros_like(group_scores).scatter_(1, chosen, 1.0).bool()
    mask = mask[:, :, None].expand(t, num_groups, e // num_groups).reshape(t, e)
    return torch.topk(scores.masked_fill(~mask, float("-inf")), topk, dim=-1).indices


def route(
    logits: torch.Tensor,
    expert_bias: torch.Tensor | None,
    topk: int,
    num_groups: int | None,
    group_topk: int | None,
    norm_topk_prob: bool,
    scaling: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing of router logits [T, E]: (probs [T, k] fp32, expert ids [T, k]).

    Sigmoid scores; the expert bias is added only to choose the experts (grouped top-k); the chosen
    unbiased scores are renormalised when `norm_topk_prob` (also for k = 1, as stock does) and
    multiplied by `scaling`. The reference router and the megatron-core router
    (`models/deepseek_v3.py`) both call it, so the two route alike by construction."""
    scores = torch.sigmoid(logits.float())
    biased = scores if expert_bias is None else scores + expert_bias.float()
    idx = grouped_topk(biased, topk, num_groups, group_topk)
    probs = scores.gather(1, idx)
    if norm_topk_prob:
        probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    return probs * (scaling or 1.0), idx


class DeepseekV3ReferenceRouter(nn.Module):
    """`mlp.gate`: router weight and the selection-only expert bias, both fp32 (as stock keeps them)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.topk = config.num_experts_per_tok
        self.num_groups, self.group_topk = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.e_score_correction_bias: torch.Tensor
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts), persistent=True)

    def init_reference_weights(self, init: Any, std: float) -> None:
        """`McoreRLPreTrainedModel._init_weights`: the weight normal(0, std), the expert bias zero."""
        init.normal_(self.weight, mean=0.0, std=std)
        init.zeros_(self.e_score_correction_bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs [T, k] fp32, expert ids [T, k]) for tokens x [T, hidden]."""
        logits = F.linear(x.float(), self.weight.float())
        return route(
            logits,
            self.e_score_correction_bias,
            self.topk,
            self.num_groups,
            self.group_topk,
            self.norm_topk_prob,
            self.scaling,
        )


class DeepseekV3ReferenceMoeBlock(nn.Module):
    """Sigmoid router, routed experts and always-on shared experts: sum_k p_k * expert_k(x) + shared(x)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.gate = DeepseekV3ReferenceRouter(config)
        self.experts = nn.ModuleList(
            ReferenceMLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )
        shared = config.shared_expert_intermediate_size
        self.shared_experts = ReferenceMLP(config.hidden_size, shared) if shared else None
        self.routing = RoutingTap()  # the engine records the routed experts through it

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs, idx = self.gate(x)
        self.routing.routed = idx if self.routing.record else None
        out = run_experts(x, probs, idx, self.experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        # no auxiliary loss: balance comes from the expert bias (aux-loss-free)
        return out.reshape(shape), x.new_zeros((), dtype=torch.float32)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's RoPE on pairs (x0, x1), (x2, x3), ... (transformers' `apply_rotary_pos_emb_interleave`):
    the output holds the rotated even entries, then the rotated odd ones. x [b, h, s, d]; cos/sin
    [b, s, d] as `rope_cos_sin` makes them (cat(freqs, freqs))."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the rotate-half layout (first half / second half paired). x [b, h, s, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.unsqueeze(1) + torch.cat((-x2, x1), dim=-1) * sin.unsqueeze(1)


def softmax_scale(qk_head_size: int, scaling: dict[str, Any] | None) -> float:
    """MLA's softmax scale: 1 / sqrt(query-key head size), times m(factor, mscale_all_dim)^2 under
    YaRN (DeepSeek-V2's attention temperature; stock `yarn_apply_mscale`, megatron-core's
    `MLASelfAttention.softmax_scale`). The RoPE cos/sin carry YaRN's other factor (`rope.py`)."""
    scale = qk_head_size**-0.5
    if rope_type_of(scaling) == "yarn" and scaling is not None and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    return float(scale)


class MLAReferenceAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3): queries through an optional low-rank
    bottleneck, keys and values from one compressed latent plus a RoPE key shared by all heads."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.interleave = bool(getattr(config, "rope_interleave", True))
        q_out = self.num_heads * (self.nope + self.rope)
        eps = config.rms_norm_eps
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(h, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, self.q_lora_rank, bias=False)
            self.q_a_layernorm = ReferenceRMSNorm(self.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = ReferenceRMSNorm(self.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=False)
        self.softmax_scale = softmax_scale(self.nope + self.rope, rope_scaling_of(config))

    @property
    def cache_entry_width(self) -> int:
        """What the embedded engine's KV pool keeps per token and layer (rollout/engine/model_runner.py):
        cat(latent, k_rot), one entry all heads read."""
        return self.kv_lora_rank + self.rope

    def split_cache_entry(self, entry: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An engine cache entry [..., cache_entry_width] -> (latent, k_rot), as `attend` takes them."""
        latent, k_rot = entry.split([self.kv_lora_rank, self.rope], dim=-1)
        return latent, k_rot

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        q_pass, q_rot, latent, k_rot = self.project(x, cos, sin)
        if past is not None:
            latent, k_rot = torch.cat((past[0], latent), dim=2), torch.cat((past[1], k_rot), dim=2)
        present = (latent, k_rot)
        return self.attend(q_pass, q_rot, latent, k_rot, allowed), present

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [b, s, hidden] -> (q_pass, q_rot [b, heads, s, .], latent [b, 1, s, kv_lora_rank],
        k_rot [b, 1, s, qk_rope_head_dim]), RoPE applied: what the cache keeps is (latent, k_rot)."""
        b, s, _ = x.shape
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_pass, q_rot = q.view(b, s, self.num_heads, -1).transpose(1, 2).split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent).view(b, 1, s, self.kv_lora_rank)
        k_rot = k_rot.view(b, 1, s, self.rope)
        rope = rope_interleaved if self.interleave else rope_half
        return q_pass, rope(q_rot, cos, sin), latent, rope(k_rot, cos, sin)

    def attend(
        self,
        q_pass: torch.Tensor,
        q_rot: torch.Tensor,
        latent: torch.Tensor,
        k_rot: torch.Tensor,
        allowed: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of queries [b, heads, s, .] over the cached latents [b, 1, S, .] -> [b, s, hidden]."""
        b, _, s_k, _ = latent.shape
        kv = self.kv_b_proj(latent).view(b, s_k, self.num_heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, self.num_heads, -1, -1)), dim=-1)
        q = torch.cat((q_pass, q_rot), dim=-1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
        return self.o_proj(out)


# ---- HF config <-> ModelConfig ------------------------------------------------------------------


# Our config's DeepSeek-V3 fields (stock `DeepseekV3Config`'s names) and their defaults.
CONFIG_FIELDS: dict[str, Any] = dict(
    n_group=None,
    topk_group=None,
    routed_scaling_factor=1.0,
    q_lora_rank=None,
    kv_lora_rank=None,
    qk_nope_head_dim=None,
    qk_rope_head_dim=None,
    v_head_dim=None,
    rope_interleave=True,
    num_nextn_predict_layers=0,  # MTP layers: carried by the converter, not computed (the reference ignores them)
)


def configure(cfg: Any) -> None:
    """The RoPE part of MLA's heads is what `rope_cos_sin` rotates."""
    cfg.head_dim = cfg.qk_rope_head_dim


def _stock(hf: Any) -> bool:
    return getattr(hf, "model_type", None) == "deepseek_v3"


def num_experts(hf: Any) -> int:
    return (hf.n_routed_experts if _stock(hf) else getattr(hf, "num_experts", 0)) or 0


def model_fields(hf: Any) -> dict[str, Any]:
    """ModelConfig fields of a DeepSeek-V3 config (stock `DeepseekV3Config` or ours with family deepseek_v3)."""
    stock = _stock(hf)
    shared = (hf.n_shared_experts or 0) * hf.moe_intermediate_size if stock else hf.shared_expert_intermediate_size
    return dict(
        arch="deepseek_v3",
        num_experts=num_experts(hf),
        num_query_groups=hf.num_attention_heads,  # MLA: every head has its own keys and values
        kv_channels=None,
        qk_layernorm=True,  # the latent q / kv RMSNorms
        moe_shared_expert_intermediate_size=shared or None,
        moe_aux_loss_coeff=0.0,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=hf.n_group,
        moe_router_group_topk=hf.topk_group,
        moe_router_topk_scaling_factor=float(hf.routed_scaling_factor),
        multi_latent_attention=True,
        q_lora_rank=hf.q_lora_rank,
        kv_lora_rank=hf.kv_lora_rank,
        qk_head_dim=hf.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim,
        mtp_num_layers_carried=int(getattr(hf, "num_nextn_predict_layers", 0) or 0),
    )


def _keys(mc: ModelConfig) -> tuple[DeepSeekV3Keys, MoEKeys]:
    """The family's and MoE's sections of a `ModelConfig` (read only on the trainer's side)."""
    try:  # here, in a try block: remote code loads without mcore_rl and must not import it
        from mcore_rl.config.model_keys.deepseek_v3 import DeepSeekV3Keys
        from mcore_rl.config.model_keys.moe import MoEKeys
    except ImportError as err:
        raise ImportError("reading a ModelConfig needs the mcore_rl package") from err
    return mc.section(DeepSeekV3Keys), mc.section(MoEKeys)


def hf_fields(mc: ModelConfig) -> dict[str, Any]:
    """Our HF config's DeepSeek-V3 fields (MLA, sigmoid router) of a `ModelConfig`."""
    k = _keys(mc)[0]
    return dict(
        family="deepseek_v3",
        n_group=k.moe_router_num_groups,
        topk_group=k.moe_router_group_topk,
        routed_scaling_factor=k.moe_router_topk_scaling_factor or 1.0,
        q_lora_rank=k.q_lora_rank,
        kv_lora_rank=k.kv_lora_rank,
        qk_nope_head_dim=k.qk_head_dim,
        qk_rope_head_dim=k.qk_pos_emb_head_dim,
        v_head_dim=k.v_head_dim,
        num_nextn_predict_layers=k.mtp_num_layers_carried,
    )


def moe_layer_pattern(hf: Any) -> list[int]:
    """Stock DeepSeek-V3: layer i is MoE iff i >= `first_k_dense_replace` and i % `moe_layer_freq` == 0."""
    k, freq = getattr(hf, "first_k_dense_replace", 0) or 0, getattr(hf, "moe_layer_freq", 1) or 1
    return [int(i >= k and i % freq == 0) for i in range(hf.num_hidden_layers)]


def first_k_dense(cfg: Any, stock: str) -> int:
    """`first_k_dense_replace` of our config's MoE layer pattern; another pattern raises, naming the
    `stock` config class that cannot express it."""
    pattern = [is_moe_layer(cfg, i) for i in range(cfg.num_hidden_layers)]
    first_k = pattern.index(True) if any(pattern) else len(pattern)
    if pattern != [False] * first_k + [True] * (len(pattern) - first_k):
        raise ValueError(
            f"MoE layer pattern {[int(p) for p in pattern]} is not first-k-dense; {stock} cannot express it"
        )
    return first_k


def to_stock(cfg: Any) -> Any:
    """A stock `DeepseekV3Config`; it has no per-layer pattern beyond first-k-dense, so others raise."""
    from transformers import DeepseekV3Config

    first_k = first_k_dense(cfg, "stock DeepseekV3Config")
    shared = cfg.shared_expert_intermediate_size
    if not shared or shared % cfg.moe_intermediate_size:
        raise ValueError("stock DeepSeek-V3 needs shared experts of n x moe_intermediate_size")
    if not cfg.n_group or not cfg.topk_group:
        raise ValueError("stock DeepSeek-V3 always routes in groups: needs n_group and topk_group (1 and 1 = none)")
    scaling = {k: v for k, v in (rope_scaling_of(cfg) or {}).items() if k != "rope_theta"}
    return DeepseekV3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        n_shared_experts=shared // cfg.moe_intermediate_size,
        n_routed_experts=cfg.num_experts,
        routed_scaling_factor=cfg.routed_scaling_factor,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        num_experts_per_tok=cfg.num_experts_per_tok,
        first_k_dense_replace=first_k,
        norm_topk_prob=cfg.norm_topk_prob,
        hidden_act=cfg.hidden_act,
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.initializer_range,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters={"rope_type": "default", **scaling, "rope_theta": cfg.rope_theta},
        rope_interleave=cfg.rope_interleave,
        attention_bias=False,
        num_mtp_layers=cfg.num_nextn_predict_layers,  # written as num_nextn_predict_layers (attribute_map)
    )


# The released checkpoints' quantization: FP8 (e4m3) weights with one fp32 `weight_scale_inv` per
# 128 x 128 block, which the converter dequantizes on import (`convert/fp8.py`).
FP8_BLOCK_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3"}


def unsupported(hf: Any) -> list[str]:
    """What of a stock DeepSeek-V3 config the reference and megatron-core models here cannot compute."""
    problems = []
    quantization = dict(getattr(hf, "quantization_config", None) or {})
    if quantization:
        block = quantization.get("weight_block_size")
        known = all(quantization.get(k, v) == v for k, v in FP8_BLOCK_QUANTIZATION.items())
        if not (known and isinstance(block, (list, tuple)) and len(block) == 2):
            problems.append(
                f"quantization_config={quantization}: only DeepSeek's block-scaled FP8 (quant_method "
                "'fp8', fmt 'e4m3', weight_block_size [rows, cols]) is dequantized on import"
            )
    if getattr(hf, "attention_bias", False):
        problems.append("attention_bias=true: DeepSeek-V3's projections here have no biases")
    problems += unsupported_groups(hf)
    if not hf.n_shared_experts:
        problems.append("n_shared_experts=0: DeepSeek-V3 without shared experts is not supported")
    if (hf.num_key_value_heads or hf.num_attention_heads) != hf.num_attention_heads:
        problems.append(f"num_key_value_heads={hf.num_key_value_heads}: MLA has one key/value per head")
    if getattr(hf, "rope_interleave", True) is not True:
        problems.append("rope_interleave=false: only DeepSeek's interleaved RoPE checkpoints are converted")
    for key in ROPE_KEYS:
        params = getattr(hf, key, None)
        kind = rope_type_of(params)
        if kind not in ("default", "yarn"):
            problems.append(
                f"{key}.rope_type={kind!r}: multi-head latent attention here takes plain RoPE or YaRN "
                "(megatron-core's MLA RoPE types)"
            )
        elif kind == "yarn" and params is not None:
            if params.get("attention_factor") is not None:
                problems.append(
                    f"{key}.attention_factor={params['attention_factor']}: megatron-core's MLA derives "
                    "YaRN's attention factor from factor, mscale and mscale_all_dim only"
                )
            if params.get("truncate", True) is not True:
                problems.append(f"{key}.truncate=false: megatron-core's MLA always rounds YaRN's ramp bounds")
        if kind != "default":
            break
    return problems


def unsupported_groups(hf: Any) -> list[str]:
    """The grouped top-k of a stock config (`n_group`, `topk_group`) that routing cannot run."""
    topk, groups, group_topk = hf.num_experts_per_tok, hf.n_group or 1, hf.topk_group or 1
    if (
        hf.n_routed_experts % groups
        or hf.n_routed_experts // groups < GROUP_RANK_EXPERTS
        or topk > group_topk * (hf.n_routed_experts // groups)
    ):
        return [
            f"n_group={groups}, topk_group={group_topk}: n_routed_experts ({hf.n_routed_experts}) must divide "
            f"into n_group groups of at least {GROUP_RANK_EXPERTS}, and topk_group groups must hold "
            f"num_experts_per_tok ({topk}) experts"
        ]
    return []


def stock_experts_fused(config: Any) -> bool:
    """Whether the installed stock `DeepseekV3ForCausalLM` stores experts fused (transformers>=5)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as stock

    with torch.device("meta"):
        experts = stock.DeepseekV3Experts(to_stock(config))
    return any(name == "gate_up_proj" for name, _ in experts.named_parameters())


# ---- weight names: megatron global <-> HF ------------------------------------------------------
# The RoPE rows need no reordering: megatron-core's MLA de-interleaves DeepSeek's RoPE pairs itself
# (`_apply_rotary_pos_emb_bshd(multi_latent_attention=True)`), as transformers' `rope_interleave` does.
_DIRECT = {
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",  # TE spec
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",  # TE spec
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
}


def megatron_to_hf(prefix: str, rest: str, tensor: torch.Tensor, mc: Any) -> list[tuple[str, torch.Tensor]] | None:
    """HF names of one layer tensor (`rest` within layer `prefix`); None: the shared names apply."""
    if rest in _DIRECT:
        return [(prefix + _DIRECT[rest], tensor)]
    return mlp_megatron_to_hf(prefix, rest, tensor, mc)


def mlp_megatron_to_hf(prefix: str, rest: str, tensor: torch.Tensor, mc: Any) -> list[tuple[str, torch.Tensor]] | None:
    """HF names of the MoE's own tensors (the expert bias, the shared experts); None: the shared names apply."""
    if rest == "mlp.router.expert_bias":
        return [(prefix + "mlp.gate.e_score_correction_bias", tensor)]
    if rest == "mlp.shared_experts.linear_fc1.weight":
        gate, up = tensor.chunk(2, dim=0)
        shared = prefix + "mlp.shared_experts."
        return [(shared + "gate_proj.weight", gate), (shared + "up_proj.weight", up)]
    if rest == "mlp.shared_experts.linear_fc2.weight":
        return [(prefix + "mlp.shared_experts.down_proj.weight", tensor)]
    return None


def hf_to_megatron(
    hf: dict[str, torch.Tensor], p: str, q: str, mc: ModelConfig, moe_layer: bool
) -> dict[str, torch.Tensor]:
    """One DeepSeek-V3 layer's megatron tensors, without its norms (`hf_to_megatron` adds them)."""
    a, s = p + "self_attn.", q + "self_attention."
    k, experts = _keys(mc)
    query = ("linear_q_proj",) if k.q_lora_rank is None else ("linear_q_down_proj", "q_layernorm", "linear_q_up_proj")
    names = [*query, "linear_kv_down_proj", "kv_layernorm", "linear_kv_up_proj"]
    out = {s + n + ".weight": hf[p + _DIRECT[f"self_attention.{n}.weight"]] for n in names}
    out[s + "linear_proj.weight"] = hf[a + "o_proj.weight"]
    return out | mlp_to_megatron(hf, p, q, mc, moe_layer)


def mlp_to_megatron(hf: dict[str, torch.Tensor], p: str, q: str, mc: Any, moe_layer: bool) -> dict[str, torch.Tensor]:
    """One layer's MLP: dense, or the sigmoid router (with its expert bias), routed and shared experts."""
    out: dict[str, torch.Tensor] = {}
    mlp = p + "mlp."
    experts = _keys(mc)[1]
    if not moe_layer:
        out[q + "mlp.linear_fc1.weight"] = torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]])
        out[q + "mlp.linear_fc2.weight"] = hf[mlp + "down_proj.weight"]
        return out
    out[q + "mlp.router.weight"] = hf[mlp + "gate.weight"]
    if mlp + "gate.e_score_correction_bias" in hf:  # a buffer: absent from gradient dicts
        out[q + "mlp.router.expert_bias"] = hf[mlp + "gate.e_score_correction_bias"]
    for expert in range(experts.num_experts):
        he, me = f"{mlp}experts.{expert}.", f"{q}mlp.experts.local_experts.{expert}."
        out[me + "linear_fc1.weight"] = torch.cat([hf[he + "gate_proj.weight"], hf[he + "up_proj.weight"]])
        out[me + "linear_fc2.weight"] = hf[he + "down_proj.weight"]
    if experts.moe_shared_expert_intermediate_size:
        hs = mlp + "shared_experts."
        out[q + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
            [hf[hs + "gate_proj.weight"], hf[hs + "up_proj.weight"]]
        )
        out[q + "mlp.shared_experts.linear_fc2.weight"] = hf[hs + "down_proj.weight"]
    return out


# ---- ModelConfig: the family's `model.*` keys and their rules (config/moe_rules.py runs them) -------

# The keys are `DeepSeekV3Keys` (config/model_keys/deepseek_v3.py, where the YAML keys users write are
# declared); a model of another arch leaves them at their defaults.


def check_model_config(m: ModelConfig, errors: Errors) -> None:
    """The sigmoid router with expert bias and grouped top-k, and MLA's shapes."""
    check_router(m, errors)
    check_latent_attention(m, errors)


def check_router(m: ModelConfig, errors: Errors) -> None:
    """The sigmoid router with expert bias, grouped top-k and scaling (its reference MoE block); which
    archs may set its keys at all is `config/moe_rules.py`'s rule (the families that list them)."""
    k, moe = _keys(m)
    sigmoid = k.moe_router_score_function == "sigmoid"
    deepseek = m.arch == "deepseek_v3"
    if deepseek:
        errors.need(
            sigmoid and k.moe_router_enable_expert_bias,
            "model.moe_router_score_function",
            "arch deepseek_v3 routes with sigmoid scores and the expert bias: set "
            "moe_router_score_function=sigmoid and moe_router_enable_expert_bias=true "
            "(moe_router_bias_update_rate=0 freezes the bias)",
        )
        errors.need(
            k.multi_latent_attention,
            "model.multi_latent_attention",
            "arch deepseek_v3 has multi-head latent attention; set multi_latent_attention=true",
        )
    errors.need(
        k.mtp_num_layers_carried >= 0,
        "model.mtp_num_layers_carried",
        f"must be >= 0, got {k.mtp_num_layers_carried}",
    )
    if k.moe_router_enable_expert_bias:
        errors.need(
            sigmoid,
            "model.moe_router_enable_expert_bias",
            "the expert bias (aux-loss-free balancing) needs moe_router_score_function=sigmoid",
        )
        errors.need(
            k.moe_router_bias_update_rate >= 0,
            "model.moe_router_bias_update_rate",
            f"must be >= 0, got {k.moe_router_bias_update_rate}",
        )
    groups, group_topk = k.moe_router_num_groups, k.moe_router_group_topk
    if groups is None and group_topk is None:
        return
    if groups is None or group_topk is None:
        errors.need(
            False,
            "model.moe_router_group_topk",
            "grouped top-k needs both moe_router_num_groups and moe_router_group_topk",
        )
        return
    if not errors.need(
        groups >= 1 and 1 <= group_topk <= groups,
        "model.moe_router_group_topk",
        f"must be in [1, moe_router_num_groups={groups}], got {group_topk}",
    ):
        return
    if errors.need(
        moe.num_experts % groups == 0,
        "model.moe_router_num_groups",
        f"num_experts {moe.num_experts} is not divisible by {groups} groups",
    ):
        per_group = moe.num_experts // groups
        errors.need(
            per_group >= GROUP_RANK_EXPERTS and moe.moe_router_topk <= group_topk * per_group,
            "model.moe_router_topk",
            f"{moe.moe_router_topk} experts must fit in moe_router_group_topk={group_topk} groups of "
            f"{per_group} experts (a group is ranked by its best {GROUP_RANK_EXPERTS}, so it needs at least "
            f"{GROUP_RANK_EXPERTS})",
        )


def check_latent_attention(m: ModelConfig, errors: Errors) -> None:
    """MLA shapes, as megatron-core's `MLATransformerConfig` and the reference attention take them."""
    k = _keys(m)[0]
    if not k.multi_latent_attention:
        return
    for key, value in [
        ("model.kv_lora_rank", k.kv_lora_rank),
        ("model.qk_head_dim", k.qk_head_dim),
        ("model.qk_pos_emb_head_dim", k.qk_pos_emb_head_dim),
        ("model.v_head_dim", k.v_head_dim),
    ]:
        errors.need(value >= 1, key, f"must be >= 1 with multi_latent_attention, got {value}")
    errors.need(
        k.q_lora_rank is None or k.q_lora_rank >= 1,
        "model.q_lora_rank",
        f"must be null (full-rank query) or >= 1, got {k.q_lora_rank}",
    )
    errors.need(
        k.qk_pos_emb_head_dim % 2 == 0,
        "model.qk_pos_emb_head_dim",
        f"must be even (RoPE rotates pairs), got {k.qk_pos_emb_head_dim}",
    )
    errors.need(
        m.qk_layernorm,
        "model.qk_layernorm",
        "must be true with multi_latent_attention (it turns on the latent q/kv RMSNorms)",
    )
    s = m.rope_scaling
    errors.need(
        s.type in ("none", "yarn"),
        "model.rope_scaling.type",
        f"{s.type!r} with multi_latent_attention is not built (megatron-core's MLA takes plain RoPE or yarn)",
    )
    if s.type == "yarn":
        errors.need(
            s.attention_factor is None,
            "model.rope_scaling.attention_factor",
            "must be null with multi_latent_attention (megatron-core's MLA derives it from mscale / mscale_all_dim)",
        )
        errors.need(
            s.truncate,
            "model.rope_scaling.truncate",
            "must be true with multi_latent_attention (megatron-core's MLA rounds YaRN's ramp bounds)",
        )


def attention_flops(model: ModelConfig, context: float) -> tuple[float, float]:
    """One layer of multi-head latent attention: (projections, scores) FLOPs per token.

    Queries: h -> q_lora_rank -> heads x (qk_head_dim + qk_pos_emb_head_dim), or straight from h
    without q_lora_rank; keys/values: h -> kv_lora_rank + qk_pos_emb_head_dim (the latent and the
    shared RoPE key), latent -> heads x (qk_head_dim + v_head_dim); output heads x v_head_dim -> h.
    Scores: QK^T over qk_head_dim + qk_pos_emb_head_dim, softmax(.)V over v_head_dim (the latent is
    expanded per token, not absorbed into the query)."""
    k = _keys(model)[0]
    h, heads = model.hidden_size, model.num_attention_heads
    qk = k.qk_head_dim + k.qk_pos_emb_head_dim
    q = h * heads * qk if k.q_lora_rank is None else k.q_lora_rank * (h + heads * qk)
    kv = h * (k.kv_lora_rank + k.qk_pos_emb_head_dim) + k.kv_lora_rank * heads * (k.qk_head_dim + k.v_head_dim)
    out = heads * k.v_head_dim * h
    return 2.0 * (q + kv + out), 2.0 * heads * (qk + k.v_head_dim) * context


def attention_params(model: ModelConfig, tp: int) -> list[tuple[str, int]]:
    """One TP rank's tensors of multi-head latent attention: the down projections and their latent
    norms whole on every rank (megatron-core builds them "duplicated"), the up and output projections
    split by head."""
    k = _keys(model)[0]
    h, heads = model.hidden_size, model.num_attention_heads
    q_head = k.qk_head_dim + k.qk_pos_emb_head_dim
    out = [
        ("self_attention.linear_kv_down_proj.weight", (k.kv_lora_rank + k.qk_pos_emb_head_dim) * h),
        ("self_attention.kv_layernorm.weight", k.kv_lora_rank),
        ("self_attention.linear_kv_up_proj.weight", heads * (k.qk_head_dim + k.v_head_dim) // tp * k.kv_lora_rank),
        ("self_attention.linear_proj.weight", h * heads * k.v_head_dim // tp),
    ]
    if k.q_lora_rank is None:
        return out + [("self_attention.linear_q_proj.weight", heads * q_head // tp * h)]
    return out + [
        ("self_attention.linear_q_down_proj.weight", k.q_lora_rank * h),
        ("self_attention.q_layernorm.weight", k.q_lora_rank),
        ("self_attention.linear_q_up_proj.weight", heads * q_head // tp * k.q_lora_rank),
    ]


FAMILY = ModelFamily(
    name="deepseek_v3",
    stock_model_type="deepseek_v3",
    stock_class="DeepseekV3ForCausalLM",
    config_fields=CONFIG_FIELDS,
    configure=configure,
    num_experts=num_experts,
    model_fields=model_fields,
    hf_fields=hf_fields,
    moe_layer_pattern=moe_layer_pattern,
    to_stock=to_stock,
    unsupported=unsupported,
    attention=MLAReferenceAttention,
    moe_block=DeepseekV3ReferenceMoeBlock,
    stock_experts_fused=stock_experts_fused,
    megatron_to_hf=megatron_to_hf,
    hf_to_megatron=hf_to_megatron,
    fp32_tensors=(".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"),
    check_model=check_model_config,
    attention_flops=attention_flops,
    attention_params=attention_params,
    config_aliases=("kimi_k2",),  # Kimi-K2 ships DeepSeek-V3's config and weights as model_type kimi_k2
    megatron="mcore_rl.models.deepseek_v3",
)
