"""Weight names and layouts between megatron-core models and Hugging Face checkpoints.

Three views of the same weights:
- *HF*: `model.layers.3.self_attn.q_proj.weight`, … (stock Qwen3 / Qwen3-MoE checkpoint names).
- *megatron global*: the megatron-core name with the global layer and expert index, unsharded —
  `decoder.layers.3.self_attention.linear_qkv.weight` (q/k/v interleaved per query group),
  `decoder.layers.3.mlp.experts.local_experts.17.linear_fc1.weight` ([gate; up]).
- *megatron local*: a parameter on one rank: local layer/expert index, TP/ETP shard.

This module maps HF <-> megatron global with plain tensors and never imports megatron-core (it is
part of `mcore_rl.hf`); local <-> global, which needs the process groups, is
`mcore_rl.models.shards`. The exporter, the weight sync to inference engines and the parity tests
all go through these two, so a name means the same thing everywhere (docs/design.md#weights-by-name).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from mcore_rl.config.model_keys.attn_res import AttnResKeys
from mcore_rl.config.model_keys.latent_moe import LatentMoEKeys
from mcore_rl.config.model_keys.moe import MoEKeys
from mcore_rl.config.model_keys.mtp import MTPKeys
from mcore_rl.config.model_keys.ngram import NgramEmbeddingConfig
from mcore_rl.config.schema import ModelConfig
from mcore_rl.hf.families import family_named
from mcore_rl.hf.ngram import padded_table_rows

# A megatron layer parameter (layer index, rest) and, within a layer, an expert one (expert index, rest).
LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
EXPERT_NAME = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")

# AttnRes depth mixers per layer (pseudo-query [d], key norm [d]): replicated, same name on both sides
_ATTN_RES_LAYER = ("attn_res.query", "attn_res.norm.weight", "mlp_res.query", "mlp_res.norm.weight")
_ATTN_RES_TOP = ("decoder.final_res.query", "decoder.final_res.norm.weight")

# An MTP head of `models/mtp.py` (depth index, rest) and its own tensors besides its decoder layer
MTP_NAME = re.compile(r"^mtp\.layers\.(\d+)\.(.*)$")
_MTP_DIRECT = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}

# megatron suffix within a layer -> HF suffix within a layer (one-to-one tensors)
_LAYER_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",  # TE spec
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",  # TE spec
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",  # Qwen2-MoE [1, hidden], replicated
    # LatentMoE W_down [l, d] / W_up [d, l]: duplicated on TP ranks, same name on both sides
    "mlp.fc1_latent_proj.weight": "mlp.fc1_latent_proj.weight",
    "mlp.fc2_latent_proj.weight": "mlp.fc2_latent_proj.weight",
    **{name: name for name in _ATTN_RES_LAYER},
}
_TOP_DIRECT = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
    "decoder.final_res.query": "model.final_res.query",  # AttnRes output depth mix
    "decoder.final_res.norm.weight": "model.final_res.norm.weight",
}


# --------------------------------------------------------------------------------------------
# megatron global <-> HF (full tensors)
# --------------------------------------------------------------------------------------------


def megatron_to_hf(name: str, tensor: torch.Tensor, mc: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs for one full megatron tensor with a global name."""
    if name.startswith("embedding.ngram."):
        return _ngram_megatron_to_hf(name, tensor, mc)
    if name in _TOP_DIRECT:
        if name == "output_layer.weight" and mc.tie_word_embeddings:
            return []
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            tensor = tensor[: mc.vocab_size]  # vocabulary padding (models/vocab_padding.py) removed
        return [(_TOP_DIRECT[name], tensor)]
    mtp = MTP_NAME.match(name)
    if mtp:  # an MTP head (hf/mtp.py): its own parts, then its decoder layer under the same prefix
        prefix, rest = f"mtp.layers.{mtp.group(1)}.", mtp.group(2)
        if rest in _MTP_DIRECT:
            return [(prefix + _MTP_DIRECT[rest], tensor)]
        if rest.startswith("transformer_layer."):
            return _layer_to_hf(prefix, rest[len("transformer_layer.") :], tensor, mc, name)
        raise KeyError(f"no HF name for megatron parameter {name!r}")
    m = LAYER_NAME.match(name)
    if not m:
        raise KeyError(f"no HF name for megatron parameter {name!r}")
    return _layer_to_hf(f"model.layers.{m.group(1)}.", m.group(2), tensor, mc, name)


def _layer_to_hf(
    prefix: str, rest: str, tensor: torch.Tensor, mc: ModelConfig, name: str
) -> list[tuple[str, torch.Tensor]]:
    """HF pairs of one decoder layer's tensor: `rest` its megatron name within the layer, `prefix`
    the HF layer's (`model.layers.3.`, or an MTP head's `mtp.layers.0.`)."""
    family = family_named(mc.arch)
    if family:  # a family's own names (families.py) before the shared ones
        pairs = family.megatron_to_hf(prefix, rest, tensor, mc)
        if pairs is not None:
            return pairs
    if rest in _LAYER_DIRECT:
        return [(prefix + _LAYER_DIRECT[rest], tensor)]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):  # bias: Qwen2
        leaf = rest.rsplit(".", 1)[1]
        q, k, v = split_qkv(tensor, mc)
        return [
            (prefix + f"self_attn.q_proj.{leaf}", q),
            (prefix + f"self_attn.k_proj.{leaf}", k),
            (prefix + f"self_attn.v_proj.{leaf}", v),
        ]
    if rest == "mlp.linear_fc1.weight":
        gate, up = tensor.chunk(2, dim=0)
        return [(prefix + "mlp.gate_proj.weight", gate), (prefix + "mlp.up_proj.weight", up)]
    if rest == "mlp.shared_experts.linear_fc1.weight":
        gate, up = tensor.chunk(2, dim=0)
        return [
            (prefix + "mlp.shared_expert.gate_proj.weight", gate),
            (prefix + "mlp.shared_expert.up_proj.weight", up),
        ]
    e = EXPERT_NAME.match(rest)
    if e:
        expert, leaf = e.group(1), e.group(2)
        ep = f"{prefix}mlp.experts.{expert}."
        if leaf == "linear_fc1.weight":
            gate, up = tensor.chunk(2, dim=0)
            return [(ep + "gate_proj.weight", gate), (ep + "up_proj.weight", up)]
        if leaf == "linear_fc2.weight":
            return [(ep + "down_proj.weight", tensor)]
    raise KeyError(f"no HF name for megatron parameter {name!r}")


def hf_to_megatron(hf: dict[str, torch.Tensor], mc: ModelConfig) -> dict[str, torch.Tensor]:
    """Full megatron tensors (global names, local-spec naming) from an HF state dict."""
    out: dict[str, torch.Tensor] = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not mc.tie_word_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    attn_res = mc.section(AttnResKeys).attn_res != "none"
    experts = mc.section(MoEKeys)
    pattern = experts.moe_layer_pattern
    for name in _ATTN_RES_TOP if attn_res else ():
        out[name] = hf[_TOP_DIRECT[name]]
    for layer in range(mc.num_layers):
        p, q = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        for name in _ATTN_RES_LAYER if attn_res else ():
            out[q + name] = hf[p + name]
        out.update(_layer_to_megatron(hf, p, q, mc, mc.is_moe and (pattern is None or bool(pattern[layer]))))
    for depth in range(mc.section(MTPKeys).mtp_num_layers):  # MTP heads (hf/mtp.py): parts, then the layer
        p, q = f"mtp.layers.{depth}.", f"mtp.layers.{depth}."
        out.update({q + meg: hf[p + own] for meg, own in _MTP_DIRECT.items()})
        out.update(_layer_to_megatron(hf, p, q + "transformer_layer.", mc, mc.is_moe))
    out.update(_ngram_hf_to_megatron(hf, mc))
    return out


def _layer_to_megatron(
    hf: dict[str, torch.Tensor], p: str, q: str, mc: ModelConfig, moe_layer: bool
) -> dict[str, torch.Tensor]:
    """One decoder layer's tensors: HF layer prefix `p` -> megatron layer prefix `q`."""
    experts = mc.section(MoEKeys)
    family = family_named(mc.arch)
    out = {
        q + "input_layernorm.weight": hf[p + "input_layernorm.weight"],
        q + "pre_mlp_layernorm.weight": hf[p + "post_attention_layernorm.weight"],
    }
    if family:  # the family's own names; a family with the GQA decoder's attention names its MLP only
        out.update(family.hf_to_megatron(hf, p, q, mc, moe_layer))
        if family.attention is None:
            out.update(_attention_to_megatron(hf, p, q, mc))
        return out
    out.update(_attention_to_megatron(hf, p, q, mc))
    if not moe_layer:  # dense model, or a dense layer of a mixed one (moe_layer_pattern)
        out[q + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], dim=0
        )
        out[q + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
        return out
    out[q + "mlp.router.weight"] = hf[p + "mlp.gate.weight"]
    for expert in range(experts.num_experts):
        he, me = f"{p}mlp.experts.{expert}.", f"{q}mlp.experts.local_experts.{expert}."
        out[me + "linear_fc1.weight"] = torch.cat([hf[he + "gate_proj.weight"], hf[he + "up_proj.weight"]], dim=0)
        out[me + "linear_fc2.weight"] = hf[he + "down_proj.weight"]
    if mc.section(LatentMoEKeys).moe_latent_size:
        for proj in ("fc1_latent_proj", "fc2_latent_proj"):
            out[f"{q}mlp.{proj}.weight"] = hf[f"{p}mlp.{proj}.weight"]
    if experts.moe_shared_expert_intermediate_size:
        hs, ms = p + "mlp.shared_expert.", q + "mlp.shared_experts."
        out[ms + "linear_fc1.weight"] = torch.cat([hf[hs + "gate_proj.weight"], hf[hs + "up_proj.weight"]], dim=0)
        out[ms + "linear_fc2.weight"] = hf[hs + "down_proj.weight"]
        if experts.moe_shared_expert_gate:  # Qwen2-MoE
            out[ms + "gate_weight"] = hf[p + "mlp.shared_expert_gate.weight"]
    return out


# Over-Encoding (mcore_rl/hf/ngram.py, mcore_rl/models/ngram_embedding.py). megatron keeps one table
# per order n with the k slices side by side, rows padded to `padded_table_rows(m)`
# (`embedding.ngram.tables.{n}.weight` [rows, k*w]) and one projection per order
# (`embedding.ngram.projections.{n}.weight` [hidden, k*w]); HF keeps each slice apart
# (`model.ngram_embeddings.{tables,projections}.{n}.{i}.weight`, [m, w] / [hidden, w]).
def _attention_to_megatron(hf: Mapping[str, torch.Tensor], p: str, q: str, mc: ModelConfig) -> dict[str, torch.Tensor]:
    """One layer's GQA attention: HF layer prefix `p` -> megatron layer prefix `q`."""
    out = {
        q + "self_attention.linear_qkv.weight": merge_qkv(
            hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.k_proj.weight"], hf[p + "self_attn.v_proj.weight"], mc
        ),
        q + "self_attention.linear_proj.weight": hf[p + "self_attn.o_proj.weight"],
    }
    if mc.add_qkv_bias:  # Qwen2: fused like the weight rows, so each TP rank gets its groups' biases
        out[q + "self_attention.linear_qkv.bias"] = merge_qkv(
            hf[p + "self_attn.q_proj.bias"], hf[p + "self_attn.k_proj.bias"], hf[p + "self_attn.v_proj.bias"], mc
        )
    if mc.qk_layernorm:
        out[q + "self_attention.q_layernorm.weight"] = hf[p + "self_attn.q_norm.weight"]
        out[q + "self_attention.k_layernorm.weight"] = hf[p + "self_attn.k_norm.weight"]
    return out


_NGRAM = re.compile(r"^embedding\.ngram\.(tables|projections)\.(\d+)\.weight$")


def _ngram_megatron_to_hf(name: str, tensor: torch.Tensor, mc: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    ngram = mc.section(NgramEmbeddingConfig)
    m = _NGRAM.match(name)
    if not m:
        raise KeyError(f"no HF name for megatron parameter {name!r}")
    kind, order = m.group(1), m.group(2)
    if kind == "tables":
        tensor = tensor[: ngram.table_size]
    k = ngram.num_slices
    return [
        (f"model.ngram_embeddings.{kind}.{order}.{i}.weight", part)
        for i, part in enumerate(tensor.split(tensor.shape[1] // k, dim=1))
    ]


def _ngram_hf_to_megatron(hf: Mapping[str, torch.Tensor], mc: ModelConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    k = mc.section(NgramEmbeddingConfig).num_slices
    for n in mc.section(NgramEmbeddingConfig).orders:
        p = "model.ngram_embeddings."
        table = torch.cat([hf[f"{p}tables.{n}.{i}.weight"] for i in range(k)], dim=1)
        pad = table.new_zeros(
            padded_table_rows(mc.section(NgramEmbeddingConfig).table_size) - table.shape[0], table.shape[1]
        )
        out[f"embedding.ngram.tables.{n}.weight"] = torch.cat([table, pad], dim=0)
        out[f"embedding.ngram.projections.{n}.weight"] = torch.cat(
            [hf[f"{p}projections.{n}.{i}.weight"] for i in range(k)], dim=1
        )
    return out


def full_megatron_to_hf(sd: dict[str, torch.Tensor], mc: ModelConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in sd.items():
        out.update(megatron_to_hf(name, tensor, mc))
    return out


def split_qkv(qkv: torch.Tensor, mc: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's fused QKV is grouped per KV head: [g0: q.. k v][g1: q.. k v]…"""
    groups, hd = mc.num_query_groups, mc.head_dim
    q_per_group = mc.num_attention_heads // groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, (q_per_group + 2) * hd, *rest)
    q, k, v = grouped.split([q_per_group * hd, hd, hd], dim=1)
    return (
        q.reshape(groups * q_per_group * hd, *rest),
        k.reshape(groups * hd, *rest),
        v.reshape(groups * hd, *rest),
    )


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mc: ModelConfig) -> torch.Tensor:
    groups, hd = mc.num_query_groups, mc.head_dim
    rest = q.shape[1:]
    merged = torch.cat(
        [q.reshape(groups, -1, *rest), k.reshape(groups, hd, *rest), v.reshape(groups, hd, *rest)],
        dim=1,
    )
    return merged.reshape(-1, *rest)
