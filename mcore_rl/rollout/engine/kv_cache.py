"""The engine's one KV pool: a fixed number of token rows, handed to requests a page at a time.

A slot-per-request cache sized every slot for the longest sequence seen, so one long prompt
multiplied memory by `max_running_requests` (2,000 tokens took a tiny model's server from 1.7 to
7.4 GB; 5,000 got it killed). Here memory is bounded once, in tokens (`max_total_tokens`, SGLang's
`max_total_num_tokens`), whatever the mix: a request holds ceil(tokens / page_size) pages, the
scheduler admits a request only when its pages are free and retracts one when decode runs out
(`EngineCore`), and a request that could never fit is refused up front.

Layout: k, v are [layers, kv_heads, rows, head_dim] with rows = (pages + 1) * page_size; page 0
is the null page, never handed out, which padding positions point at. Each slot (a running
request; slots stay 0..B-1 as in the scheduler) has a row of `page_table`. A decode step gathers
the rows of slots 0..B-1, positions 0..T-1, into one [kv_heads * B, T, head_dim] tensor per layer,
kv-head-major so the gather is a single `index_select` with no transpose copy; positions past a
slot's own length read the null page, which the attention mask gives zero weight.

Memory: the bound is not allocated up front. The pool starts at `INITIAL_PAGES` and doubles (one
copy) when a page beyond it is handed out, up to the bound; pages are handed out lowest first, so
the allocation follows the peak number of tokens in use (at most twice it), and an engine sharing
its device with a trainer takes what its requests use, never more than the bound. The pool is
`torch.empty`, never read before it is written (a position is read only after its K/V were
written; everything else reads the zeroed null page).
"""

from __future__ import annotations

import heapq
import math
import os

import torch

PAGE_SIZE = 16  # tokens per page: the unit of allocation
INITIAL_PAGES = 64  # the pool's first allocation (it doubles up to the bound as pages are handed out)
DEFAULT_MEM_FRACTION_STATIC = {"cuda": 0.88, "cpu": 0.5}  # of the device's memory, weights + KV pool


def pool_tokens(
    *,
    max_total_tokens: int | None,
    mem_fraction_static: float | None,
    device: torch.device,
    weight_bytes: int,
    bytes_per_token: int,
) -> int:
    """The pool's capacity in tokens, with SGLang's semantics: `max_total_tokens` if given; else
    (`mem_fraction_static` x the device's memory) - the weights, over the KV bytes per token. On a
    GPU, as SGLang measures it: the fraction of its total less what is in use now (the weights among
    it); on CPU: of physical RAM, or of the cgroup's limit if lower, less the weights."""
    if max_total_tokens is not None:
        if isinstance(max_total_tokens, bool) or not isinstance(max_total_tokens, int) or max_total_tokens < PAGE_SIZE:
            raise ValueError(
                f"max_total_tokens: must be an integer >= {PAGE_SIZE} (one page), got {max_total_tokens!r}"
            )
        return max_total_tokens
    kind = "cuda" if device.type == "cuda" else "cpu"
    fraction = DEFAULT_MEM_FRACTION_STATIC[kind] if mem_fraction_static is None else mem_fraction_static
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ValueError(f"mem_fraction_static: must be a number in (0, 1), got {mem_fraction_static!r}")
    if kind == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        room = int(fraction * total) - (total - free)
    else:
        total = host_memory_bytes()
        room = int(fraction * total) - weight_bytes
    tokens = room // bytes_per_token
    if tokens < PAGE_SIZE:
        raise ValueError(
            f"mem_fraction_static: {fraction} of {total / 2**30:.1f} GiB leaves {max(room, 0) / 2**20:.0f} MiB "
            f"after the weights ({weight_bytes / 2**20:.0f} MiB), not one page of KV cache "
            f"({PAGE_SIZE} tokens x {bytes_per_token} bytes); raise it or set max_total_tokens"
        )
    return tokens


def host_memory_bytes() -> int:
    """Physical RAM, or this process's cgroup memory limit if that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit():
            total = min(total, int(raw))
    return total


class PagedKVCache:
    """k, v: [layers, kv_heads, (pages + 1) * page_size, head_dim]; slot i's pages in `page_table[i]`."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        kv_heads: int,
        head_dim: int,
        max_tokens: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        page_size: int = PAGE_SIZE,
    ) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.page_size = page_size
        self.num_pages = max_tokens // page_size
        if self.num_pages < 1:
            raise ValueError(f"max_total_tokens: {max_tokens} is less than one page ({page_size} tokens)")
        self.dtype, self.device = dtype, device
        self.max_pages_per_slot = math.ceil(min(max_len, self.capacity) / page_size)
        self.page_table = torch.zeros(num_slots, self.max_pages_per_slot, dtype=torch.long, device=device)
        self._slot_pages: list[list[int]] = [[] for _ in range(num_slots)]
        self._offsets = torch.arange(page_size, device=device)
        self._allocated = 0  # pages backed by k and v (page 0 not counted)
        self.k = self.v = torch.empty(0)
        self.allocate()

    @property
    def capacity(self) -> int:
        """The pool's size in tokens (SGLang's `max_total_num_tokens`)."""
        return self.num_pages * self.page_size

    @property
    def free_pages(self) -> int:
        return len(self._returned) + self.num_pages + 1 - self._fresh

    @property
    def used_tokens(self) -> int:
        return (self.num_pages - self.free_pages) * self.page_size

    def allocate(self) -> None:
        """(Re)allocate the pool (with no page in use), empty but for the zeroed null page."""
        # Free pages: the returned ones (a heap) and those never handed out (>= _fresh). Lowest first
        # keeps the touched memory dense; nothing is listed per page up front (pools run to millions).
        self._returned: list[int] = []
        self._fresh = 1
        self._allocated = 0
        self._resize(min(self.num_pages, INITIAL_PAGES))

    def _resize(self, pages: int) -> None:
        """Back pages 1..`pages` (keeping the K/V of those backed so far)."""
        shape = (self.num_layers, self.kv_heads, (pages + 1) * self.page_size, self.head_dim)
        k = torch.empty(shape, dtype=self.dtype, device=self.device)
        v = torch.empty(shape, dtype=self.dtype, device=self.device)
        keep = (self._allocated + 1) * self.page_size
        if self._allocated:
            k[:, :, :keep] = self.k[:, :, :keep]
            v[:, :, :keep] = self.v[:, :, :keep]
        else:
            k[:, :, :keep].zero_()
            v[:, :, :keep].zero_()
        self.k, self.v, self._allocated = k, v, pages
        self._kv_rows = torch.arange(self.kv_heads, device=self.device) * shape[2]  # a layer's [KV * rows, D] view

    def release(self) -> None:
        """Free the pool's memory (`release_memory_occupation`; only with no slot in use)."""
        assert self.free_pages == self.num_pages, "release with pages in use"
        self.k = self.v = torch.empty(0, dtype=self.dtype, device=self.device)
        self._allocated = 0

    @property
    def nbytes(self) -> int:
        return self.k.untyped_storage().nbytes() + self.v.untyped_storage().nbytes()

    # ---- pages -------------------------------------------------------------------------------

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def missing_pages(self, slot: int, tokens: int) -> int:
        """Pages slot `slot` still needs to hold `tokens` tokens."""
        return max(0, self.pages_for(tokens) - len(self._slot_pages[slot]))

    def reserve(self, slot: int, tokens: int) -> bool:
        """Give slot `slot` pages for `tokens` tokens; False (and nothing taken) if too few are free."""
        need = self.missing_pages(slot, tokens)
        if need > self.free_pages:
            return False
        if need:
            pages = self._slot_pages[slot]
            new = [self._take() for _ in range(need)]
            self.page_table[slot, len(pages) : len(pages) + need] = torch.tensor(new, dtype=torch.long)
            pages.extend(new)
        return True

    def _take(self) -> int:
        if self._returned:
            return heapq.heappop(self._returned)
        if self._fresh > self._allocated:
            self._resize(min(self.num_pages, 2 * self._allocated))
        self._fresh += 1
        return self._fresh - 1

    def free(self, slot: int) -> None:
        """Return slot `slot`'s pages to the pool."""
        pages = self._slot_pages[slot]
        for p in pages:
            heapq.heappush(self._returned, p)
        self.page_table[slot, : len(pages)] = 0
        self._slot_pages[slot] = []

    def move(self, src: int, dst: int) -> None:
        """Slot `src`'s pages become slot `dst`'s (which holds none): no K/V is copied."""
        assert not self._slot_pages[dst], "move into a slot that holds pages"
        n = len(self._slot_pages[src])
        self.page_table[dst, :n] = self.page_table[src, :n]
        self.page_table[src, :n] = 0
        self._slot_pages[dst], self._slot_pages[src] = self._slot_pages[src], []

    # ---- rows --------------------------------------------------------------------------------

    def _slot_rows(self, slot0: int, batch: int, length: int) -> torch.Tensor:
        """[batch, length]: the pool row of each position of slots slot0.., for positions < length."""
        pages = self.page_table[slot0 : slot0 + batch, : self.pages_for(length)]
        rows = pages[:, :, None] * self.page_size + self._offsets
        return rows.reshape(batch, -1)[:, :length]

    def prefill_rows(self, slot0: int, lengths: list[int], width: int) -> torch.Tensor:
        """[batch * width]: where a prefill's K/V go, prompt i at slot slot0 + i (right padding
        beyond a prompt's length goes to the null page)."""
        rows = self._slot_rows(slot0, len(lengths), width)
        lens = torch.tensor(lengths, device=rows.device)
        return rows.masked_fill(torch.arange(width, device=rows.device)[None] >= lens[:, None], 0).reshape(-1)

    def write_prefill(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [P, kv_heads, S, D] at `prefill_rows` (one index_copy each)."""
        kv, d = self.kv_heads, self.head_dim
        self.k[layer].index_copy_(1, rows, k.transpose(0, 1).reshape(kv, -1, d))
        self.v[layer].index_copy_(1, rows, v.transpose(0, 1).reshape(kv, -1, d))

    def decode_rows(self, positions: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For slots 0..B-1 writing their token at `positions` [B] and reading positions
        0..length-1: the flat rows the new K/V go to ([B * kv_heads], slot-major, in a layer's
        [kv_heads * rows, D] view) and the rows to read ([B, length]; past a slot's position: the
        null page). Computed once per step, shared by every layer."""
        b = positions.shape[0]
        rows = self._slot_rows(0, b, length)
        at = rows.gather(1, positions[:, None])  # [B, 1]
        write = (at + self._kv_rows[None, :]).reshape(-1)
        read = rows.masked_fill(torch.arange(length, device=rows.device)[None] > positions[:, None], 0)
        return write, read

    def extend_rows(
        self, positions: torch.Tensor, counts: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode_rows` for `counts[i]` tokens per slot (at most `width`), slot i's at positions[i]..:
        the flat write rows ([B * width * kv_heads], slot-major then position; padding past a slot's
        count writes the null page) and the rows to read ([B, T], T = the furthest position + 1;
        past a slot's last new token: the null page)."""
        b = positions.shape[0]
        length = int((positions + counts).max())
        rows = self._slot_rows(0, b, length)
        offsets = torch.arange(width, device=rows.device)[None]
        at = positions[:, None] + offsets  # [B, width]
        pad = offsets >= counts[:, None]
        at = rows.gather(1, at.masked_fill(pad, 0)).masked_fill(pad, 0)
        write = (at[:, :, None] + self._kv_rows[None, None, :]).reshape(-1)
        last = positions + counts - 1
        read = rows.masked_fill(torch.arange(length, device=rows.device)[None] > last[:, None], 0)
        return write, read

    def write_decode(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [B, kv_heads, D] at the `decode_rows` write index."""
        d = self.head_dim
        self.k[layer].view(-1, d).index_copy_(0, index, k.reshape(-1, d))
        self.v[layer].view(-1, d).index_copy_(0, index, v.reshape(-1, d))

    def gather(self, layer: int, read: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at `read` [B, T] as [kv_heads * B, T, D] (kv-head-major)."""
        b, t = read.shape
        flat = read.reshape(-1)
        shape = (self.kv_heads * b, t, self.head_dim)
        return self.k[layer].index_select(1, flat).view(shape), self.v[layer].index_select(1, flat).view(shape)
