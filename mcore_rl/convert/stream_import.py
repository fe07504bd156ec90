"""Streaming hf-to-mcore: each rank reads only the slices of the HF tensors it owns, one tensor at a time.

For every local megatron parameter, `weight_map.megatron_to_hf` (on a *meta* tensor of the full
shape, so nothing is computed) names the HF tensors it is made of; the rank reads its rows of each
(safetensors `get_slice` along the TP/ETP split dimension; per query group for the fused QKV, per
half for [gate; up]), fuses them as megatron lays them out and copies the result into the parameter.
Where a family lays a tensor out otherwise than megatron does (`ModelFamily.megatron_from_hf`:
GPT-OSS's experts, transposed with gate and up interleaved), the rank reads the whole HF tensor (one
expert's slice of a stacked one: `HFCheckpoint`) and cuts its rows after the change.
No full-model dict exists anywhere, and a TP rank never reads the rows of its peers.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING
from collections.abc import Iterable

import torch

from mcore_rl.config.model_keys.ngram import NgramEmbeddingConfig
from mcore_rl.convert.hf_checkpoint import HFCheckpoint
from mcore_rl.convert.streaming import StreamStats, nbytes, owned_range, tensor_split
from mcore_rl.hf.families import family_named
from mcore_rl.hf.weight_map import LAYER_NAME, _ngram_hf_to_megatron, megatron_to_hf, merge_qkv
from mcore_rl.models.shards import _dp_size, iter_local_params, shard_for_rank
from mcore_rl.progress import progress

if TYPE_CHECKING:
    from mcore_rl.config.schema import ModelConfig

_QKV = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")  # fused per query group


def full_shape(param: torch.Tensor, global_name: str) -> list[int]:
    """The shape of the whole megatron tensor a (TP/ETP and DP sharded) parameter is a slice of."""

    shape = list(param.shape)
    dim, _, size = tensor_split(param, global_name)
    shape[dim] *= size
    if getattr(param, "data_parallel_sharded", False):
        shape[dim] *= _dp_size()
    return shape


def read_owned_shard(
    source: HFCheckpoint,
    param: torch.Tensor,
    global_name: str,
    mc: ModelConfig,
    stats: StreamStats | None = None,
) -> torch.Tensor:
    """This rank's slice of the megatron tensor `global_name`, read from the HF checkpoint."""

    name = global_name
    if name == "output_layer.weight" and mc.tie_word_embeddings:
        name = "embedding.word_embeddings.weight"  # tied: the last stage's copy of the embedding
    if name.startswith("embedding.ngram.") or getattr(param, "data_parallel_sharded", False):
        full = _ngram_table(source, name, mc)  # small tables: built whole, then cut as megatron does
        shard = shard_for_rank(full, param, global_name)
        if stats:
            stats.held(full, shard)
        return shard
    dim, rank, size = tensor_split(param, global_name)
    family, layer = family_named(mc.arch), LAYER_NAME.match(name)
    if family and family.megatron_from_hf and layer:  # a layout the family changes (GPT-OSS's experts)
        whole = family.megatron_from_hf(f"model.layers.{layer.group(1)}.", layer.group(2), source.__getitem__, mc)
        if whole is not None:
            start, stop = owned_range(whole.shape[dim], rank, size)
            shard = whole.narrow(dim, start, stop - start).contiguous() if size > 1 else whole
            if stats:
                stats.held(whole, shard)
            return shard
    meta = torch.empty(full_shape(param, global_name), dtype=param.dtype, device="meta")
    pieces = megatron_to_hf(name, meta, mc)
    if len(pieces) == 1:
        hf_name, piece = pieces[0]
        start, stop = owned_range(meta.shape[dim], rank, size)
        shard = _read_padded_rows(source, hf_name, dim, start, stop, piece.shape[dim])
        if stats:
            stats.held(shard)
        return shard
    if dim != 0:
        raise ValueError(f"{global_name}: cannot stream a tensor fused from {len(pieces)} HF tensors along dim {dim}")
    # fused along rows (QKV per query group, [gate; up] per half): the same fraction of every part
    parts = [source.read_rows(hf_name, 0, *owned_range(piece.shape[0], rank, size)) for hf_name, piece in pieces]
    if global_name.endswith(_QKV):
        local = dataclasses.replace(
            mc,
            num_query_groups=mc.num_query_groups // size,
            num_attention_heads=mc.num_attention_heads // size,
            kv_channels=mc.head_dim,
        )
        q, k, v = parts  # the three HF tensors of a fused QKV
        shard = merge_qkv(q, k, v, local)
    else:
        shard = torch.cat(parts, dim=0)
    if stats:
        stats.held(*parts, shard)
    return shard


def _read_padded_rows(source: HFCheckpoint, hf_name: str, dim: int, start: int, stop: int, rows: int) -> torch.Tensor:
    """Rows [start, stop) along `dim` of an HF tensor that has `rows` of them; rows past its end are
    the model's vocabulary padding (`models/vocab_padding.py`: the megatron table is longer than the
    HF one) and come back as zeros."""
    if stop <= rows:
        return source.read_rows(hf_name, dim, start, stop)
    real = source.read_rows(hf_name, dim, min(start, rows), rows)
    shape = list(real.shape)
    shape[dim] = stop - start - real.shape[dim]
    return torch.cat([real, real.new_zeros(shape)], dim=dim)


def _ngram_table(source: HFCheckpoint, name: str, mc: ModelConfig) -> torch.Tensor:
    """A whole n-gram table or projection of one order (`weight_map`'s layout), from its k slices."""

    m = re.match(r"^embedding\.ngram\.(?:tables|projections)\.(\d+)\.weight$", name)
    if not m:
        raise KeyError(f"no HF tensors for megatron parameter {name!r}")
    one_order = mc.with_sections(dataclasses.replace(mc.section(NgramEmbeddingConfig), orders=[int(m.group(1))]))
    return _ngram_hf_to_megatron(source, one_order)[name]


@torch.no_grad()
def stream_load(
    chunks: Iterable[torch.nn.Module], source: HFCheckpoint, mc: ModelConfig, stats: StreamStats | None = None
) -> StreamStats:
    """Copy the HF checkpoint into this rank's parameters, one owned slice at a time (rank 0 draws a bar)."""

    stats = stats if stats is not None else StreamStats()
    params = list(iter_local_params(chunks, with_buffers=True))  # with DeepSeek-V3's expert bias
    with progress(sum(nbytes(p) for _, _, p in params), "import (rank 0 shard)", unit="B") as bar:
        for i, (_, global_name, param) in enumerate(params):
            shard = read_owned_shard(source, param, global_name, mc, stats)
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(
                    f"{global_name}: read a slice of shape {tuple(shard.shape)}, the parameter has {tuple(param.shape)}"
                )
            param.copy_(shard)
            stats.moved(param)
            bar.set_postfix_str(f"{i + 1}/{len(params)} tensors", refresh=False)
            bar.update(nbytes(param))
    return stats
