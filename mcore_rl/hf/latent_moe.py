"""LatentMoE block of the reference model ("LatentMoE: Toward Optimal Accuracy per FLOP and
Parameter in Mixture of Experts", NVIDIA 2026, arXiv:2601.18089).

The routed experts work in a latent space of size l = d / alpha::

    y = W_up( sum_{i in top-k(router(x))} p_i * E_i(W_down x; l) ) + sum_j S_j(x; d)

- the router reads the full-width x ([N', d] weight, N' = alpha * N experts);
- W_down ([l, d], `fc1_latent_proj`) is applied once per token, *before* dispatch, and W_up
  ([d, l], `fc2_latent_proj`) once per token after the weighted combine, so an expert-parallel
  all-to-all carries l-dimensional tokens;
- each routed expert is a SwiGLU MLP l -> m -> l; shared experts stay at full width d.

l-MoE_eff keeps top-k K, l-MoE_acc uses K' = alpha * K; both are just choices of `num_experts`,
`num_experts_per_tok` and `moe_latent_size`. Parameter names follow the latent MoE of
megatron-core 0.16 and of NVIDIA Nemotron-H checkpoints in `transformers`:
`mlp.fc1_latent_proj.weight`, `mlp.fc2_latent_proj.weight` (no bias), plus the usual
`mlp.gate.weight`, `mlp.experts.{j}.{gate,up,down}_proj.weight`, `mlp.shared_expert.*`.

Part of the remote-code modeling files: imports only torch and sibling modules.
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import ReferenceMLP, RoutingTap, moe_aux_loss


class ReferenceLatentMoeBlock(nn.Module):
    """Router on x (full width), W_down, routed experts in the latent space, W_up, shared experts."""

    def __init__(self, config) -> None:
        super().__init__()
        d, latent = config.hidden_size, config.moe_latent_size
        self.topk = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.aux_loss_coef = config.router_aux_loss_coef
        self.gate = nn.Linear(d, config.num_experts, bias=False)
        self.fc1_latent_proj = nn.Linear(d, latent, bias=False)  # W_down
        self.experts = nn.ModuleList(
            ReferenceMLP(latent, config.moe_intermediate_size) for _ in range(config.num_experts)
        )
        self.fc2_latent_proj = nn.Linear(latent, d, bias=False)  # W_up
        shared = config.shared_expert_intermediate_size
        self.shared_expert = ReferenceMLP(d, shared) if shared else None
        self.routing = RoutingTap()  # routing replay: record / force the experts (layers.py)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.gate(x)
        z = self.fc1_latent_proj(x)  # [T, l]: what a dispatcher sends, once per (token, expert)
        out = self.fc2_latent_proj(self.routing.dispatch(z, logits, self.experts, self.topk, self.norm_topk_prob))
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out.reshape(shape), moe_aux_loss(logits, self.topk, self.aux_loss_coef)
