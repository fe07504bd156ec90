"""One rank's shards of megatron-core parameters <-> full tensors with global names.

The megatron side of `mcore_rl.hf.weight_map` (whose name and tensor maps stay free of megatron, so
`mcore_rl.hf` never imports it): global names of local parameters (layer and expert offsets of
this pipeline stage and expert-parallel rank), TP/ETP/DP slicing and gathering, and loading or
gathering a whole model's state dict. The exporter, the weight sync and the tests use these.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from mcore_rl.hf.weight_map import EXPERT_NAME, LAYER_NAME
from mcore_rl.models.vocab_padding import pad_vocab_rows
from mcore_rl.models.param_attrs import megatron_attrs

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _is_gated_fc1(name: str) -> bool:
    return name.endswith("linear_fc1.weight")


def _tp_group_rank_size(param: torch.Tensor, global_name: str) -> tuple[dist.ProcessGroup | None, int, int]:
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


# Buffers that are weights of the model (saved, exported, synced) though no optimizer updates them:
# the DeepSeek-V3 router's expert bias, moved toward balance in finalize_model_grads.
WEIGHT_BUFFERS = ("mlp.router.expert_bias",)


def iter_local_params(
    chunks: Iterable[torch.nn.Module], with_buffers: bool = False
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(local name, global name, param) for every parameter of this rank's model chunks;
    `with_buffers` adds the `WEIGHT_BUFFERS` (replicated tensors, no gradient)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    for chunk in chunks:
        module = unwrap_model(chunk)
        config = cast("TransformerConfig", module.config)
        vp_stage = getattr(module, "vp_stage", None)
        layer_offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        num_local_experts = (config.num_moe_experts or 0) // ps.get_expert_model_parallel_world_size()
        expert_offset = ps.get_expert_model_parallel_rank() * num_local_experts
        for local_name, param in module.named_parameters():
            yield local_name, _global_name(local_name, layer_offset, expert_offset), param
        if with_buffers:
            for local_name, buf in module.named_buffers():
                if buf is not None and local_name.endswith(WEIGHT_BUFFERS):
                    yield local_name, _global_name(local_name, layer_offset, expert_offset), buf


def _global_name(local: str, layer_offset: int, expert_offset: int) -> str:
    m = LAYER_NAME.match(local)
    if not m:
        return local
    rest = m.group(2)
    e = EXPERT_NAME.match(rest)
    if e:
        rest = f"mlp.experts.local_experts.{int(e.group(1)) + expert_offset}.{e.group(2)}"
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{rest}"


def shard_for_rank(full: torch.Tensor, param: torch.Tensor, global_name: str) -> torch.Tensor:
    """This rank's TP/ETP slice of a full megatron tensor (a true-size vocabulary is padded first)."""
    if not getattr(param, "tensor_model_parallel", False):
        return pad_vocab_rows(global_name, full, param.shape[0])
    if getattr(param, "data_parallel_sharded", False):  # n-gram tables: shard dp_rank * tp + tp_rank
        full = full.chunk(_dp_size(), dim=megatron_attrs(param).partition_dim)[_dp_rank()]
    _, rank, size = _tp_group_rank_size(param, global_name)
    dim = megatron_attrs(param).partition_dim
    full = pad_vocab_rows(global_name, full, param.shape[0] * size)
    if _is_gated_fc1(global_name):  # [gate; up]: each half is split, then re-concatenated
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return full.chunk(size, dim=dim)[rank]


def unshard(shards: list[torch.Tensor], param: torch.Tensor, global_name: str) -> torch.Tensor:
    dim = megatron_attrs(param).partition_dim
    if _is_gated_fc1(global_name):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


@torch.no_grad()
def load_full_state_dict(chunks: Iterable[torch.nn.Module], full: dict[str, torch.Tensor]) -> None:
    """Copy full megatron tensors (global names) into this rank's shards."""
    for _, global_name, param in iter_local_params(chunks, with_buffers=True):
        source = full.get(global_name)
        if source is None and global_name == "output_layer.weight":
            source = full["embedding.word_embeddings.weight"]  # tied embeddings under PP
        if source is None:
            raise KeyError(f"state dict has no tensor for {global_name!r}")
        param.copy_(shard_for_rank(source, param, global_name).to(param.dtype))


def gather_full_state_dict(chunks: Iterable[torch.nn.Module], grads: bool = False) -> dict[str, torch.Tensor]:
    """Full megatron tensors (global names) of the whole model, on every rank.

    `grads=True` gathers `main_grad` (or `.grad`) instead of the weights. Uses object collectives
    over the world: meant for tests, export and small models; the weight sync streams buckets.
    """
    local: dict[str, torch.Tensor] = {}
    for _, global_name, param in iter_local_params(chunks, with_buffers=not grads):
        if getattr(param, "shared_embedding", False) and global_name == "output_layer.weight":
            continue  # the last stage's copy of a tied embedding
        value = grad_of(param) if grads else param.detach()
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
    everyone: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
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


def gather_data_parallel_shards(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """For a param sharded over data parallel too (`data_parallel_sharded`, n-gram tables with
    `shard_over_data_parallel`): the concatenation of all DP ranks' TP-gathered `value`s (every DP
    rank must call it). Any other param: `value` unchanged."""
    if not getattr(param, "data_parallel_sharded", False) or _dp_size() == 1:
        return value
    from megatron.core import parallel_state as ps

    parts = [torch.empty_like(value) for _ in range(_dp_size())]
    dist.all_gather(parts, value.contiguous(), group=ps.get_data_parallel_group())
    return torch.cat(parts, dim=megatron_attrs(param).partition_dim)


def grad_of(param: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient in fp32: `main_grad` (megatron DDP's buffer), else `.grad`, else zeros."""
    grad = getattr(param, "main_grad", None)
    if grad is None:
        grad = param.grad
    if grad is None:
        return torch.zeros_like(param, dtype=torch.float32)
    return grad.detach().float()


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """The megatron-core model inside its wrappers (DDP and the like keep it as `.module`)."""
    while hasattr(module, "module"):
        module = cast(torch.nn.Module, module.module)  # the wrapped model
    return module
