"""Per-GPU memory of a layout: model state counted tensor by tensor, activations term by term.

Model state is exact: `param_tensors` lists the shapes megatron-core's GPT model builds on one
rank (local or transformer-engine spec alike, since both hold the same weights), so parameter,
gradient (megatron DDP's fp32 grad buffer) and optimizer bytes are sums over it.

Activations follow Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer
Models", 2022): the tensors a layer saves for backward, per micro-batch, as multiples of s·b·h
(sequence, micro-batch, hidden) and b·a·s² (the attention scores). The paper's GPT layer (34·sbh
+ 5·a·s²·b bytes) is rebuilt for what runs here: GQA (K/V at num_query_groups heads), QK-norm,
SwiGLU (fc1 is 2·ffn wide), no dropout, MoE (routed tokens × top-k), and two attention kernels —
`local` (megatron-core's local spec, as on CPU: fp32 softmax probabilities, K/V expanded to all
heads, an s×s mask) and `flash` (the TE spec: no s² term, a per-head log-sum-exp). TP/SP divide
the terms as in the paper, CP the sequence, and the pipeline schedule sets how many micro-batches
a stage holds at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.config.model_keys.attn_res import AttnResKeys
from mcore_rl.config.model_keys.latent_moe import LatentMoEKeys
from mcore_rl.config.model_keys.moe import MoEKeys
from mcore_rl.config.model_keys.ngram import NgramEmbeddingConfig
from mcore_rl.config.errors import ConfigError
from mcore_rl.config.rules import padded_vocab_size
from mcore_rl.config.schema import ModelConfig
from mcore_rl.models.flops import is_moe_layer
from mcore_rl.profile.layouts import Layout, TrainShape

GiB = float(1 << 30)


@dataclass(frozen=True)
class ParamTensor:
    name: str
    numel: int  # of one tensor
    expert: bool  # split by EP/ETP, reduced over the expert data-parallel group
    count: int = 1  # identical tensors (a rank's local experts), so 128 experts cost one entry


def check_supported(model: ModelConfig) -> None:
    """The memory model covers the Qwen3 dense and MoE decoders; the research variants add tensors it
    does not count, so it says so instead of reporting a wrong number."""
    unsupported = [
        (key, on)
        for key, on in (
            ("model.moe_latent_size", model.section(LatentMoEKeys).moe_latent_size is not None),
            ("model.attn_res", model.section(AttnResKeys).attn_res != "none"),
            ("model.ngram.orders", bool(model.section(NgramEmbeddingConfig).orders)),
        )
        if on
    ]
    if unsupported:
        raise ConfigError(
            "mcore-rl profile does not model "
            + ", ".join(k for k, _ in unsupported)
            + " (LatentMoE, AttnRes and n-gram embeddings add tensors the estimate does not count)"
        )


def layers_on_stage(model: ModelConfig, layout: Layout, pp_rank: int) -> list[int]:
    """Global layer indices on pipeline rank `pp_rank` (all of its virtual chunks), as megatron-core
    assigns them: chunk c of rank r holds layers [(c·pp + r)·n, (c·pp + r + 1)·n), n = L / (pp·vpp)."""
    v = layout.vpp or 1
    n = model.num_layers // (layout.pp * v)
    return [i for c in range(v) for i in range((c * layout.pp + pp_rank) * n, (c * layout.pp + pp_rank + 1) * n)]


def param_tensors(model: ModelConfig, layout: Layout, pp_rank: int = 0) -> list[ParamTensor]:
    """The parameters one rank of pipeline stage `pp_rank` holds (the same on every TP/EP/DP rank)."""
    # imported here: mcore_rl.hf loads torch and transformers; `mcore-rl profile --help` needs neither
    from mcore_rl.hf.families import family_named

    h, tp, etp, ep = model.hidden_size, layout.tp, layout.expert_tp, layout.ep
    q, kv, d = model.num_attention_heads * model.head_dim, model.num_query_groups * model.head_dim, model.head_dim
    out: list[ParamTensor] = []
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    family = family_named(model.arch)
    vocab = padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, tp)  # split evenly over TP
    if first:
        out.append(ParamTensor("embedding.word_embeddings.weight", vocab // tp * h, False))
    for i in layers_on_stage(model, layout, pp_rank):
        p = f"decoder.layers.{i}."
        out.append(ParamTensor(p + "input_layernorm.weight", h, False))
        if family is not None and family.attention_params is not None:  # its own attention (hf/<family>.py)
            out += [ParamTensor(p + name, numel, False) for name, numel in family.attention_params(model, tp)]
        else:
            out += [
                ParamTensor(p + "self_attention.linear_proj.weight", h * q // tp, False),
                ParamTensor(p + "self_attention.linear_qkv.weight", (q + 2 * kv) // tp * h, False),
            ]
            if getattr(model, "add_qkv_bias", False):  # Qwen2 (a field older configs lack): q/k/v biases
                out.append(ParamTensor(p + "self_attention.linear_qkv.bias", (q + 2 * kv) // tp, False))
            if model.qk_layernorm:
                out += [
                    ParamTensor(p + "self_attention.q_layernorm.weight", d, False),
                    ParamTensor(p + "self_attention.k_layernorm.weight", d, False),
                ]
        out.append(ParamTensor(p + "pre_mlp_layernorm.weight", h, False))
        if is_moe_layer(model, i):
            moe = model.section(MoEKeys)
            f = moe.moe_ffn_hidden_size or model.ffn_hidden_size
            out.append(ParamTensor(p + "mlp.router.weight", moe.num_experts * h, False))
            n = moe.num_experts // ep
            experts = p + f"mlp.experts.local_experts.[0-{n - 1}]."
            out += [
                ParamTensor(experts + "linear_fc1.weight", 2 * f // etp * h, True, n),
                ParamTensor(experts + "linear_fc2.weight", h * f // etp, True, n),
            ]
            if family is not None and family.moe_extra_params is not None:  # e.g. GPT-OSS's biases
                out += [
                    ParamTensor(experts + name, numel, True, n) if per_expert else ParamTensor(p + name, numel, False)
                    for name, numel, per_expert in family.moe_extra_params(model, etp)
                ]
            if moe.moe_shared_expert_intermediate_size:
                s = moe.moe_shared_expert_intermediate_size
                out += [
                    ParamTensor(p + "mlp.shared_experts.linear_fc1.weight", 2 * s // tp * h, False),
                    ParamTensor(p + "mlp.shared_experts.linear_fc2.weight", h * s // tp, False),
                ]
                if moe.moe_shared_expert_gate:  # Qwen2-MoE: w_gate [1, h], replicated
                    out.append(ParamTensor(p + "mlp.shared_experts.gate_weight", h, False))
        else:
            f = model.ffn_hidden_size
            out += [
                ParamTensor(p + "mlp.linear_fc1.weight", 2 * f // tp * h, False),
                ParamTensor(p + "mlp.linear_fc2.weight", h * f // tp, False),
            ]
    if last:
        out.append(ParamTensor("decoder.final_layernorm.weight", h, False))
        if not model.tie_word_embeddings or layout.pp > 1:  # tied with PP: the last stage keeps a copy
            out.append(ParamTensor("output_layer.weight", vocab // tp * h, False))
    return out


@dataclass(frozen=True)
class ModelState:
    """Bytes of one rank's parameters, gradients and optimizer state."""

    params: int
    grads: int
    optimizer: int
    num_params: int
    num_tensors: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def model_state(model: ModelConfig, layout: Layout, shape: TrainShape, pp_rank: int = 0) -> ModelState:
    """Parameters in the model dtype; megatron DDP's grad buffer in fp32 (`grad_reduce_in_fp32`);
    AdamW's two fp32 moments and a 0-d fp32 `step` per tensor (torch's AdamW), plus fp32 masters
    for bf16 parameters; SGD keeps no state. With the distributed optimizer (megatron's ZeRO-1)
    masters and moments are sharded over the (expert) data-parallel group; grads stay whole."""
    tensors = param_tensors(model, layout, pp_rank)
    n = sum(t.numel * t.count for t in tensors)
    num_tensors = sum(t.count for t in tensors)
    param_bytes = 2 if shape.precision == "bf16" else 4
    per_param = (8 if shape.optimizer == "adamw" else 0) + (4 if shape.precision == "bf16" else 0)
    step = 4 if shape.optimizer == "adamw" else 0
    if shape.distributed_optimizer:
        optimizer = sum(t.numel * t.count * per_param / (layout.expert_dp if t.expert else layout.dp) for t in tensors)
        optimizer += step * num_tensors
    else:
        optimizer = n * per_param + step * num_tensors
    return ModelState(n * param_bytes, n * 4, int(optimizer), n, num_tensors)


# ------------------------------------------------------------------------------------- activations


def _layer_bytes(model: ModelConfig, layout: Layout, shape: TrainShape, layer: int, attention: str) -> float:
    """Bytes one decoder layer saves for backward for one micro-batch on one rank (no recomputation)."""
    e = 2 if shape.precision == "bf16" else 4
    tp, cp = layout.tp, layout.cp
    s, b, h = shape.seq_length / cp, shape.micro_batch_size, model.hidden_size
    sp = tp if layout.sp else 1  # sequence parallel divides the [s, b, h] tensors between norms
    a, g, d = model.num_attention_heads / tp, model.num_query_groups / tp, model.head_dim
    q, kv = a * d, g * d
    sb = s * b
    # RMSNorm (mcore_rl/models/norm.py): its input, the fp32 normalised copy and rsqrt, the output
    norm = sb / sp * (h * (e + 4 + e) + 4)
    attn = norm + sb * (q + 2 * kv) * e  # fused QKV projection output (q, k, v are views of it)
    if model.qk_layernorm:
        attn += sb * (q * (e + 4) + 4 * a) + sb * (kv * 4 + 4 * g)  # q copied, its rsqrt; k's normalised, rsqrt
    attn += 4 * s * d * 4  # RoPE's cos and sin, for q and k
    attn += 2 * sb * q * e  # rotated queries, keys expanded to all heads (GQA's repeat)
    attn += sb * q * e  # values expanded to all heads
    if attention == "local":  # unfused softmax: probabilities in fp32, a boolean causal mask
        full_s = shape.seq_length
        attn += b * a * s * full_s * 4 + s * full_s
    else:  # flash attention: output and log-sum-exp per head
        attn += sb * q * e + sb * a * 4
    attn += sb * q * e  # linear_proj input
    mlp = norm
    if is_moe_layer(model, layer):
        moe = model.section(MoEKeys)
        f = (moe.moe_ffn_hidden_size or model.ffn_hidden_size) / layout.expert_tp
        routed = sb * moe.moe_router_topk  # tokens x top-k reach this rank's experts (balanced)
        mlp += sb * moe.num_experts * 4 * 2  # router logits and probabilities (fp32)
        mlp += routed * (h * e * 2 + 5 * f * e)  # permuted tokens in and out, SwiGLU of each expert
        shared = moe.moe_shared_expert_intermediate_size
        if shared:
            mlp += sb * (h * e + 5 * shared / tp * e)
    else:
        # fc1 output (2f), the gate/up halves made contiguous and SiLU's output (3f); fc2 input is one of them
        mlp += 5 * sb * model.ffn_hidden_size / tp * e
    return attn + mlp


def _selective_saving(model: ModelConfig, layout: Layout, shape: TrainShape, attention: str) -> float:
    """What selective recomputation drops per layer: the core attention's internals (megatron-core
    checkpoints `core_attention` and keeps only its q, k, v inputs)."""
    e = 2 if shape.precision == "bf16" else 4
    s, b = shape.seq_length / layout.cp, shape.micro_batch_size
    a, d = model.num_attention_heads / layout.tp, model.head_dim
    dropped = 2 * s * b * a * d * e  # expanded keys and values (queries stay: they are its input)
    if attention == "local":
        dropped += b * a * s * shape.seq_length * 4 + s * shape.seq_length
    else:
        dropped += s * b * a * 4
    return dropped


def in_flight_layers(model: ModelConfig, layout: Layout, num_microbatches: int, pp_rank: int) -> float:
    """Layer-activations a pipeline rank holds at its peak: 1F1B keeps pp - rank micro-batches of its
    L/pp layers in flight; the interleaved schedule's warm-up is longer (megatron-core's count)."""
    pp, v = layout.pp, layout.vpp or 1
    if pp == 1:
        return model.num_layers
    chunk = model.num_layers / (pp * v)
    if v == 1:
        return chunk * min(pp - pp_rank, num_microbatches)
    warmup = min((pp - pp_rank - 1) * 2 + (v - 1) * pp, num_microbatches * v)
    return chunk * (warmup + 1)


@dataclass(frozen=True)
class Activations:
    """Peak activation bytes of the busiest pipeline rank and what they are made of."""

    total: float
    per_layer: float  # one layer, one micro-batch
    layers_in_flight: float
    output: float  # final norm, logits and the loss's saved tensors (last stage)
    pp_rank: int


def stage_activations(
    model: ModelConfig,
    layout: Layout,
    shape: TrainShape,
    num_microbatches: int,
    pp_rank: int,
    attention: str = "flash",
    recompute: str | None = None,
) -> Activations:
    """Peak activation bytes of one rank of pipeline stage `pp_rank`."""
    recompute = recompute or shape.recompute
    e = 2 if shape.precision == "bf16" else 4
    s, b = shape.seq_length / layout.cp, shape.micro_batch_size
    sp = layout.tp if layout.sp else 1
    layers = layers_on_stage(model, layout, pp_rank)
    per_layer = sum(_layer_bytes(model, layout, shape, i, attention) for i in layers) / max(len(layers), 1)
    if recompute == "selective":
        per_layer -= _selective_saving(model, layout, shape, attention)
    n = in_flight_layers(model, layout, num_microbatches, pp_rank)
    if recompute == "full":  # each layer keeps its input; one layer is recomputed at a time
        held = n * s * b * model.hidden_size * e / sp + per_layer
    else:
        held = n * per_layer
    output = 0.0
    if pp_rank == layout.pp - 1:  # final norm, fp32 logits (vocab-parallel), the loss's mask and labels
        output = (
            s * b / sp * (model.hidden_size * (e + 4 + e) + 4)
            + s * b * padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, layout.tp) / layout.tp * 4
        )
        output += s * b * 4 * 2
    if pp_rank == 0:
        output += s * b * 8  # token ids
    return Activations(held + output, per_layer, n, output, pp_rank)


def activations(
    model: ModelConfig,
    layout: Layout,
    shape: TrainShape,
    num_microbatches: int,
    attention: str = "flash",
    recompute: str | None = None,
) -> Activations:
    """The busiest pipeline rank's peak (the first stage holds the most micro-batches, the last the logits)."""
    return max(
        (
            stage_activations(model, layout, shape, num_microbatches, r, attention, recompute)
            for r in sorted({0, layout.pp - 1})
        ),
        key=lambda a: a.total,
    )


def kv_cache_bytes_per_token(model: ModelConfig, inference_tp: int, dtype_bytes: int = 2) -> float:
    """K and V of every layer for one token, on one GPU of an engine with `inference_tp` GPUs."""
    heads = max(model.num_query_groups / inference_tp, 1.0)  # KV heads are replicated past their count
    return 2.0 * model.num_layers * heads * model.head_dim * dtype_bytes


def weight_bytes(model: ModelConfig, dtype_bytes: int = 2) -> float:
    """All parameters of the model once (an inference engine's weights)."""
    total = sum(t.numel * t.count for t in param_tensors(model, Layout(), 0))
    return float(total * dtype_bytes)
