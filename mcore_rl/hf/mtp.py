"""Multi-token prediction (MTP) heads of the reference model: the draft heads of speculative decoding.

DeepSeek-V3's MTP module (DeepSeek-V3 Technical Report, arXiv:2412.19437, section 2.2), as
megatron-core 0.16.1 computes it (`MultiTokenPredictionLayer`). Depth d = 1..D at position t takes
the hidden state h of depth d - 1 (depth 0: the decoder's output after the final norm, which is what
megatron-core hands its MTP block) and the embedding of token x_{t+d}, and predicts x_{t+d+1}:

    g = eh_proj([enorm(embed(x_{t+d})); hnorm(h)])      (one Linear 2H -> H, embedding first)
    h' = shared_head.norm(decoder_layer(g))            (one decoder layer of the model's kind)
    logits = lm_head(h')                               (the policy's own output layer, shared)

The embedding and the output layer are the policy's. The last d positions of depth d have no
x_{t+d} (megatron-core embeds token 0 there) and are never trained or used.

Hugging Face names, ours: `mtp.layers.{d-1}.` + DeepSeek-V3's per-layer names (`enorm`, `hnorm`,
`eh_proj`, `shared_head.norm`, and the decoder layer's `input_layernorm`, `self_attn.*`,
`post_attention_layernorm`, `mlp.*`). A DeepSeek-V3 checkpoint keeps the same names under
`model.layers.{num_hidden_layers + d - 1}.` (with copies of the embedding and the head).

Part of the remote-code modeling files: imports only torch and `layers.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .layers import ReferenceRMSNorm


class SharedHead(nn.Module):
    """DeepSeek-V3's `shared_head`: here only its norm (the output layer is the policy's)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = ReferenceRMSNorm(hidden_size, eps)


def add_mtp_parts(layer: nn.Module, hidden_size: int, eps: float) -> nn.Module:
    """A decoder layer made an MTP layer: its input projection and norms join it under DeepSeek-V3's
    names, so the layer's own weights keep theirs (`mtp.layers.0.self_attn.q_proj.weight`)."""
    layer.enorm = ReferenceRMSNorm(hidden_size, eps)
    layer.hnorm = ReferenceRMSNorm(hidden_size, eps)
    layer.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
    layer.shared_head = SharedHead(hidden_size, eps)
    return layer


def project(layer: Any, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
    """An MTP layer's input: eh_proj([enorm(embedded); hnorm(hidden)]) (the engine's drafter runs
    the decoder layer itself). `layer`: a layer of `MTPHeads`, its parts joined by name (untyped)."""
    return layer.eh_proj(torch.cat((layer.enorm(embedded), layer.hnorm(hidden)), dim=-1))


# (hidden [b, s, H], cos, sin, allowed mask) -> hidden [b, s, H]: one decoder layer's forward
LayerCall = Callable[[nn.Module, torch.Tensor], torch.Tensor]


class MTPHeads(nn.Module):
    """D MTP layers (`mtp.layers`), run in a chain: depth d reads depth d - 1's output."""

    def __init__(self, layers: list[nn.Module], hidden_size: int, eps: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(add_mtp_parts(layer, hidden_size, eps) for layer in layers)

    def step(self, depth: int, hidden: torch.Tensor, embedded: torch.Tensor, run_layer: LayerCall) -> torch.Tensor:
        """Depth `depth` (0-based) on the previous depth's `hidden` and the embedded next tokens;
        `run_layer(layer, x)` runs the decoder layer (its attention over the same positions)."""
        layer: Any = self.layers[depth]  # its parts joined by name (`add_mtp_parts`): untyped
        return layer.shared_head.norm(run_layer(layer, project(layer, hidden, embedded)))

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        embed: Callable[[torch.Tensor], torch.Tensor],
        run_layer: LayerCall,
    ) -> list[torch.Tensor]:
        """Each depth's output hidden states [b, s, H] over a whole sequence (training, parity):
        depth d reads the tokens shifted left by d, zero past the end, as megatron-core's roll."""
        out, ids = [], input_ids
        for depth in range(len(self.layers)):
            ids = torch.cat((ids[:, 1:], torch.zeros_like(ids[:, :1])), dim=1)
            hidden = self.step(depth, hidden, embed(ids), run_layer)
            out.append(hidden)
        return out


# The per-layer tensors of a checkpoint's carried NEXTN layers (DeepSeek-V3, GLM-4.5) that are copies of the policy's own (its embedding
# and its output layer, which the heads here share): not loaded into the heads.
NEXTN_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def heads_name_of_nextn_layer(name: str, num_hidden_layers: int, depths: int) -> str | None:
    """The heads' name (`mtp.layers.{d}.*`) of a DeepSeek-V3 / GLM-4.5 checkpoint's MTP tensor
    `model.layers.{num_hidden_layers + d}.*` (d < depths); `name` itself when it is no MTP layer's;
    None for the layer's copies of the embedding and the output layer (`NEXTN_SHARED_COPIES`)."""
    prefix = "model.layers."
    if not name.startswith(prefix):
        return name
    index, _, rest = name[len(prefix) :].partition(".")
    if not index.isdigit() or not num_hidden_layers <= int(index) < num_hidden_layers + depths:
        return name
    if rest in NEXTN_SHARED_COPIES:
        return None
    return f"mtp.layers.{int(index) - num_hidden_layers}.{rest}"
