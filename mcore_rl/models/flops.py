"""FLOPs of the decoder per token, from the model config alone (no megatron import).

One count serves the MFU in the run metrics and the step-time estimate of `mcore-rl profile`, so
the two agree. A multiply-add is 2 FLOPs; only matrix products are counted (norms, activations,
softmax and the router's top-k are a few percent at real sizes and not matmuls). Attention's
score and value products depend on the context a token attends to: for a causal sequence of
length s that is (s + 1) / 2 positions on average. A family with its own attention counts it in
its bundle (`ModelFamily.attention_flops`, hf/<family>.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.config.model_keys.latent_moe import LatentMoEKeys
from mcore_rl.config.model_keys.moe import MoEKeys
from mcore_rl.config.schema import ModelConfig


@dataclass(frozen=True)
class ForwardFlops:
    """Forward FLOPs of one token, by part (each summed over all layers)."""

    attention_projections: float  # Q, K, V and output projections
    attention_scores: float  # QK^T and softmax(.)V over the attended context
    mlp: float  # dense MLPs, routed experts (active ones only), shared experts, router, latent projections
    output_layer: float  # the LM head

    @property
    def total(self) -> float:
        return self.attention_projections + self.attention_scores + self.mlp + self.output_layer


def _swiglu(hidden: int, ffn: int) -> float:
    return 2.0 * 3 * hidden * ffn  # gate, up and down projections


def _moe_layer(model: ModelConfig) -> float:
    h, experts, latent = model.hidden_size, model.section(MoEKeys), model.section(LatentMoEKeys).moe_latent_size
    expert_ffn = experts.moe_ffn_hidden_size or model.ffn_hidden_size
    width = latent or h  # LatentMoE: routed experts work in the latent space
    flops = 2.0 * h * experts.num_experts  # router
    flops += experts.moe_router_topk * _swiglu(width, expert_ffn)
    if latent:
        flops += 2.0 * 2 * h * latent  # W_down and W_up
    shared = experts.moe_shared_expert_intermediate_size
    if shared:
        flops += _swiglu(h, shared)
        if experts.moe_shared_expert_gate:  # Qwen2-MoE: x . w_gate, w_gate [1, h]
            flops += 2.0 * h
    return flops


def is_moe_layer(model: ModelConfig, layer: int) -> bool:
    """Whether decoder layer `layer` (0-based) has a MoE MLP; every layer does in a MoE model
    unless a per-layer pattern (`model.moe_layer_pattern`) says otherwise."""
    if not model.is_moe:
        return False
    pattern = model.section(MoEKeys).moe_layer_pattern
    return bool(pattern[layer]) if pattern else True


def forward_flops_per_token(model: ModelConfig, seq_len: int, causal: bool = True) -> ForwardFlops:
    """Forward FLOPs of one token in a sequence of `seq_len` tokens."""
    h, L = model.hidden_size, model.num_layers
    # imported here: mcore_rl.hf loads torch and transformers; `mcore-rl profile --help` needs neither
    from mcore_rl.hf.families import family_named

    family = family_named(model.arch)
    # the window on every layer, or on those the family says (`ModelFamily.windowed_layers`)
    windowed = family.windowed_layers(model) if family is not None and family.windowed_layers else [True] * L
    contexts = [_attended_context(seq_len, causal, model.sliding_window if w else None) for w in windowed]
    if family is not None and family.attention_flops is not None:  # its own attention (hf/<family>.py)
        per_layer = [family.attention_flops(model, context) for context in contexts]
        projections, scores = sum(p for p, _ in per_layer), sum(s for _, s in per_layer)
    else:
        q_dim = model.num_attention_heads * model.head_dim
        kv_dim = model.num_query_groups * model.head_dim
        projections = L * (2.0 * h * (q_dim + 2 * kv_dim) + 2.0 * q_dim * h)
        scores = 2.0 * 2 * q_dim * sum(contexts)
    mlp = sum(_moe_layer(model) if is_moe_layer(model, i) else _swiglu(h, model.ffn_hidden_size) for i in range(L))
    return ForwardFlops(projections, scores, mlp, 2.0 * h * model.vocab_size)


def _attended_context(seq_len: int, causal: bool, window: int | None) -> float:
    """Mean number of keys a query attends to: (s + 1) / 2 causal, s bidirectional; with a sliding
    window W (causal) query i reads min(i + 1, W) keys."""
    if not causal:
        return float(seq_len)
    if not window or window >= seq_len:
        return (seq_len + 1) / 2.0
    return (window * (window + 1) / 2.0 + (seq_len - window) * window) / seq_len


def train_flops_per_token(model: ModelConfig, seq_len: int, recompute: str = "none") -> float:
    """FLOPs of one trained token: forward + backward (twice the forward: grads of inputs and of
    weights); full recomputation runs the forward once more, selective only the attention scores."""
    fwd = forward_flops_per_token(model, seq_len)
    extra = {"none": 0.0, "full": fwd.total, "selective": fwd.attention_scores}[recompute]
    return 3.0 * fwd.total + extra


def mfu(tokens_per_second_per_device: float, flops_per_token: float, peak_flops_per_device: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the device's peak."""
    if peak_flops_per_device <= 0:
        raise ValueError(f"peak FLOP/s must be > 0, got {peak_flops_per_device}")
    return tokens_per_second_per_device * flops_per_token / peak_flops_per_device
