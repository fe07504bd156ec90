"""Attention Residuals (AttnRes, arXiv:2603.15031) as a megatron-core transformer block.

The math, the Full/Block variants and the parameter names are documented in the reference
implementation, `mcore_rl/hf/attn_res.py`; this module computes the same thing inside megatron-core:

* `AttnResTransformerLayer` is megatron's `TransformerLayer` (same attention, MLP/MoE, norms and
  parameter names) plus two depth mixers, `attn_res` and `mlp_res`. Its two sublayers are called
  separately by the block, because their inputs are depth mixes and their outputs are not added to
  a residual stream.
* `AttnResTransformerBlock` replaces `TransformerBlock`: it carries the depth state (b_0 = the
  embedding, the finished blocks, the current partial sum) through the layers, runs the output mix
  (`final_res`) before the final norm on the last stage, and supports full activation recompute
  (`recompute_method` uniform or block; the depth state enters and leaves each checkpoint, so the
  block representations stay alive and only the layers' insides are recomputed).
* Under pipeline parallelism the depth state crosses the stage boundary: the sources are
  concatenated along the sequence dimension, `[b_0; b_1; ..; b_{n-1}; partial; zeros]`, as one
  `[K * s, b, h]` tensor, where K = `p2p_seq_factor` is the largest number of sources at any stage
  boundary of the model (at most N + 1 for Block AttnRes — it grows with N, not with L; for Full
  AttnRes N = L). `mcore_rl.train.forward_backward` multiplies the sequence length it gives the
  schedule by K. Each receiving stage knows from its layer offset how many of the K slabs are real.
  Under sequence parallelism each slab is the rank's `s / tp` shard.

The depth mix never stacks the sources: logit_i = (w . g) . v_i * rsqrt(mean(v_i^2) + eps) equals
w . RMSNorm_g(v_i), and the per-source rsqrt is computed once per source and shared by all later
sublayers, so a sublayer costs O(n * s * b * h) arithmetic and O(s * b * h) new activation memory.

`GPTModel` builds a plain `TransformerBlock` itself, so the builder gives it an empty placeholder
spec (`deferred_spec`) and then swaps in this block (`install_decoder`).
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset
from megatron.core.utils import (
    WrappedTensor,
    deprecate_inference_params,
    get_pg_rank,
    make_viewless_tensor,
)

from mcore_rl.config.model_keys.attn_res import AttnResKeys
from mcore_rl.config.schema import ModelConfig
from mcore_rl.hf.attn_res import (
    block_starts,
    effective_num_blocks,
    num_sources_after,
    num_sublayers,
)
from mcore_rl.models.norm import RMSNorm, _init_device
from mcore_rl.models.param_attrs import megatron_attrs

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

Tensor = torch.Tensor


def inv_rms(x: Tensor, eps: float) -> Tensor:
    """rsqrt(mean(x^2) + eps) over the hidden dim, in fp32 ([s, b] for x [s, b, h])."""
    return torch.rsqrt(x.float().pow(2).mean(-1) + eps)


class AttnResMixer(torch.nn.Module):
    """One depth attention: pseudo-query `query` [h] (zero-initialised) and key RMSNorm `norm`.

    Both are replicated on tensor-parallel ranks; under sequence parallelism each rank sees other
    tokens, so their gradients are marked `sequence_parallel` for finalize_model_grads to sum.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.query = torch.nn.Parameter(
            torch.zeros(config.hidden_size, dtype=config.params_dtype, device=_init_device(config))
        )
        megatron_attrs(self.query).sequence_parallel = config.sequence_parallel
        self.norm = RMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, values: list[Tensor], inv_rms_values: list[Tensor]) -> Tensor:
        """sum_i softmax_i(query . RMSNorm(values[i])) * values[i]; inv_rms_values[i] = inv_rms(values[i])."""
        u = self.query.float() * self.norm.weight.float()
        logits = torch.stack([torch.matmul(v, u.to(v.dtype)).float() * r for v, r in zip(values, inv_rms_values)])
        alpha = logits.softmax(dim=0).to(values[0].dtype).unsqueeze(-1)
        out = values[0] * alpha[0]
        for i in range(1, len(values)):
            out = out + values[i] * alpha[i]
        return out


class AttnResLayerMixin:
    """Adds the two depth mixers to a `TransformerLayer` and exposes its sublayers one by one."""

    # provided by the `TransformerLayer` this is mixed into
    config: TransformerConfig
    training: bool
    hidden_dropout: float
    self_attention: torch.nn.Module
    input_layernorm: torch.nn.Module
    mlp: torch.nn.Module
    pre_mlp_layernorm: torch.nn.Module

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.attn_res = AttnResMixer(self.config)
        self.mlp_res = AttnResMixer(self.config)

    def forward(self, *args, **kwargs):
        raise RuntimeError("an AttnRes layer is driven sublayer by sublayer by AttnResTransformerBlock")

    def _sublayer_output(self, output_with_bias: tuple[Tensor, Tensor | None]) -> Tensor:
        out, bias = output_with_bias
        if bias is not None:
            out = out + bias
        if self.training and self.hidden_dropout > 0:
            out = F.dropout(out, p=self.hidden_dropout, training=True)
        return out

    def attention_sublayer(self, h: Tensor, **attention_kwargs) -> Tensor:
        """f = dropout(attention(input_layernorm(h))) — no residual add."""
        return self._sublayer_output(self.self_attention(self.input_layernorm(h), **attention_kwargs))

    def mlp_sublayer(self, h: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """f = dropout(mlp(pre_mlp_layernorm(h))) — no residual add."""
        return self._sublayer_output(self.mlp(self.pre_mlp_layernorm(h), padding_mask=padding_mask))


class AttnResTransformerLayer(AttnResLayerMixin, TransformerLayer):
    pass


_LAYER_CLASSES: dict[type, type] = {TransformerLayer: AttnResTransformerLayer}


def _attn_res_layer_class(cls: type) -> type:
    if not (isinstance(cls, type) and issubclass(cls, TransformerLayer)):
        raise NotImplementedError(f"AttnRes needs TransformerLayer-based layer specs, got {cls!r}")
    if cls not in _LAYER_CLASSES:
        _LAYER_CLASSES[cls] = type(f"AttnRes{cls.__name__}", (AttnResLayerMixin, cls), {})
    return _LAYER_CLASSES[cls]


def attn_res_block_spec(spec: TransformerBlockSubmodules) -> TransformerBlockSubmodules:
    """The same layers, each built as its AttnRes subclass."""
    layers = [dataclasses.replace(s, module=_attn_res_layer_class(s.module)) for s in spec.layer_specs]
    return dataclasses.replace(spec, layer_specs=layers)


def chunk_layer_offsets(config: TransformerConfig) -> list[int]:
    """Global index of the first layer of every model chunk (all pipeline ranks and virtual stages)."""
    pp = config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size
    return sorted(
        {
            get_transformer_layer_offset(config, vp_stage=v if vpp else None, pp_rank=r)
            for r in range(pp)
            for v in range(vpp or 1)
        }
    )


def max_sources_at_boundaries(layer_boundaries: list[int], num_layers: int, num_blocks: int) -> int:
    """K: the most depth sources that cross any of the given layer boundaries (1 if there are none)."""
    total = num_sublayers(num_layers)
    counts = [num_sources_after(2 * b, total, num_blocks) for b in layer_boundaries if 0 < b < num_layers]
    return max(counts, default=1)


class AttnResTransformerBlock(TransformerBlock):
    """`TransformerBlock` with Full or Block AttnRes; see the module docstring."""

    def __init__(
        self,
        config: TransformerConfig,
        spec: TransformerBlockSubmodules,
        *,
        variant: str,
        num_blocks: int,
        post_layer_norm: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
        pg_collection=None,
        vp_stage: int | None = None,
    ) -> None:
        if not isinstance(spec, TransformerBlockSubmodules):
            raise TypeError("AttnResTransformerBlock takes TransformerBlockSubmodules (decoder_block_spec)")
        super().__init__(
            config,
            attn_res_block_spec(spec),
            post_layer_norm=post_layer_norm,
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )
        self.attn_res_variant = variant
        self.attn_res_num_blocks = effective_num_blocks(variant, config.num_layers, num_blocks)
        self.total_sublayers = num_sublayers(config.num_layers)
        self.block_starts = block_starts(self.total_sublayers, self.attn_res_num_blocks)
        self.layer_offset = get_transformer_layer_offset(config, vp_stage, get_pg_rank(self.pg_collection.pp))
        # Slabs per pipeline message; read by mcore_rl.train.forward_backward.
        self.p2p_seq_factor = max_sources_at_boundaries(
            chunk_layer_offsets(config), config.num_layers, self.attn_res_num_blocks
        )
        self.final_res = AttnResMixer(config) if post_process else None
        self.packed_input_tensor: Tensor | None = None

    # ---- depth state <-> pipeline message ------------------------------------------------------

    def set_input_tensor(self, input_tensor: Tensor | None) -> None:
        """The previous stage's packed depth state. `input_tensor` shows only its first slab (b_0),
        because GPTModel sizes the rotary embedding by `decoder.input_tensor.size(0)`."""
        self.packed_input_tensor = input_tensor
        self.input_tensor = None
        if input_tensor is not None:
            self.input_tensor = input_tensor.narrow(0, 0, input_tensor.size(0) // self.p2p_seq_factor)

    def _unpack(self, hidden_states: Tensor) -> tuple[list[Tensor], Tensor | None]:
        if self.pre_process:
            return [hidden_states], None  # b_0 = the embedding; no partial sum yet
        n = num_sources_after(2 * self.layer_offset, self.total_sublayers, self.attn_res_num_blocks)
        slabs = hidden_states.chunk(self.p2p_seq_factor, dim=0)
        return list(slabs[: n - 1]), slabs[n - 1]

    def _pack(self, blocks: list[Tensor], partial: Tensor | None) -> Tensor:
        assert partial is not None, "a pipeline stage must hold at least one layer"
        slabs = blocks + [partial]
        pad = self.p2p_seq_factor - len(slabs)
        assert pad >= 0, f"{len(slabs)} depth sources but p2p_seq_factor {self.p2p_seq_factor}"
        if pad:
            slabs = slabs + [torch.zeros_like(partial)] * pad
        return torch.cat(slabs, dim=0)

    # ---- layers --------------------------------------------------------------------------------

    def _run_layers(
        self,
        start: int,
        end: int,
        blocks: list[Tensor],
        partial: Tensor | None,
        attention_kwargs: dict,
        padding_mask: Tensor | None,
    ) -> tuple[list[Tensor], Tensor | None]:
        """Local layers [start, end) on the depth state (blocks incl. b_0, partial sum)."""
        eps = self.config.layernorm_epsilon
        blocks = list(blocks)
        rms = [inv_rms(b, eps) for b in blocks]
        for index in range(start, end):
            layer = self.layers[index]
            first = 2 * (layer.layer_number - 1)  # global sublayer index of its attention
            for sub in (0, 1):
                if self.block_starts[first + sub] and partial is not None:
                    blocks.append(partial)
                    rms.append(inv_rms(partial, eps))
                    partial = None
                values, values_rms = blocks, rms
                if partial is not None:
                    values, values_rms = blocks + [partial], rms + [inv_rms(partial, eps)]
                if sub == 0:
                    out = layer.attention_sublayer(layer.attn_res(values, values_rms), **attention_kwargs)
                else:
                    out = layer.mlp_sublayer(layer.mlp_res(values, values_rms), padding_mask)
                partial = out if partial is None else partial + out
        return blocks, partial

    def _checkpointed_layers(self, blocks, partial, attention_kwargs, padding_mask):
        """Full recompute: the depth state goes in and out of each checkpoint as plain tensors."""
        n = len(self.layers)
        k = self.config.recompute_num_layers
        if self.config.recompute_method == "uniform":
            groups = [(s, min(s + k, n), True) for s in range(0, n, k)]
        elif self.config.recompute_method == "block":
            groups = [(i, i + 1, i < k) for i in range(n)]
        else:
            raise ValueError(f"invalid recompute_method {self.config.recompute_method!r}")
        for start, end, checkpointed in groups:
            if not checkpointed:
                blocks, partial = self._run_layers(start, end, blocks, partial, attention_kwargs, padding_mask)
                continue
            # Commit a finished block outside, so every checkpoint output is a new tensor.
            if self.block_starts[2 * (self.layers[start].layer_number - 1)] and partial is not None:
                blocks, partial = blocks + [partial], None
            num_in = len(blocks)

            def run(*state: Tensor, start=start, end=end, num_in=num_in):
                tail = state[num_in] if len(state) > num_in else None
                new_blocks, new_partial = self._run_layers(
                    start, end, list(state[:num_in]), tail, attention_kwargs, padding_mask
                )
                return tuple(new_blocks[num_in:]) + (new_partial,)

            inputs = blocks + ([partial] if partial is not None else [])
            outputs = tensor_parallel.checkpoint(run, False, *inputs)
            blocks, partial = blocks + list(outputs[:-1]), outputs[-1]
        return blocks, partial

    def forward(
        self,
        hidden_states,
        attention_mask: Tensor | None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        rotary_pos_emb: Tensor | None = None,
        rotary_pos_cos: Tensor | None = None,
        rotary_pos_sin: Tensor | None = None,
        rotary_pos_cos_sin: Tensor | None = None,
        attention_bias: Tensor | None = None,
        inference_context=None,
        packed_seq_params=None,
        sequence_len_offset: Tensor | None = None,
        padding_mask: Tensor | None = None,
        *,
        inference_params=None,
        dynamic_inference_decode_only: bool | None = None,
    ) -> Tensor:
        """[s, b, h] in ([K * s, b, h] from the previous stage); [s, b, h] out on the last stage,
        the packed depth state on the others."""
        if context is not None:
            raise NotImplementedError("AttnRes has no cross-attention")
        inference_context = deprecate_inference_params(inference_context, inference_params)
        if isinstance(hidden_states, WrappedTensor):
            hidden_states = hidden_states.unwrap()
        if not self.pre_process:
            hidden_states = self.packed_input_tensor  # see set_input_tensor()
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        blocks, partial = self._unpack(hidden_states)
        attention_kwargs = dict(
            attention_mask=attention_mask,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
        )
        sp = self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if sp else nullcontext():
            if self.config.recompute_granularity == "full" and self.training:
                blocks, partial = self._checkpointed_layers(blocks, partial, attention_kwargs, padding_mask)
            else:
                blocks, partial = self._run_layers(0, len(self.layers), blocks, partial, attention_kwargs, padding_mask)
        if not self.post_process:
            return self._pack(blocks, partial)
        eps = self.config.layernorm_epsilon
        values = blocks + ([partial] if partial is not None else [])
        assert self.final_res is not None  # built when post_process
        hidden_states = self.final_res(values, [inv_rms(v, eps) for v in values])
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)


# ---- builder hooks --------------------------------------------------------------------------------


def deferred_spec(spec: TransformerBlockSubmodules, model: ModelConfig) -> TransformerBlockSubmodules:
    """What to hand `GPTModel`: `spec` itself, or for AttnRes an empty placeholder (no layers are
    built twice); `install_decoder` then builds the real block."""
    if model.section(AttnResKeys).attn_res == "none":
        return spec
    return TransformerBlockSubmodules(layer_specs=[], layer_norm=spec.layer_norm)


def install_decoder(chunk: GPTModel, spec: TransformerBlockSubmodules, model: ModelConfig) -> None:
    """Replace the placeholder decoder of a `GPTModel` chunk by the AttnRes block (no-op otherwise)."""
    depth = model.section(AttnResKeys)
    if depth.attn_res == "none":
        return
    from megatron.core.quantization.utils import get_quant_config_or_none

    decoder = AttnResTransformerBlock(
        chunk.config,
        spec,
        variant=depth.attn_res,
        num_blocks=depth.attn_res_num_blocks,
        pre_process=chunk.pre_process,
        post_process=chunk.post_process,
        pg_collection=chunk.pg_collection,
        vp_stage=chunk.vp_stage,
    )
    for name, module in decoder.named_modules():  # as GPTModel.__init__ does for its modules
        if hasattr(module, "finish_init"):
            module.finish_init(get_quant_config_or_none(f"decoder.{name}", chunk.config.quant_recipe))
    chunk.decoder = decoder
