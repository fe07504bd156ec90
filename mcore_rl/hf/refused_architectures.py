"""Architectures megatron-core 0.16.1 cannot build here, by Hugging Face `model_type`: what each is and
what supporting it would take. The HF loader (`convert/hf_checkpoint.py`) refuses them with one line
naming both, instead of a bare "not supported", so a user knows whether to wait, convert elsewhere,
or pick another family; docs/serving.md has the same table.

What all of them share: the trainer builds megatron-core's `GPTModel` from the local (no
transformer-engine) layer spec, where every layer is softmax attention + MLP/MoE. A layer of another
kind (a state-space or linear-attention mixer, sparse attention with an indexer) has no local-spec
module in 0.16.1, and the reference model, the weight map, the embedded engine's KV cache and the
profiler would each need its own part.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RefusedArchitecture:
    """One model_type the loader refuses: what it is, and what it would take here."""

    what: str
    needed: str


_MAMBA_NEEDS = (
    "megatron-core's MambaModel / hybrid layer allocation (needs mamba-ssm and causal-conv1d CUDA "
    "kernels, no CPU path), a reference Mamba-2 mixer, a weight map and a recurrent-state cache in the engine"
)

REFUSED_ARCHITECTURES: dict[str, RefusedArchitecture] = {
    "qwen3_next": RefusedArchitecture(
        "Qwen3-Next: hybrid Gated DeltaNet (linear attention) and gated softmax-attention layers, 3:1, "
        "with a high-sparsity MoE and a multi-token-prediction head",
        "a Gated DeltaNet layer in megatron-core (0.16.1 has none; needs flash-linear-attention kernels), "
        "its reference module, the hybrid layer pattern in the builder and a recurrent-state cache in the engine",
    ),
    "mamba": RefusedArchitecture("Mamba: selective state-space layers only, no attention", _MAMBA_NEEDS),
    "mamba2": RefusedArchitecture("Mamba-2: state-space duality layers only, no attention", _MAMBA_NEEDS),
    "jamba": RefusedArchitecture(
        "Jamba: Mamba and attention layers interleaved 7:1, MoE on every other layer", _MAMBA_NEEDS
    ),
    "nemotron_h": RefusedArchitecture(
        "Nemotron-H: a Mamba-2 hybrid (mostly Mamba-2 layers, a few attention layers, squared-ReLU MLPs)",
        _MAMBA_NEEDS,
    ),
    "falcon_h1": RefusedArchitecture(
        "Falcon-H1: attention and Mamba-2 heads in parallel inside each layer",
        _MAMBA_NEEDS + " (parallel, not interleaved)",
    ),
    "bamba": RefusedArchitecture("Bamba: a Mamba-2 / attention hybrid", _MAMBA_NEEDS),
    "granitemoehybrid": RefusedArchitecture("Granite-4.0 hybrid: Mamba-2 and attention layers with MoE", _MAMBA_NEEDS),
    "zamba2": RefusedArchitecture(
        "Zamba2: Mamba-2 layers with shared attention blocks reused across depth",
        _MAMBA_NEEDS + ", and weight-shared blocks",
    ),
    "deepseek_v32": RefusedArchitecture(
        "DeepSeek-V3.2: DeepSeek-V3's MLA with DeepSeek Sparse Attention (a lightning indexer picks "
        "the top-k keys per query)",
        "the indexer and top-k sparse attention in megatron-core's MLA (0.16.1 has dense MLA only), "
        "the indexer's weights in the weight map and its key cache in the engine; dense MLA over "
        "the same weights would be a different model",
    ),
    "minimax": RefusedArchitecture(
        "MiniMax-Text-01: lightning (linear) attention layers with one softmax-attention layer in eight, MoE",
        "a lightning-attention layer in megatron-core (0.16.1 has none), its reference module and a "
        "recurrent-state cache in the engine",
    ),
    "kimi_linear": RefusedArchitecture(
        "Kimi Linear: Kimi Delta Attention (linear) layers with one MLA layer in four, MoE",
        "a Kimi Delta Attention layer in megatron-core (0.16.1 has none; needs flash-linear-attention "
        "kernels), its reference module, the hybrid layer pattern and a recurrent-state cache in the engine",
    ),
    "lfm2": RefusedArchitecture(
        "LFM2: gated short-convolution layers with a few grouped-query attention layers",
        "a gated short-convolution layer in megatron-core (0.16.1 has none), its reference module and "
        "a convolution-state cache in the engine",
    ),
    "falcon_mamba": RefusedArchitecture("Falcon-Mamba: Mamba layers only, no attention", _MAMBA_NEEDS),
    "zamba": RefusedArchitecture(
        "Zamba: Mamba layers with one shared attention block reused across depth",
        _MAMBA_NEEDS + ", and weight-shared blocks",
    ),
    "rwkv": RefusedArchitecture(
        "RWKV: a recurrent (linear-attention) time-mixing block, no softmax attention",
        "an RWKV time-mixing layer in megatron-core (0.16.1 has none) and a recurrent-state cache",
    ),
    "recurrent_gemma": RefusedArchitecture(
        "RecurrentGemma (Griffin): RG-LRU recurrent blocks with local attention",
        "an RG-LRU layer in megatron-core (0.16.1 has none) and a recurrent-state cache",
    ),
}


def refusal(model_type: str | None) -> str | None:
    """The one-line reason a refused `model_type` cannot be loaded here, or None if it is not refused."""
    arch = REFUSED_ARCHITECTURES.get(model_type or "")
    if arch is None:
        return None
    return (
        f"model_type {model_type!r} ({arch.what}) cannot be built with megatron-core 0.16.1 here; "
        f"it would need {arch.needed}"
    )
