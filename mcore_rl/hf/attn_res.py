"""Attention Residuals (AttnRes, Kimi Team 2026, arXiv:2603.15031) in the pure-torch reference model.

Every *sublayer* (each attention and each MLP counts as one; a model with `num_hidden_layers`
decoder layers has L = 2 * num_hidden_layers of them) reads a softmax-weighted mix over depth of
earlier representations instead of the running residual sum:

    h_l = sum_i alpha_{i->l} v_i,   alpha_{i->l} = softmax_i( w_l . RMSNorm_l(v_i) )

with a learned pseudo-query `w_l` (initialised to zero: uniform weights) and a key RMSNorm per
sublayer. The sources `v_i` are

* ``attn_res="full"``:  the embedding `v_0` and every earlier sublayer output `f_1 .. f_{l-1}`;
* ``attn_res="block"``: the sublayers are cut into N = `attn_res_num_blocks` consecutive blocks
  of S = L // N sublayers (the last block takes the remainder, so there are exactly N). The sources
  are `b_0` (the embedding), the sums `b_1 .. b_{n-1}` of the finished blocks and, from the second
  sublayer of block n on, the partial sum `b_n^{i-1}` of block n so far (Eq. 5/6, with the summary's
  typo fixed). With N = L every block is one sublayer and this *is* Full AttnRes; with N = 1 and
  zero queries it is half the standard residual stream (tests/test_attn_res.py checks both).

The sublayer itself is unchanged: `f = attn(input_layernorm(h))`, `f = mlp(post_attention_layernorm(h))`.
After the last sublayer one more mix (its own query and key norm, `model.final_res`) over all
sources (Full: `v_0 .. v_L`; Block: `b_0 .. b_N`) feeds the final norm and the LM head; the summary
leave this output aggregation open, this follows the public reference implementations.

The depth mix is per token, so the KV cache is the ordinary per-layer (k, v) cache: decoding one
token runs the same recurrence over depth for that token alone. `DepthState` packages the
recurrence for any loop over the decoder layers (the model's forward, the engine's runner).

Parameters, per decoder layer i (all `[hidden]`; names shared with megatron, see weight_map.py)::

    model.layers.{i}.attn_res.query, model.layers.{i}.attn_res.norm.weight   (before attention)
    model.layers.{i}.mlp_res.query,  model.layers.{i}.mlp_res.norm.weight    (before the MLP)
    model.final_res.query, model.final_res.norm.weight                      (before model.norm)

This file is the literal form (stack the sources, RMSNorm them, einsum, softmax over depth), the
oracle for `mcore_rl.models.attn_res`, which computes the same thing without stacking.
"""

from __future__ import annotations


from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from .layers import KVCache, ReferenceRMSNorm

if TYPE_CHECKING:
    from .modeling import McoreRLModel, ReferenceDecoderLayer


def num_sublayers(num_layers: int) -> int:
    """AttnRes counts attention and MLP separately: two sublayers per decoder layer."""
    return 2 * num_layers


def block_index(sublayer: int, total_sublayers: int, num_blocks: int) -> int:
    """0-based block of a 0-based sublayer: S = L // N per block, the last block takes the rest."""
    if not 1 <= num_blocks <= total_sublayers:
        raise ValueError(f"num_blocks must be in [1, {total_sublayers}] (2 x layers), got {num_blocks}")
    return min(sublayer // (total_sublayers // num_blocks), num_blocks - 1)


def effective_num_blocks(variant: str, num_layers: int, num_blocks: int) -> int:
    """N of the block formulation: L for Full AttnRes, `num_blocks` for Block AttnRes."""
    if variant == "full":
        return num_sublayers(num_layers)
    if variant == "block":
        return num_blocks
    raise ValueError(f"attn_res must be 'full' or 'block' here, got {variant!r}")


def block_starts(total_sublayers: int, num_blocks: int) -> list[bool]:
    """True for each sublayer that opens a new block (sublayer 0 always does)."""
    idx = [block_index(j, total_sublayers, num_blocks) for j in range(total_sublayers)]
    return [j == 0 or idx[j] != idx[j - 1] for j in range(total_sublayers)]


def num_sources_after(sublayers_done: int, total_sublayers: int, num_blocks: int) -> int:
    """How many depth sources exist after the first `sublayers_done` (>= 1) sublayers:
    b_0, the finished blocks and the current partial sum. This is what a pipeline stage boundary
    after that sublayer has to carry (at most N + 1, independent of L for Block AttnRes)."""
    return block_index(sublayers_done - 1, total_sublayers, num_blocks) + 2


class AttnResMixer(nn.Module):
    """One depth attention: a pseudo-query `query` [hidden] and a key RMSNorm `norm`."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(hidden_size))
        self.norm = ReferenceRMSNorm(hidden_size, eps)

    def weights(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """alpha [n, ...]: softmax over the n sources (dim 0) of query . RMSNorm(source), in fp32."""
        keys = self.norm(torch.stack(sources))  # [n, ..., d]
        logits = torch.einsum("d,n...d->n...", self.query.float(), keys.float())
        return logits.softmax(dim=0)

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        values = torch.stack(sources)
        alpha = self.weights(sources).to(values.dtype)
        return torch.einsum("n...,n...d->...d", alpha, values)


class DepthState:
    """The residual stream of the reference model, generalised to AttnRes.

    Any loop over the decoder layers (`McoreRLModel.forward`, the embedded engine's batched
    prefill/decode) can run every architecture by asking this object for each sublayer's input and
    handing it each sublayer's output, in order::

        state = DepthState(model.model, embedding)
        for i, layer in enumerate(model.model.layers):
            state.add(attention(layer.input_layernorm(state.input(i, 0))))   # sub 0: attention
            state.add(mlp(layer.post_attention_layernorm(state.input(i, 1))))  # sub 1: MLP
        hidden = model.model.norm(state.output())

    attn_res="none" is the plain residual (`x = x + out`, bit for bit); "full" and "block" are
    deliberately separate code paths, so that "Block with N = L equals Full" compares two
    computations.
    """

    def __init__(self, model: McoreRLModel, embedding: torch.Tensor) -> None:
        config = model.config
        self.model = model
        self.variant = getattr(config, "attn_res", "none")
        total = num_sublayers(config.num_hidden_layers)
        if self.variant == "block":
            self.starts = block_starts(total, config.attn_res_num_blocks)
        self.values: list[torch.Tensor] = [embedding]  # Full: v_0 ..; Block: b_0 + finished blocks
        self.partial: torch.Tensor | None = None  # Block: the current block's partial sum
        self.residual = embedding  # none: the residual stream

    def _sources(self) -> list[torch.Tensor]:
        return self.values if self.partial is None else self.values + [self.partial]

    def input(self, layer: int, sub: int) -> torch.Tensor:
        """The input of sublayer `sub` (0 = attention, 1 = MLP) of decoder layer `layer`."""
        if self.variant == "none":
            return self.residual
        if self.variant == "block" and self.starts[2 * layer + sub] and self.partial is not None:
            self.values, self.partial = self.values + [self.partial], None
        decoder_layer = cast("ReferenceDecoderLayer", self.model.layers[layer])
        mixer = decoder_layer.attn_res if sub == 0 else decoder_layer.mlp_res
        return mixer(self._sources())

    def add(self, out: torch.Tensor) -> None:
        """Hand over the output of the sublayer whose input was asked for last."""
        if self.variant == "none":
            self.residual = self.residual + out
        elif self.variant == "full":
            self.values = self.values + [out]
        else:
            self.partial = out if self.partial is None else self.partial + out

    def output(self) -> torch.Tensor:
        """The decoder's output before the final norm (AttnRes: the `final_res` depth mix)."""
        if self.variant == "none":
            return self.residual
        assert self.model.final_res is not None  # built for every AttnRes variant
        return self.model.final_res(self._sources())


def attn_res_decoder_forward(
    model: McoreRLModel,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    allowed: torch.Tensor,
    past_key_values: KVCache | None,
) -> tuple[torch.Tensor, KVCache, torch.Tensor]:
    """The decoder stack of `McoreRLModel` with AttnRes instead of residual sums.

    `x` is the embedding; returns (the final mix, before `model.norm`; the per-layer KV cache;
    the summed MoE aux loss).
    """
    state = DepthState(model, x)
    presents: KVCache = []
    aux_loss = x.new_zeros((), dtype=torch.float32)
    for i, layer in enumerate(cast("Iterable[ReferenceDecoderLayer]", model.layers)):
        past = past_key_values[i] if past_key_values else None
        out, present = layer.self_attn(layer.input_layernorm(state.input(i, 0)), cos, sin, allowed, past)
        presents.append(present)
        state.add(out)
        out = layer.mlp(layer.post_attention_layernorm(state.input(i, 1)))
        if isinstance(out, tuple):  # MoE: (output, aux loss)
            out, aux = out
            aux_loss = aux_loss + aux
        state.add(out)
    return state.output(), presents, aux_loss
