"""MTP draft heads on a megatron-core policy: megatron-core 0.16.1's own MTP layers, run by us.

The heads are megatron-core's `MultiTokenPredictionBlock` of `MultiTokenPredictionLayer`s (enorm,
hnorm, eh_proj, one decoder layer of the policy's spec, final norm; `hf/mtp.py` says what they
compute), built with the local (no transformer-engine) backend when transformer-engine is absent.
They are attached as the chunk's `mtp` but not handed to `GPTModel` (`mtp_block_spec`): GPTModel's
MTP path trains the heads with cross-entropy on the labels inside its forward, while Bebop's loss
needs the heads' logits next to the policy's (`train/mtp_loss.py`). So `GPTModel`'s config keeps
`mtp_num_layers=None`, and `mtp_logits` runs the block on the decoder's output, captured by hooks on
the decoder (its output and the attention mask / RoPE / packing it was called with), so it works
after any forward of the chunk, also one that stops at the decoder's output (the RL learner's
chunked log-probs); the output layer turns both the decoder's output and the heads' into logits.

Only the last pipeline stage holds the heads (they need the decoder's output and the output layer).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    get_mtp_layer_spec_for_backend,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_rl.config.model_keys.mtp import MTPKeys
from mcore_rl.config.schema import ModelConfig
from mcore_rl.models.family import MegatronFamily
from mcore_rl.models.norm import RMSNorm
from mcore_rl.models.spec import decoder_layer_spec, transformer_engine_available


class _Captured:
    """What the last forward of a chunk left for the heads: the decoder's call and output."""

    def __init__(self) -> None:
        self.decoder_kwargs: dict[str, Any] = {}
        self.hidden: torch.Tensor | None = None


def add_mtp_heads(
    chunk: GPTModel, model: ModelConfig, config: TransformerConfig, family: MegatronFamily | None
) -> None:
    """Attach `model.mtp_num_layers` MTP layers to the last-stage chunk (no-op without heads)."""
    n = model.section(MTPKeys).mtp_num_layers
    if n == 0 or not chunk.post_process:
        return
    use_te = transformer_engine_available()
    if use_te:  # imported only with transformer-engine present (it imports transformer-engine)
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        backend: Any = TESpecProvider()
    else:
        backend = LocalSpecProvider()
    layer_spec = get_mtp_layer_spec_for_backend(decoder_layer_spec(config, use_te, family=family), backend)
    if not use_te:  # our sequence-parallel RMSNorm, as in the decoder (spec.py)
        layer_spec.submodules.enorm = layer_spec.submodules.hnorm = layer_spec.submodules.layer_norm = RMSNorm
    heads_config = copy.copy(config)  # the block reads its depth count; GPTModel's config keeps None
    heads_config.mtp_num_layers = n
    chunk.mtp = MultiTokenPredictionBlock(
        heads_config, MultiTokenPredictionBlockSubmodules(layer_specs=[layer_spec] * n), vp_stage=chunk.vp_stage
    )
    captured = _Captured()
    chunk._mtp_captured = captured

    def before_decoder(_module: torch.nn.Module, _args: tuple, kwargs: dict[str, Any]) -> None:
        captured.decoder_kwargs = kwargs

    def after_decoder(_module: torch.nn.Module, _args: tuple, output: torch.Tensor) -> None:
        captured.hidden = output

    chunk.decoder.register_forward_pre_hook(before_decoder, with_kwargs=True)
    chunk.decoder.register_forward_hook(after_decoder)


def has_mtp_heads(chunk: torch.nn.Module) -> bool:
    return isinstance(getattr(chunk, "mtp", None), MultiTokenPredictionBlock)


def mtp_depths(chunk: torch.nn.Module) -> int:
    """How many MTP layers the chunk holds (0 without heads, or off the last pipeline stage)."""
    heads = getattr(chunk, "mtp", None)
    return int(heads.config.mtp_num_layers) if isinstance(heads, MultiTokenPredictionBlock) else 0


def mtp_logits(
    chunk: GPTModel, input_ids: torch.Tensor, position_ids: torch.Tensor, detach_policy: bool = False
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The policy's logits [s, b, V/tp] and each depth's, for the chunk's last forward (same
    `input_ids` [b, s] and `position_ids`; a forward that stopped at the decoder's output counts):
    depth d's row t predicts token t + d + 1. `detach_policy`: the policy's logits and what the heads
    read of the policy (the decoder's output, the embedding, the output layer) carry no gradient."""
    captured: _Captured = chunk._mtp_captured
    if captured.hidden is None:
        raise RuntimeError("mtp_logits: run the chunk's forward first")
    kw = captured.decoder_kwargs
    hidden_in = captured.hidden.detach() if detach_policy else captured.hidden

    def embed(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        out = chunk.embedding(input_ids=input_ids, position_ids=position_ids)
        return out.detach() if detach_policy else out

    hidden = chunk.mtp(
        input_ids=input_ids,
        position_ids=position_ids,
        hidden_states=hidden_in,
        attention_mask=kw.get("attention_mask"),
        rotary_pos_emb=kw.get("rotary_pos_emb"),
        rotary_pos_cos=kw.get("rotary_pos_cos"),
        rotary_pos_sin=kw.get("rotary_pos_sin"),
        packed_seq_params=kw.get("packed_seq_params"),
        embedding=embed,
    )
    weight = chunk.shared_embedding_or_output_weight() if chunk.share_embeddings_and_output_weights else None
    if detach_policy:
        weight = (weight if weight is not None else chunk.output_layer.weight).detach()
    outputs = [chunk.output_layer(h, weight=weight)[0] for h in torch.chunk(hidden, 1 + mtp_depths(chunk), dim=0)]
    policy = outputs[0].detach() if detach_policy else outputs[0]
    return policy, outputs[1:]
