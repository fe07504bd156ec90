"""The reference model's KV cache as a `transformers` `Cache` (what `generate` passes and expects back).

The attention layers work on per-layer (k, v) tuples [b, kv_heads, s, head_dim] (keys after QK-norm
and RoPE): `layer_pasts` reads them out of a `Cache` (or a legacy list) before a forward, and
`store_presents` hands the new positions back to the `Cache` after it. A `DynamicCache` is the
default, as in stock transformers models; a legacy list passed in comes back as an extended list
(the engines and older callers keep working). Part of the remote-code modeling files: imports only
torch and transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from transformers.cache_utils import Cache, DynamicCache

from .layers import KVCache

if TYPE_CHECKING:
    from transformers.cache_utils import CacheLayerMixin


def new_cache(config: Any) -> DynamicCache:
    """An empty `DynamicCache` for this model (what `generate` would create)."""
    return DynamicCache(config=config)


def past_length(past: Any) -> int:
    """Positions already cached (0 for None or an empty cache)."""
    if past is None:
        return 0
    if isinstance(past, Cache):
        return past.get_seq_length()
    return past[0][0].shape[2] if len(past) else 0


def layer_pasts(past: Any) -> KVCache | None:
    """Per-layer (k, v) of the cached positions, None when nothing is cached."""
    if past is None or past_length(past) == 0:
        return None
    if isinstance(past, Cache):
        # attention layers only (this model builds no linear-attention ones), filled: past_length > 0
        layers = cast("list[CacheLayerMixin]", past.layers)
        return [(cast(torch.Tensor, layer.keys), cast(torch.Tensor, layer.values)) for layer in layers]
    return list(past)


def store_presents(past: Any, presents: KVCache, new_tokens: int) -> Any:
    """Record the forward's per-layer (k, v): its last `new_tokens` positions appended to a `Cache`,
    or the list itself returned for a legacy (list) cache. (A sliding-window layer of a `Cache` keeps
    only its window, so what a layer held before is not known by position.)"""
    if not isinstance(past, Cache):
        return presents
    for i, (k, v) in enumerate(presents):
        past.update(k[:, :, k.shape[2] - new_tokens :], v[:, :, v.shape[2] - new_tokens :], i)
    return past


def ngram_context_of(past: Any) -> torch.Tensor | None:
    """The n-gram context a cache carries (Over-Encoding), None when it carries none."""
    return getattr(past, "ngram_context", None)
