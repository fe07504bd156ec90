"""Weight names and layouts between megatron-core models and Hugging Face checkpoints.

Three views of the same weights:
- *HF*: `model.layers.3.self_attn.q_proj.weight`, … (stock Qwen3 / Qwen3-MoE checkpoint names).
- *megatron global*: the megatron-core name with the global layer and expert index, unsharded —
  `decoder.layers.3.self_attention.linear_qkv.weight` (q/k/v interleaved per query group),
  `decoder.layers.3.mlp.experts.local_experts.17.linear_fc1.weight` ([gate; up]).
- *megatron local*: a parameter on one rank: local layer/expert index, TP/ETP shard.

The exporter, the weight sync to inference engines and the parity tests all go through this module,
so a name means the same thing everywhere (DESIGN.md decision 4).
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from mcore_rl.config.schema import ModelConfig
from mcore_rl.hf.ngram import padded_table_rows

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")

# AttnRes depth mixers per layer (pseudo-query [d], key norm [d]): replicated, same name on both sides
_ATTN_RES_LAYER = ("attn_res.query", "attn_res.norm.weight", "mlp_res.query", "mlp_res.norm.weight")
_ATTN_RES_TOP = ("decoder.final_res.query", "decoder.final_res.norm.weight")

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
        return [(_TOP_DIRECT[name], tensor)]
    m = _LAYER.match(name)
    if not m:
        raise KeyError(f"no HF name for megatron parameter {name!r}")
    layer, rest = m.group(1), m.group(2)
    prefix = f"model.layers.{layer}."
    if rest in _LAYER_DIRECT:
        return [(prefix + _LAYER_DIRECT[rest], tensor)]
    if rest == "self_attention.linear_qkv.weight":
        q, k, v = split_qkv(tensor, mc)
        return [
            (prefix + "self_attn.q_proj.weight", q),
            (prefix + "self_attn.k_proj.weight", k),
            (prefix + "self_attn.v_proj.weight", v),
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
    e = _EXPERT.match(rest)
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
    attn_res = mc.attn_res != "none"
    for name in _ATTN_RES_TOP if attn_res else ():
        out[name] = hf[_TOP_DIRECT[name]]
    for layer in range(mc.num_layers):
        p, q = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        for name in _ATTN_RES_LAYER if attn_res else ():
            out[q + name] = hf[p + name]
        out[q + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[q + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        out[q + "self_attention.linear_qkv.weight"] = merge_qkv(
            hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.k_proj.weight"],
            hf[p + "self_attn.v_proj.weight"], mc,
        )
        out[q + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        if mc.qk_layernorm:
            out[q + "self_attention.q_layernorm.weight"] = hf[p + "self_attn.q_norm.weight"]
            out[q + "self_attention.k_layernorm.weight"] = hf[p + "self_attn.k_norm.weight"]
        if not mc.is_moe:
            out[q + "mlp.linear_fc1.weight"] = torch.cat(
                [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], dim=0
            )
            out[q + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
            continue
        out[q + "mlp.router.weight"] = hf[p + "mlp.gate.weight"]
        for expert in range(mc.num_experts):
            he, me = f"{p}mlp.experts.{expert}.", f"{q}mlp.experts.local_experts.{expert}."
            out[me + "linear_fc1.weight"] = torch.cat(
                [hf[he + "gate_proj.weight"], hf[he + "up_proj.weight"]], dim=0
            )
            out[me + "linear_fc2.weight"] = hf[he + "down_proj.weight"]
        if mc.moe_latent_size:
            for proj in ("fc1_latent_proj", "fc2_latent_proj"):
                out[f"{q}mlp.{proj}.weight"] = hf[f"{p}mlp.{proj}.weight"]
        if mc.moe_shared_expert_intermediate_size:
            hs, ms = p + "mlp.shared_expert.", q + "mlp.shared_experts."
            out[ms + "linear_fc1.weight"] = torch.cat(
                [hf[hs + "gate_proj.weight"], hf[hs + "up_proj.weight"]], dim=0
            )
            out[ms + "linear_fc2.weight"] = hf[hs + "down_proj.weight"]
    out.update(_ngram_hf_to_megatron(hf, mc))
    return out


# Over-Encoding (mcore_rl/hf/ngram.py, mcore_rl/models/ngram_embedding.py). megatron keeps one table
# per order n with the k slices side by side, rows padded to `padded_table_rows(m)`
# (`embedding.ngram.tables.{n}.weight` [rows, k*w]) and one projection per order
# (`embedding.ngram.projections.{n}.weight` [hidden, k*w]); HF keeps each slice apart
# (`model.ngram_embeddings.{tables,projections}.{n}.{i}.weight`, [m, w] / [hidden, w]).
_NGRAM = re.compile(r"^embedding\.ngram\.(tables|projections)\.(\d+)\.weight$")


def _ngram_megatron_to_hf(name: str, tensor: torch.Tensor, mc: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    m = _NGRAM.match(name)
    if not m:
        raise KeyError(f"no HF name for megatron parameter {name!r}")
    kind, order = m.group(1), m.group(2)
    if kind == "tables":
        tensor = tensor[: mc.ngram.table_size]
    k = mc.ngram.num_slices
    return [
        (f"model.ngram_embeddings.{kind}.{order}.{i}.weight", part)
        for i, part in enumerate(tensor.split(tensor.shape[1] // k, dim=1))
    ]


def _ngram_hf_to_megatron(hf: dict[str, torch.Tensor], mc: ModelConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    k = mc.ngram.num_slices
    for n in mc.ngram.orders:
        p = "model.ngram_embeddings."
        table = torch.cat([hf[f"{p}tables.{n}.{i}.weight"] for i in range(k)], dim=1)
        pad = table.new_zeros(padded_table_rows(mc.ngram.table_size) - table.shape[0], table.shape[1])
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


# --------------------------------------------------------------------------------------------
# megatron local (one rank's shard) <-> megatron global (full)
# --------------------------------------------------------------------------------------------


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _is_gated_fc1(name: str) -> bool:
    return name.endswith("linear_fc1.weight")


def _tp_group_rank_size(param: torch.nn.Parameter, global_name: str) -> tuple[Optional[dist.ProcessGroup], int, int]:
    from megatron.core import parallel_state as ps

    if _is_expert(global_name):
        return (
            ps.get_expert_tensor_parallel_group(),
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_world_size(),
        )
    return (
        ps.get_tensor_model_parallel_group(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
    )


def iter_local_params(chunks: Iterable[torch.nn.Module]) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """(local name, global name, param) for every parameter of this rank's model chunks."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    for chunk in chunks:
        module = _unwrap(chunk)
        config = module.config
        vp_stage = getattr(module, "vp_stage", None)
        layer_offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        num_local_experts = (config.num_moe_experts or 0) // ps.get_expert_model_parallel_world_size()
        expert_offset = ps.get_expert_model_parallel_rank() * num_local_experts
        for local_name, param in module.named_parameters():
            yield local_name, _global_name(local_name, layer_offset, expert_offset), param


def _global_name(local: str, layer_offset: int, expert_offset: int) -> str:
    m = _LAYER.match(local)
    if not m:
        return local
    rest = m.group(2)
    e = _EXPERT.match(rest)
    if e:
        rest = f"mlp.experts.local_experts.{int(e.group(1)) + expert_offset}.{e.group(2)}"
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{rest}"


def shard_for_rank(full: torch.Tensor, param: torch.nn.Parameter, global_name: str) -> torch.Tensor:
    """This rank's TP/ETP slice of a full megatron tensor."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    if getattr(param, "data_parallel_sharded", False):  # n-gram tables: shard dp_rank * tp + tp_rank
        full = full.chunk(_dp_size(), dim=param.partition_dim)[_dp_rank()]
    _, rank, size = _tp_group_rank_size(param, global_name)
    dim = param.partition_dim
    if _is_gated_fc1(global_name):  # [gate; up]: each half is split, then re-concatenated
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return full.chunk(size, dim=dim)[rank]


def unshard(shards: list[torch.Tensor], param: torch.nn.Parameter, global_name: str) -> torch.Tensor:
    dim = param.partition_dim
    if _is_gated_fc1(global_name):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


@torch.no_grad()
def load_full_state_dict(chunks: Iterable[torch.nn.Module], full: dict[str, torch.Tensor]) -> None:
    """Copy full megatron tensors (global names) into this rank's shards."""
    for _, global_name, param in iter_local_params(chunks):
        source = full.get(global_name)
        if source is None and global_name == "output_layer.weight":
            source = full["embedding.word_embeddings.weight"]  # tied embeddings under PP
        if source is None:
            raise KeyError(f"state dict has no tensor for {global_name!r}")
        param.copy_(shard_for_rank(source, param, global_name).to(param.dtype))


def gather_full_state_dict(
    chunks: Iterable[torch.nn.Module], grads: bool = False
) -> dict[str, torch.Tensor]:
    """Full megatron tensors (global names) of the whole model, on every rank.

    `grads=True` gathers `main_grad` (or `.grad`) instead of the weights. Uses object collectives
    over the world: meant for tests, export and small models; the weight sync streams buckets.
    """
    local: dict[str, torch.Tensor] = {}
    for _, global_name, param in iter_local_params(chunks):
        if getattr(param, "shared_embedding", False) and global_name == "output_layer.weight":
            continue  # the last stage's copy of a tied embedding
        value = _grad_of(param) if grads else param.detach()
        if getattr(param, "tensor_model_parallel", False):
            group, _, size = _tp_group_rank_size(param, global_name)
            if size > 1:
                shards = [torch.empty_like(value) for _ in range(size)]
                dist.all_gather(shards, value.contiguous(), group=group)
                value = unshard(shards, param, global_name)
        value = gather_data_parallel_shards(param, value)
        local[global_name] = value.cpu().clone()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    everyone: list[Optional[dict[str, torch.Tensor]]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    merged: dict[str, torch.Tensor] = {}
    for part in everyone:
        merged.update(part or {})
    return merged


def _dp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size()


def _dp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank()


def gather_data_parallel_shards(param: torch.nn.Parameter, value: torch.Tensor) -> torch.Tensor:
    """For a param sharded over data parallel too (`data_parallel_sharded`, n-gram tables with
    `shard_over_data_parallel`): the concatenation of all DP ranks' TP-gathered `value`s (every DP
    rank must call it). Any other param: `value` unchanged."""
    if not getattr(param, "data_parallel_sharded", False) or _dp_size() == 1:
        return value
    from megatron.core import parallel_state as ps

    parts = [torch.empty_like(value) for _ in range(_dp_size())]
    dist.all_gather(parts, value.contiguous(), group=ps.get_data_parallel_group())
    return torch.cat(parts, dim=param.partition_dim)


def _grad_of(param: torch.nn.Parameter) -> torch.Tensor:
    grad = getattr(param, "main_grad", None)
    if grad is None:
        grad = param.grad
    if grad is None:
        return torch.zeros_like(param, dtype=torch.float32)
    return grad.detach().float()


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module
