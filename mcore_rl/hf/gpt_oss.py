"""The GPT-OSS family: attention with learned sinks and biases, windowed and full layers in turn, and
the MoE with router and expert biases and the clamped SwiGLU, in the reference model; its HF config
translation (stock `GptOssConfig` <-> `ModelConfig` <-> ours with `family="gpt_oss"`), what of a stock
config it refuses, and its weight names; registered in `families.py` as `FAMILY` (the megatron-core
side is `mcore_rl/models/gpt_oss.py`).

Part of the remote-code modeling files (imports only torch and its siblings). Parameter names are those
of stock `GptOssForCausalLM` checkpoints, but for the experts::

    model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}, model.layers.{i}.self_attn.sinks [heads]
    model.layers.{i}.mlp.router.{weight [E, hidden], bias [E]}
    model.layers.{i}.mlp.experts.{j}.gate_up_proj [hidden, 2 x ffn]   (gate and up interleaved: gate in
    model.layers.{i}.mlp.experts.{j}.gate_up_proj_bias [2 x ffn]        the even columns, up in the odd)
    model.layers.{i}.mlp.experts.{j}.down_proj [ffn, hidden], ...down_proj_bias [hidden]

Stock checkpoints stack each of the four expert tensors over the experts (`mlp.experts.gate_up_proj`
[E, hidden, 2 x ffn], ...); here each expert keeps its slice under its index, so that a megatron
expert's tensor has one HF name (`weight_map.py`, the weight sync). `STACKED_EXPERT_TENSORS` names
them for the stock layout (`modeling.to_stock_state_dict` / `from_stock_state_dict`).

A layer attends within the last `sliding_window` tokens or to all of them as `layer_types` says
(stock: windowed on even layers); the model gives each layer its mask (`modeling.py`), and the
engine (`rollout/engine/model_runner.py`) does the same. The sink is one learned logit per head
that joins the softmax and takes its share of the probability mass, but no value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from .family import ModelFamily
from .layers import RoutingTap, moe_aux_loss
from .rope import ROPE_KEYS, rope_scaling_of, rope_type_of

if TYPE_CHECKING:  # in a try block: transformers' remote-code import check skips it (no mcore_rl needed)
    try:
        from mcore_rl.config.model_keys.gpt_oss import GptOssKeys
        from mcore_rl.config.model_keys.moe import MoEKeys
        from mcore_rl.config.rules import Errors
        from mcore_rl.config.schema import ModelConfig
    except ImportError:
        pass

# The gate's sigmoid gain of GPT-OSS's SwiGLU: megatron-core's `quick_gelu`, x * sigmoid(1.702 x),
# has it fixed, so a stock config with another `swiglu_alpha` is refused.
SWIGLU_ALPHA = 1.702
SLIDING, FULL = "sliding_attention", "full_attention"
# The expert tensors stock checkpoints stack over the experts (`mlp.experts.<name>` [E, ...]).
STACKED_EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def attention_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over [scores, sink] per row, without the sink's column: scores [b, heads, sq, sk]
    (masked), sinks [heads]; in fp32, as stock `eager_attention_forward` computes it in fp32."""
    sink = sinks.float().reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    return torch.softmax(torch.cat((scores.float(), sink), dim=-1), dim=-1)[..., :-1]


class GptOssReferenceAttention(nn.Module):
    """GQA attention with biases on q/k/v/o and a learned sink logit per head; no QK-norm. The
    layer's mask (windowed or full) comes from the model."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        h, bias = config.hidden_size, bool(config.attention_bias)
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))

    def init_reference_weights(self, init: Any, std: float) -> None:
        """`McoreRLPreTrainedModel._init_weights`: the sinks normal(0, std), as stock does."""
        init.normal_(self.sinks, mean=0.0, std=std)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if past is not None:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        present = (k, v)
        group = self.num_heads // self.num_kv_heads
        k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k_rep.transpose(-1, -2)) * self.head_dim**-0.5
        # a windowed layer of a transformers cache holds only its window: the mask's last columns
        scores = scores.masked_fill(~allowed[..., -k.shape[2] :], torch.finfo(scores.dtype).min)
        probs = attention_with_sinks(scores, self.sinks).to(q.dtype)
        out = torch.matmul(probs, v_rep).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out), present


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the rotate-half layout (stock `_apply_rotary_emb`). x [b, h, s, d]; cos/sin [b, s, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.unsqueeze(1) + torch.cat((-x2, x1), dim=-1) * sin.unsqueeze(1)


def clamped_swiglu(gate_up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """GPT-OSS's SwiGLU of interleaved [gate, up] columns: gate <= limit, |up| <= limit,
    gate * sigmoid(1.702 gate) * (up + 1) (stock `GptOssExperts._apply_gate`; no clamp for None)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    if limit is not None:
        gate, up = gate.clamp(min=None, max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))


class GptOssReferenceExpert(nn.Module):
    """One expert: (clamped_swiglu(x W_gu + b_gu)) W_d + b_d, weights as stock slices them [in, out]."""

    def __init__(self, hidden: int, ffn: int, limit: float | None) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(hidden, 2 * ffn))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(2 * ffn))
        self.down_proj = nn.Parameter(torch.zeros(ffn, hidden))
        self.down_proj_bias = nn.Parameter(torch.zeros(hidden))
        self.limit = limit

    def init_reference_weights(self, init: Any, std: float) -> None:
        init.normal_(self.gate_up_proj, mean=0.0, std=std)
        init.zeros_(self.gate_up_proj_bias)
        init.normal_(self.down_proj, mean=0.0, std=std)
        init.zeros_(self.down_proj_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        glu = clamped_swiglu(x @ self.gate_up_proj + self.gate_up_proj_bias, self.limit)
        return glu @ self.down_proj + self.down_proj_bias


class GptOssReferenceRouter(nn.Module):
    """`mlp.router`: logits = x W^T + b (stock `GptOssTopKRouter`)."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.bias = nn.Parameter(torch.zeros(num_experts))

    def init_reference_weights(self, init: Any, std: float) -> None:
        init.normal_(self.weight, mean=0.0, std=std)
        init.normal_(self.bias, mean=0.0, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class GptOssReferenceMoeBlock(nn.Module):
    """Top-k of the router's logits, softmax over the k chosen, each expert's output (bias included)
    times its probability: what megatron-core's `TopKRouter` (pre-softmax off) and expert MLPs with
    `add_bias_linear` compute. No shared expert."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.topk = config.num_experts_per_tok
        self.aux_loss_coef = config.router_aux_loss_coef
        self.router = GptOssReferenceRouter(config.hidden_size, config.num_experts)
        limit = config.swiglu_limit
        self.experts = nn.ModuleList(
            GptOssReferenceExpert(config.hidden_size, config.moe_intermediate_size, limit)
            for _ in range(config.num_experts)
        )
        self.routing = RoutingTap()  # the engine records the routed experts through it (layers.py)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x)
        out = self.routing.dispatch(x, logits, self.experts, self.topk, norm_topk_prob=True)
        return out.reshape(shape), moe_aux_loss(logits, self.topk, self.aux_loss_coef)


# ---- HF config <-> ModelConfig ------------------------------------------------------------------

# Our config's GPT-OSS fields (stock `GptOssConfig`'s names) and their defaults: per layer
# "sliding_attention" or "full_attention" (None: `sliding_window`, if set, applies to every layer),
# and the SwiGLU clamp (None: the experts' SwiGLU is not clamped).
CONFIG_FIELDS: dict[str, Any] = dict(layer_types=None, swiglu_limit=None)


def configure(cfg: Any) -> None:
    """Stock GPT-OSS alternates windowed and full layers when `layer_types` is not given."""
    if cfg.layer_types is None and cfg.sliding_window:
        cfg.layer_types = [SLIDING if i % 2 == 0 else FULL for i in range(cfg.num_hidden_layers)]


def _stock(hf: Any) -> bool:
    return getattr(hf, "model_type", None) == "gpt_oss"


def num_experts(hf: Any) -> int:
    return (hf.num_local_experts if _stock(hf) else getattr(hf, "num_experts", 0)) or 0


def window_pattern(layer_types: list[str] | None, num_layers: int) -> list[int] | None:
    """`model.sliding_window_pattern` of `layer_types`: 1 = windowed layer; None when every layer is."""
    pattern = [int(t == SLIDING) for t in (layer_types or [SLIDING] * num_layers)]
    return None if all(pattern) else pattern


def model_fields(hf: Any) -> dict[str, Any]:
    """ModelConfig fields of a GPT-OSS config (stock `GptOssConfig` or ours with family gpt_oss)."""
    window = getattr(hf, "sliding_window", None) or None
    layer_types = getattr(hf, "layer_types", None)
    return dict(
        arch="gpt_oss",
        num_experts=num_experts(hf),
        moe_ffn_hidden_size=hf.intermediate_size if _stock(hf) else hf.moe_intermediate_size,
        qk_layernorm=False,
        moe_norm_topk_prob=True,  # softmax over the top-k logits
        moe_shared_expert_intermediate_size=None,
        sliding_window=window,
        sliding_window_pattern=window_pattern(layer_types, hf.num_hidden_layers) if window else None,
        attention_sinks=True,
        linear_biases=True,
        swiglu_limit=None if hf.swiglu_limit is None else float(hf.swiglu_limit),
    )


def _keys(mc: ModelConfig) -> tuple[GptOssKeys, MoEKeys]:
    """The family's and MoE's sections of a `ModelConfig` (read only on the trainer's side)."""
    try:  # here, in a try block: remote code loads without mcore_rl and must not import it
        from mcore_rl.config.model_keys.gpt_oss import GptOssKeys
        from mcore_rl.config.model_keys.moe import MoEKeys
    except ImportError as err:
        raise ImportError("reading a ModelConfig needs the mcore_rl package") from err
    return mc.section(GptOssKeys), mc.section(MoEKeys)


def hf_fields(mc: ModelConfig) -> dict[str, Any]:
    """Our HF config's GPT-OSS fields of a `ModelConfig`."""
    k = _keys(mc)[0]
    pattern = k.sliding_window_pattern
    layer_types = None
    if mc.sliding_window:
        layer_types = [SLIDING if pattern is None or pattern[i] else FULL for i in range(mc.num_layers)]
    return dict(family="gpt_oss", layer_types=layer_types, swiglu_limit=k.swiglu_limit, attention_bias=True)


def moe_layer_pattern(hf: Any) -> list[int]:
    """Every GPT-OSS layer is an MoE layer."""
    return [1] * hf.num_hidden_layers


def to_stock(cfg: Any) -> Any:
    """A stock `GptOssConfig` (every layer MoE, no shared expert)."""
    from transformers import GptOssConfig

    if not all(is_moe for is_moe in _moe_layers(cfg)) or cfg.shared_expert_intermediate_size:
        raise ValueError("stock GPT-OSS has an MoE MLP without shared expert on every layer")
    scaling = {k: v for k, v in (rope_scaling_of(cfg) or {}).items() if k != "rope_theta"}
    layer_types = cfg.layer_types or [FULL] * cfg.num_hidden_layers
    return GptOssConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        head_dim=cfg.head_dim,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        sliding_window=cfg.sliding_window,
        layer_types=list(layer_types),
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", **scaling, "rope_theta": cfg.rope_theta},
        max_position_embeddings=cfg.max_position_embeddings,
        swiglu_limit=cfg.swiglu_limit,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        attention_bias=True,
    )


def _moe_layers(cfg: Any) -> list[bool]:
    step, dense = cfg.decoder_sparse_step or 1, set(cfg.mlp_only_layers or [])
    return [cfg.num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers)]


def unsupported(hf: Any) -> list[str]:
    """What of a stock GPT-OSS config the reference and megatron-core models here cannot compute."""
    problems = []
    quantization = dict(getattr(hf, "quantization_config", None) or {})
    if quantization and quantization.get("quant_method") != "mxfp4":  # MXFP4 experts: dequantized on import
        problems.append(
            f"quantization_config={quantization}: only the released MXFP4 experts are dequantized on import; "
            "convert a bf16 checkpoint"
        )
    if float(getattr(hf, "swiglu_alpha", SWIGLU_ALPHA)) != SWIGLU_ALPHA:
        problems.append(
            f"swiglu_alpha={hf.swiglu_alpha}: megatron-core's quick_gelu has the gain {SWIGLU_ALPHA} built in"
        )
    if not getattr(hf, "attention_bias", True):
        problems.append("attention_bias=false: GPT-OSS here has biases on every linear (megatron add_bias_linear)")
    kinds = set(getattr(hf, "layer_types", None) or []) - {SLIDING, FULL}
    if kinds:
        problems.append(f"layer_types={sorted(kinds)}: only {SLIDING!r} and {FULL!r} layers are built")
    for key in ROPE_KEYS:
        kind = rope_type_of(getattr(hf, key, None))
        if kind not in ("default", "yarn"):
            problems.append(f"{key}.rope_type={kind!r}: GPT-OSS here takes plain RoPE or YaRN")
        if kind != "default":
            break
    return problems


def stock_experts_fused(config: Any) -> bool:
    """Stock `GptOssForCausalLM` stacks its experts in the checkpoint too; the stacking is
    `STACKED_EXPERT_TENSORS` (not the Qwen3-MoE fusion of `to_stock_state_dict`)."""
    return False


# ---- weight names: megatron global <-> HF ------------------------------------------------------
_DIRECT = {
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "self_attention.core_attention.softmax_offset": "self_attn.sinks",
    "mlp.router.weight": "mlp.router.weight",
    "mlp.router.bias": "mlp.router.bias",
}
_EXPERT = "mlp.experts.local_experts."


def interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[gate; up] rows (megatron's fc1) -> rows gate_0, up_0, gate_1, up_1, ... (GPT-OSS's columns)."""
    return torch.stack((gate, up), dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])


def deinterleave(gate_up: torch.Tensor) -> torch.Tensor:
    """Inverse of `interleave`: rows gate_0, up_0, ... -> [gate; up]."""
    return torch.cat((gate_up[0::2], gate_up[1::2]), dim=0)


def megatron_to_hf(prefix: str, rest: str, tensor: torch.Tensor, mc: Any) -> list[tuple[str, torch.Tensor]] | None:
    """HF names of one layer tensor (`rest` within layer `prefix`); None: the shared names apply."""
    if rest in _DIRECT:
        return [(prefix + _DIRECT[rest], tensor)]
    if not rest.startswith(_EXPERT):
        return None
    expert, leaf = rest[len(_EXPERT) :].split(".", 1)
    ep = f"{prefix}mlp.experts.{expert}."
    if leaf == "linear_fc1.weight":  # [2 ffn, hidden] -> [hidden, 2 ffn] interleaved
        return [(ep + "gate_up_proj", interleave(*tensor.chunk(2, dim=0)).t().contiguous())]
    if leaf == "linear_fc1.bias":
        return [(ep + "gate_up_proj_bias", interleave(*tensor.chunk(2, dim=0)))]
    if leaf == "linear_fc2.weight":  # [hidden, ffn] -> [ffn, hidden]
        return [(ep + "down_proj", tensor.t().contiguous())]
    if leaf == "linear_fc2.bias":
        return [(ep + "down_proj_bias", tensor)]
    return None


# an expert's megatron leaf: its HF tensor (per expert) and the layout change HF -> megatron
_EXPERT_FROM_HF: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = {
    "linear_fc1.weight": ("gate_up_proj", lambda t: deinterleave(t.t())),  # [hidden, 2 ffn] -> [gate; up] rows
    "linear_fc1.bias": ("gate_up_proj_bias", deinterleave),
    "linear_fc2.weight": ("down_proj", lambda t: t.t()),  # [ffn, hidden] -> [hidden, ffn]
    "linear_fc2.bias": ("down_proj_bias", lambda t: t),
}


def megatron_from_hf(prefix: str, rest: str, read: Callable[[str], torch.Tensor], mc: Any) -> torch.Tensor | None:
    """An expert's megatron tensor from its HF one (the streaming importer; `read` gets one expert's
    slice of a stacked checkpoint tensor); None for the rest, which megatron lays out as HF does."""
    if not rest.startswith(_EXPERT):
        return None
    expert, leaf = rest[len(_EXPERT) :].split(".", 1)
    hf_leaf, to_megatron = _EXPERT_FROM_HF[leaf]
    return to_megatron(read(f"{prefix}mlp.experts.{expert}.{hf_leaf}")).contiguous()


def _merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mc: Any) -> torch.Tensor:
    """megatron's fused QKV rows, grouped per KV head: [g0: q.. k v][g1: q.. k v]... (`weight_map.merge_qkv`)."""
    groups, hd = mc.num_query_groups, mc.head_dim
    rest = q.shape[1:]
    return torch.cat(
        [q.reshape(groups, -1, *rest), k.reshape(groups, hd, *rest), v.reshape(groups, hd, *rest)], dim=1
    ).reshape(-1, *rest)


def hf_to_megatron(hf: dict[str, torch.Tensor], p: str, q: str, mc: Any, moe_layer: bool) -> dict[str, torch.Tensor]:
    """One GPT-OSS layer's megatron tensors, without its norms (`hf_to_megatron` adds them)."""
    a, s = p + "self_attn.", q + "self_attention."
    out = {
        s + f"linear_qkv.{leaf}": _merge_qkv(
            hf[a + f"q_proj.{leaf}"], hf[a + f"k_proj.{leaf}"], hf[a + f"v_proj.{leaf}"], mc
        )
        for leaf in ("weight", "bias")
    }
    out[s + "linear_proj.weight"] = hf[a + "o_proj.weight"]
    for megatron, name in _DIRECT.items():
        out[q + megatron] = hf[p + name]
    for expert in range(_keys(mc)[1].num_experts):
        he, me = f"{p}mlp.experts.{expert}.", f"{q}{_EXPERT}{expert}."
        for leaf, (hf_leaf, to_megatron) in _EXPERT_FROM_HF.items():
            out[me + leaf] = to_megatron(hf[he + hf_leaf])
    return out


# ---- ModelConfig: the family's `model.*` keys and their rules (config/moe_rules.py runs them) -------

# Its keys are `GptOssKeys` (config/model_keys/gpt_oss.py); config/moe_rules.py refuses them off their
# defaults under another arch.


def check_model_config(m: ModelConfig, errors: Errors) -> None:
    """Sinks, biases and the clamped SwiGLU belong to this arch, and it has them; the window pattern."""
    if m.arch != "gpt_oss":
        return
    k, moe = _keys(m)
    for key, value in [("attention_sinks", k.attention_sinks), ("linear_biases", k.linear_biases)]:
        errors.need(value, f"model.{key}", "arch gpt_oss has attention sinks and biases on every linear; set it true")
    errors.need(moe.num_experts > 0, "model.num_experts", "arch gpt_oss is an MoE model; set num_experts > 0")
    errors.need(
        moe.moe_layer_pattern is None and not moe.moe_shared_expert_intermediate_size,
        "model.moe_layer_pattern",
        "arch gpt_oss has an MoE MLP without shared expert on every layer",
    )
    errors.need(not m.qk_layernorm, "model.qk_layernorm", "arch gpt_oss has no QK-norm; set qk_layernorm=false")
    errors.need(
        k.swiglu_limit is None or k.swiglu_limit > 0, "model.swiglu_limit", f"must be null or > 0, got {k.swiglu_limit}"
    )
    errors.need(
        m.rope_scaling.type in ("none", "yarn"),
        "model.rope_scaling.type",
        f"{m.rope_scaling.type!r} with arch gpt_oss is not built (plain RoPE or yarn)",
    )
    pattern = k.sliding_window_pattern
    if pattern is not None:
        key = "model.sliding_window_pattern"
        errors.need(m.sliding_window is not None, key, "needs model.sliding_window (the window of its 1 layers)")
        errors.need(len(pattern) == m.num_layers, key, f"has {len(pattern)} entries but num_layers is {m.num_layers}")
        errors.need(all(p in (0, 1) for p in pattern), key, f"entries must be 0 (full) or 1 (windowed), got {pattern}")


def check_parallel(m: ModelConfig, p: Any, errors: Errors) -> None:
    """megatron-core 0.16.1 builds expert biases only with one expert-tensor-parallel rank."""
    etp = p.expert_tensor_parallel_size if p.expert_tensor_parallel_size is not None else p.tensor_model_parallel_size
    errors.need(
        not _keys(m)[0].linear_biases or etp == 1,
        "parallel.expert_tensor_parallel_size",
        f"is {etp} but megatron-core builds the experts' biases (model.linear_biases, arch gpt_oss) only with "
        "expert_tensor_parallel_size 1",
    )


def windowed_layers(m: ModelConfig) -> list[bool]:
    """The layers `model.sliding_window` applies to (`models/flops.py`)."""
    pattern = _keys(m)[0].sliding_window_pattern
    return [pattern is None or bool(p) for p in pattern or [1] * m.num_layers]


def attention_params(model: ModelConfig, tp: int) -> list[tuple[str, int]]:
    """One TP rank's attention tensors: the GQA decoder's, with q/k/v biases split by TP, the output
    projection's bias whole, and one sink logit per head of the rank."""
    k = _keys(model)[0]
    h, d = model.hidden_size, model.head_dim
    q, kv = model.num_attention_heads * d, model.num_query_groups * d
    out = [
        ("self_attention.linear_qkv.weight", (q + 2 * kv) // tp * h),
        ("self_attention.linear_proj.weight", h * q // tp),
    ]
    if k.linear_biases:
        out += [("self_attention.linear_qkv.bias", (q + 2 * kv) // tp), ("self_attention.linear_proj.bias", h)]
    if k.attention_sinks:
        out.append(("self_attention.core_attention.softmax_offset", model.num_attention_heads // tp))
    return out


def moe_extra_params(model: ModelConfig, etp: int) -> list[tuple[str, int, bool]]:
    """The router's bias and each expert's two biases (megatron-core builds them at expert-TP 1 only)."""
    k, moe = _keys(model)
    if not k.linear_biases:
        return []
    f = moe.moe_ffn_hidden_size or model.ffn_hidden_size
    return [
        ("mlp.router.bias", moe.num_experts, False),
        ("linear_fc1.bias", 2 * f // etp, True),
        ("linear_fc2.bias", model.hidden_size, True),
    ]


FAMILY = ModelFamily(
    name="gpt_oss",
    stock_model_type="gpt_oss",
    stock_class="GptOssForCausalLM",
    config_fields=CONFIG_FIELDS,
    configure=configure,
    num_experts=num_experts,
    model_fields=model_fields,
    hf_fields=hf_fields,
    moe_layer_pattern=moe_layer_pattern,
    to_stock=to_stock,
    unsupported=unsupported,
    attention=GptOssReferenceAttention,
    moe_block=GptOssReferenceMoeBlock,
    stock_experts_fused=stock_experts_fused,
    megatron_to_hf=megatron_to_hf,
    hf_to_megatron=hf_to_megatron,
    check_model=check_model_config,
    check_parallel=check_parallel,
    windowed_layers=windowed_layers,
    attention_params=attention_params,
    moe_extra_params=moe_extra_params,
    attention_bias=True,
    stacked_expert_tensors=STACKED_EXPERT_TENSORS,
    megatron_from_hf=megatron_from_hf,
    megatron="mcore_rl.models.gpt_oss",
)
