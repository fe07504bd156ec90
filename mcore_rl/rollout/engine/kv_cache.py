"""A slot-per-request KV cache, preallocated and grown by doubling along the sequence axis.

Running requests occupy slots 0..B-1 contiguously (the scheduler moves the last request into a
freed slot), so attention for the running batch reads a plain view `k[layer, :B, :, :T]` — no
gather and no per-step concatenation. Memory is zero-initialised: a masked (zero-probability) key
position then multiplies a finite value, never a NaN left over in uninitialised memory.
"""

from __future__ import annotations

import torch


class SlotKVCache:
    """k, v: [layers, slots, kv_heads, capacity, head_dim]; capacity grows up to `max_len`."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        initial_len: int = 256,
    ) -> None:
        self.shape_head = (num_layers, num_slots, kv_heads)
        self.head_dim = head_dim
        self.max_len = max_len
        self.dtype, self.device = dtype, device
        self.capacity = 0
        self.k = self.v = torch.empty(0)
        self._rows: torch.Tensor | None = None
        self._alloc(min(initial_len, max_len))

    def _alloc(self, capacity: int) -> None:
        shape = (*self.shape_head, capacity, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.capacity:
            n = min(self.capacity, capacity)
            k[..., :n, :] = self.k[..., :n, :]
            v[..., :n, :] = self.v[..., :n, :]
        self.k, self.v, self.capacity = k, v, capacity

    def ensure_capacity(self, length: int) -> None:
        """Make room for `length` positions per slot (doubling, capped at max_len)."""
        if length > self.max_len:
            raise ValueError(f"sequence of {length} tokens exceeds the cache's max_len {self.max_len}")
        if length > self.capacity:
            new = self.capacity or 1
            while new < length:
                new *= 2
            self._alloc(min(new, self.max_len))

    def shrink(self, capacity: int = 256) -> None:
        """Drop to a small allocation (`resume_memory` after a release)."""
        self.capacity = 0
        self._alloc(min(capacity, self.max_len))

    def release(self) -> None:
        """Free the cache entirely (`release_memory_occupation`); `shrink()` allocates it again."""
        self.k = self.v = torch.empty(0, dtype=self.dtype, device=self.device)
        self.capacity = 0
        self._rows = None

    @property
    def nbytes(self) -> int:
        return self.k.untyped_storage().nbytes() + self.v.untyped_storage().nbytes()

    def write_block(self, layer: int, slot0: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Prefill: k/v [P, kv_heads, S, D] into slots slot0.., positions 0..S-1."""
        p, _, s, _ = k.shape
        self.k[layer, slot0 : slot0 + p, :, :s] = k
        self.v[layer, slot0 : slot0 + p, :, :s] = v

    def flat_index(self, batch: int, positions: torch.Tensor) -> torch.Tensor:
        """Rows of a layer's cache viewed as [slots * kv_heads * capacity, head_dim] where slot i's
        token at positions[i] goes, for i < batch: [batch * kv_heads] (valid until the cache grows)."""
        if self._rows is None or self._rows.device != positions.device:
            slots, kv = self.shape_head[1:]
            self._rows = torch.arange(slots * kv, device=positions.device).view(slots, kv)  # slot * kv + head
        return (self._rows[:batch] * self.capacity + positions[:, None]).reshape(-1)

    def write_flat(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Decode: k/v [B, kv_heads, D] at the rows `index` of `flat_index` (one index_copy each)."""
        d = self.head_dim
        self.k[layer].view(-1, d).index_copy_(0, index, k.reshape(-1, d))
        self.v[layer].view(-1, d).index_copy_(0, index, v.reshape(-1, d))

    def view(self, layer: int, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of slots 0..batch-1, positions 0..length-1 (a view, no copy)."""
        return self.k[layer, :batch, :, :length], self.v[layer, :batch, :, :length]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot `src`'s first `length` positions into slot `dst` (all layers)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
