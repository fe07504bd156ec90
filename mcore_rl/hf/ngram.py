"""Over-Encoding (OverTok: "Over-Tokenized Transformer: Vocabulary is Generally Worth Scaling",
arXiv:2501.16975): hashed n-gram input embeddings, pure-torch reference.

Ships as Hugging Face remote code next to `modeling.py`: imports only torch (and is imported
relatively). The megatron-core module (`mcore_rl.models.ngram_embedding`) uses the same id function,
so both sides hash identically.

The input embedding of token t becomes

    OE(x)_t = E^{V x d}(x_t) + sum_{n in orders} sum_{i=1..k} E_{n,i}(id_n(t)) W_{n,i}

with one table per order n and slice i, `E_{n,i}` of shape [m, w_n] and `W_{n,i}` [w_n, d]
(stored as an `nn.Linear(w_n, d)`), w_n = d // (n * k): the order-n table is d/n wide in total,
split into k column slices (the paper's E^{m x d/n | k}). Note that every slice is indexed by the
same id, so the k slices with their projections equal one [m, k*w_n] table with one projection; the
split is kept because the paper (and the parameter names) define it that way.

**n-gram ids.** With z_1 = x_t (the current token), z_2 = x_{t-1}, ..., z_n = x_{t-n+1}, the id is
the base-V number f = sum_i z_i V^(i-1) (exact: injective for ids in [0, V)), hashed mod m.
Context never crosses a document: a token at position p (its `position_ids` value; positions
restart at 0 in every packed document and count from the first real token of a left-padded row)
uses only its previous min(p, n-1) tokens. **Padding id for missing context**: when c = n-1-min(p, n-1)
> 0 tokens are missing, those digits are 0 and the id gets c * V^n added, i.e. the missing count is
an extra, most significant base-V digit:

    id = (c * V^n + sum_{i=1..n} z_i V^(i-1)) mod m,   z_i = 0 for the c missing tokens.

Full n-grams keep exactly the paper's f; a partial n-gram (document start) can never collide with a
full one or with a partial one of another length before the modulo. The arithmetic is Horner's rule
in int64 with a reduction mod m after every step (h <- (h * (V mod m) + z mod m) mod m), so nothing
overflows for any V as long as m < 2^31 (h * V < m^2 < 2^62).

**KV-cache decode** needs the n-1 tokens before the new ones: the cache returned with
`use_cache=True` is an `NgramKVCache` (a plain list of per-layer (k, v), plus `ngram_context`, the
last n_max-1 tokens seen, -1 where there was none). An engine that re-batches caches itself can
instead pass `ngram_context` explicitly to the model's forward ([b, c] token ids preceding
`input_ids`, -1 = none; positions still decide what is used).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from typing import cast

import torch
from torch import nn

# The megatron-core tables are padded to a multiple of this many rows, so a layout with any
# power-of-two number of shards (TP, or TP x DP) up to 128 divides them and checkpoints keep one
# global shape across layouts. The padding rows are never looked up (ids are < m).
TABLE_ROW_ALIGNMENT = 128
MAX_TABLE_SIZE = 2**31 - 1


def padded_table_rows(table_size: int) -> int:
    """Rows of the megatron-core table for `table_size` hashed ids (see TABLE_ROW_ALIGNMENT)."""
    return -(-table_size // TABLE_ROW_ALIGNMENT) * TABLE_ROW_ALIGNMENT


def slice_width(hidden_size: int, order: int, num_slices: int) -> int:
    """Width of one slice of the order-n table: d_model // (n * k) (the paper's d/(n k))."""
    return hidden_size // (order * num_slices)


def check_table_size(table_size: int, vocab_size: int, key: str = "ngram_table_size") -> None:
    """Warn when gcd(m, V) != 1: the hashed ids of a fixed current token then fall on few rows."""
    g = math.gcd(table_size, vocab_size)
    if g != 1:
        warnings.warn(
            f"{key}={table_size} shares the factor {g} with vocab_size={vocab_size}: hashed n-gram "
            f"ids then collide systematically (the paper: m must be coprime with V); pick a table "
            f"size with gcd(m, V) = 1, e.g. a prime",
            stacklevel=3,
        )


def ngram_hash_ids(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    orders: Sequence[int],
    vocab_size: int,
    table_size: int,
    context: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Hashed n-gram ids, one [b, s] int64 tensor in [0, table_size) per order (module docstring).

    input_ids [b, s]; position_ids [b, s] (None = 0..s-1 + len(context) per row: one document);
    context [b, c] optional token ids preceding input_ids (-1 = no token).
    """
    if table_size < 1 or table_size > MAX_TABLE_SIZE:
        raise ValueError(f"table_size must be in [1, 2^31), got {table_size}")
    b, s = input_ids.shape
    device = input_ids.device
    tokens = input_ids.long()
    if context is None:
        context = tokens.new_full((b, 0), -1)
    context = context.to(device=device, dtype=torch.long)
    c = context.shape[1]
    if position_ids is None:
        position_ids = torch.arange(c, c + s, device=device).expand(b, s)
    pos = position_ids.to(device=device, dtype=torch.long).clamp_min(0)
    ext = torch.cat((context, tokens), dim=1)  # [b, c + s]
    index = torch.arange(s, device=device) + c  # index of each token in ext
    m = table_size
    v_mod = vocab_size % m
    max_order = max(orders)
    # prev[j-1] = the j-th previous token (j = 1..max_order-1) and whether it may be used.
    prev: list[torch.Tensor] = []
    avail: list[torch.Tensor] = []
    ok = torch.ones(b, s, dtype=torch.bool, device=device)
    for j in range(1, max_order):
        src = index - j
        tok = ext[:, src.clamp_min(0)]
        ok = ok & (src >= 0)[None, :] & (pos >= j) & (tok >= 0)  # cumulative: a gap ends the context
        prev.append(torch.where(ok, tok, torch.zeros_like(tok)))
        avail.append(ok)
    out = []
    for n in orders:
        if n < 2:
            raise ValueError(f"n-gram orders must be >= 2, got {n}")
        have = torch.zeros(b, s, dtype=torch.long, device=device)
        for j in range(1, n):
            have = have + avail[j - 1].long()
        h = (n - 1) - have  # the missing-context digit c
        for j in range(n - 1, 0, -1):  # digits z_n .. z_2 (the oldest first)
            h = (h * v_mod + prev[j - 1] % m) % m
        h = (h * v_mod + tokens % m) % m  # z_1, the current token
        out.append(h)
    return out


def next_ngram_context(context: torch.Tensor | None, input_ids: torch.Tensor, size: int) -> torch.Tensor:
    """The last `size` tokens of context + input_ids ([b, size], -1 where there were none)."""
    b = input_ids.shape[0]
    pad = input_ids.new_full((b, size), -1, dtype=torch.long)
    parts = [pad] + ([context.to(input_ids.device, torch.long)] if context is not None else [])
    return torch.cat(parts + [input_ids.long()], dim=1)[:, -size:] if size else pad


class NgramKVCache(list):
    """The reference model's KV cache (a list of per-layer (k, v)) plus the n-gram context."""

    def __init__(self, layers: Sequence = (), ngram_context: torch.Tensor | None = None) -> None:
        super().__init__(layers)
        self.ngram_context = ngram_context


def sliced_lookup(ids: torch.Tensor, tables: Iterable[nn.Embedding], projections: Iterable[nn.Linear]) -> torch.Tensor:
    """E^{m x d|k}(ids) = sum_i E_i(ids) W_i (the paper's sliced table)."""
    out = None
    for table, proj in zip(tables, projections):
        y = proj(table(ids))
        out = y if out is None else out + y
    assert out is not None, "an n-gram table needs at least one slice"
    return out


class McoreRLNgramEmbeddings(nn.Module):
    """Over-Encoding n-gram tables and projections (without the 1-gram table, which stays
    `embed_tokens`). Parameter names: `tables.{n}.{i}.weight` [m, w_n] and
    `projections.{n}.{i}.weight` [d, w_n] for order n and slice i."""

    def __init__(self, config) -> None:
        super().__init__()
        self.orders = [int(n) for n in config.ngram_orders]
        self.vocab_size = config.vocab_size
        self.table_size = config.ngram_table_size
        self.num_slices = config.ngram_num_slices
        check_table_size(self.table_size, self.vocab_size)
        h = config.hidden_size
        self.tables = nn.ModuleDict()
        self.projections = nn.ModuleDict()
        for n in self.orders:
            w = slice_width(h, n, self.num_slices)
            if w < 1:
                raise ValueError(f"hidden_size {h} is too small for order {n} with {self.num_slices} slices")
            self.tables[str(n)] = nn.ModuleList(nn.Embedding(self.table_size, w) for _ in range(self.num_slices))
            self.projections[str(n)] = nn.ModuleList(nn.Linear(w, h, bias=False) for _ in range(self.num_slices))

    @property
    def context_size(self) -> int:
        """How many preceding tokens the longest n-gram needs (n_max - 1)."""
        return max(self.orders) - 1

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """sum over orders of the sliced lookups, [b, s, hidden] (add it to the 1-gram embedding)."""
        ids = ngram_hash_ids(input_ids, position_ids, self.orders, self.vocab_size, self.table_size, context)
        out = None
        for n, idx in zip(self.orders, ids):
            tables = cast("Iterable[nn.Embedding]", self.tables[str(n)])  # a ModuleList of the slices
            projections = cast("Iterable[nn.Linear]", self.projections[str(n)])
            y = sliced_lookup(idx, tables, projections)
            out = y if out is None else out + y
        assert out is not None  # built only with n-gram orders
        return out
